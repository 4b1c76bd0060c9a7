"""Slow and idle clients (issue #14, item 3): `elastic-predictor serve` keeps answering while half-sent requests
are held, and the buffering front end (predictor/server.py) reads, limits and forwards requests correctly.

The first test starts the real server (front end + gunicorn, as `serve --server buffered` runs it). Under the previous
default (`serve --server gunicorn`, sync workers) it fails: the 16 held connections occupy both workers, and
/healthz is not answered within the 5 s hang guard (it took ~31 s, until gunicorn killed the workers). The other
tests run the front end alone in a thread, in front of a fake upstream that echoes what it received.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from predictor.server import FrontEnd, Limits, listen
from tests.unit.test_cli import history, runner  # noqa: F401 - the same database fixture as the CLI tests

HALF_SENT = b"POST /v1/plan HTTP/1.1\r\nHost: x\r\n"
PLAN = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=64"]}
HANG_GUARD_S = 5.0          # a liveness bound, not a speed assertion


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # a real front end + gunicorn
def test_serve_answers_healthz_and_plan_while_16_half_sent_requests_are_held(history, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--db", history, "--workers", "2", "--read-timeout", "3",
                                 "--server", "buffered", "--allow-dev", "buffered"],  # this front end's own answers (408); nginx: test_front_nginx
                                env=dict(os.environ, ELASTIC_PREDICTOR_TOKEN="tok"), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=2).json().get("model_version"):
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, f"serve did not come up:\n{log.read_text()}"
            time.sleep(0.2)
        for _ in range(16):
            sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
            sock.sendall(HALF_SENT)
            held.append(sock)
        time.sleep(0.5)                  # the held requests reach whatever would read them
        health = requests.get(f"{base}/healthz", timeout=HANG_GUARD_S)
        assert health.status_code == 200 and health.json()["model_version"]
        plan = requests.post(f"{base}/v1/plan", json=PLAN, timeout=HANG_GUARD_S)
        assert plan.status_code == 200 and plan.json()["action"] == "rewrite", plan.text
        # the read deadline (--read-timeout 3): each held connection is answered 408 and closed
        for sock in held:
            sock.settimeout(10)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"].startswith("the request did not arrive")
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert proc.returncode == 0, log.read_text()
    assert "Booting worker" in log.read_text()


# -------------------------------------------------------------------------------------------------------------
class _Echo(socketserver.StreamRequestHandler):
    """The fake gunicorn: reads one request (Content-Length framed), answers it described as JSON, closes."""

    def handle(self):
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.request.recv(65536)
            if not chunk:
                return
            head += chunk
        head, _, body = head.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = [line.split(":", 1) for line in lines[1:]]
        length = int(next(v for k, v in headers if k.lower() == "content-length"))
        while len(body) < length:
            body += self.request.recv(65536)
        if lines[0].split()[1] == "/slow":
            time.sleep(0.3)
        answer = json.dumps({"line": lines[0], "headers": [[k, v.strip()] for k, v in headers],
                             "body": body.decode("latin-1")}).encode()
        if lines[0].split()[1] == "/big":
            answer += b" " * 400_000
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))


class _Front:
    def __init__(self, upstream: str, limits: Limits):
        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.log: list[str] = []
        self.front = FrontEnd(self.sock, upstream, limits, log=self.log.append)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    async def _main(self):
        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.loop.call_soon(self.ready.set)
        await self.front.serve(self.stop)
        await self.front.drain(1)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S)


@pytest.fixture
def front(tmp_path):
    path = str(tmp_path / "up.sock")
    upstream = socketserver.ThreadingUnixStreamServer(path, _Echo)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, args=(0.05,), daemon=True).start()
    fronts = []

    def make(**limits) -> _Front:
        fronts.append(_Front(path, Limits(**{"max_body": 1000, "read_timeout": 1.0, "write_timeout": 1.0,
                                             "upstream_timeout": 5.0, **limits})))
        return fronts[-1]

    yield make
    for f in fronts:
        f.close()
    upstream.shutdown()
    upstream.server_close()


def _read_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One answer (Content-Length framed) from a raw socket: status, headers (lower-case names), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_front_end_forwards_whole_requests_and_keeps_the_client_connection(front):
    f = front()
    conn = http.client.HTTPConnection("127.0.0.1", f.port, timeout=HANG_GUARD_S)
    for i in range(3):                                   # one client connection, three requests
        conn.request("POST", f"/v1/plan?i={i}", body=b'{"a": 1}', headers={"Content-Type": "application/json",
                                                                            "X-Forwarded-For": "1.2.3.4"})
        response = conn.getresponse()
        seen = json.loads(response.read())
        assert response.status == 200 and response.getheader("Connection") is None   # kept alive
        headers = {k.lower(): v for k, v in seen["headers"]}
        assert seen["line"] == f"POST /v1/plan?i={i} HTTP/1.1" and seen["body"] == '{"a": 1}'
        assert headers["connection"] == "close" and headers["content-length"] == "8"
        assert headers["x-forwarded-for"] == "127.0.0.1" and headers["content-type"] == "application/json"
    conn.close()


def test_front_end_decodes_chunked_bodies_and_answers_expect_100_continue(front):
    f = front()
    with f.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: t\r\n\r\n")
        status, _, body = _read_answer(sock)
        seen = json.loads(body)
        assert status == 200 and seen["body"] == "abcde"
        assert not any(k.lower() in ("transfer-encoding", "trailer") for k, _ in seen["headers"])
        sock.sendall(b"POST /y HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"wxyz")
        status, _, body = _read_answer(sock)
        assert status == 200 and json.loads(body)["body"] == "wxyz"


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /v1/plan HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n", 413),   # said before any body byte
    (b"POST /v1/plan HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3e9\r\n" + b"x" * 1001, 413),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nX-A: " + b"b" * 9000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + (b"X-A: " + b"b" * 8000 + b"\r\n") * 5, 431),      # no end yet, past 32 KiB
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nX-A: b\r\n folded\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
])
def test_front_end_refuses_what_is_too_large_or_malformed_itself(front, request_bytes, status):
    f = front()
    with f.connect() as sock:
        sock.sendall(request_bytes)
        got, headers, body = _read_answer(sock)
        assert got == status and headers["connection"] == "close", body
        assert set(json.loads(body)) == {"error", "field"}


def test_front_end_times_out_a_partial_request_and_closes_an_idle_connection(front):
    f = front(read_timeout=0.5)
    with f.connect() as partial, f.connect() as idle, f.connect() as body:
        partial.sendall(HALF_SENT)
        body.sendall(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n12345")
        t0 = time.monotonic()
        for sock in (partial, body):
            status, _, answer = _read_answer(sock)
            assert status == 408 and "within 0.5 s" in json.loads(answer)["error"]
        assert idle.recv(100) == b""                     # nothing was sent on it: closed without an answer
        assert time.monotonic() - t0 < HANG_GUARD_S


def test_front_end_answers_while_many_connections_are_held(front):
    f = front(read_timeout=30)
    held = [f.connect() for _ in range(100)]
    for i, sock in enumerate(held):
        sock.sendall([HALF_SENT, b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",
                      b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n" * 3][i % 3])
    try:
        for _ in range(5):
            t0 = time.monotonic()
            with f.connect() as sock:
                sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
                got = _read_answer(sock)
                assert got[0] == 200, got
            assert time.monotonic() - t0 < HANG_GUARD_S
    finally:
        for sock in held:
            sock.close()


def test_front_end_drops_a_client_that_does_not_read_its_answers(front):
    f = front(write_timeout=0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", f.port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n" * 20)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and not f.front.connections:
        time.sleep(0.01)
    while f.front.connections and time.monotonic() < deadline:   # paused writing for > write_timeout: dropped
        time.sleep(0.05)
    assert not f.front.connections
    received = 0
    sock.settimeout(HANG_GUARD_S)
    try:                                                 # what the kernel still had, then the end
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        pass
    sock.close()
    assert received < 20 * 400_000


@pytest.fixture
def short_tmp():
    """A folder with a short path: a unix socket's path holds at most 107 bytes, and pytest's tmp_path under
    pytest-xdist (`/tmp/pytest-of-root/pytest-N/popen-gw0/test_.../`) is longer than that with a socket in it."""
    folder = tempfile.mkdtemp(prefix="sk", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_socket_folders_of_killed_servers_are_pruned_and_live_ones_kept(short_tmp):
    from predictor.server import FOLDER_PREFIX, prune_stale_folders

    tmp_path = short_tmp
    dead, live, young = (tmp_path / f"{FOLDER_PREFIX}{name}" for name in ("dead", "live", "young"))
    for folder in (dead, live, young):
        folder.mkdir()
    (dead / "gunicorn.sock").touch()                     # a socket file nobody listens on
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live / "gunicorn.sock"))
        listener.listen(1)
        old = time.time() - 120
        for folder in (dead, live):
            os.utime(folder, (old, old))
        assert prune_stale_folders(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and young.exists()
