"""How `elastic-predictor serve` runs the app: gunicorn workers behind a buffering front end (issue #14, item 3).

gunicorn's sync worker reads a request on the worker's only thread, and its gthread worker on one of the
worker's threads: a client that sends half a request and waits holds a worker (sync: until the worker timeout
kills it, 30 s) or a thread (gthread: for as long as it likes). Two such connections stalled every /v1/plan
behind them. The front end here reads each request whole before any worker sees it:

- `FrontEnd` (asyncio, one thread, in the process `serve` runs in) accepts the clients on --host:--port. It
  reads a request's head and body into memory, with limits: the request line at most `MAX_REQUEST_LINE` bytes
  (else 414), each header line at most `MAX_HEADER_LINE`, the head at most `MAX_HEAD` bytes and
  `MAX_HEADER_FIELDS` fields (else 431), the body at most ELASTIC_PREDICTOR_MAX_BODY (else 413, answered from
  Content-Length before the body is read); the whole request must arrive within `read_timeout` (10 s) of the
  connection being ready for it (accepted, or the previous answer sent): else 408 when part of it came, a plain
  close when nothing did (an idle keep-alive connection). Chunked bodies are decoded; `Expect: 100-continue` is
  answered. Only a complete request goes on, over a unix socket to gunicorn, as one request with its
  Content-Length and `Connection: close`; the whole answer is read back and then written to the client, so a
  client that does not read its answer holds only its own buffer (it is dropped after `write_timeout`). Errors
  the front end answers itself are JSON `{"error", "field"}`, like the app's.
- gunicorn (its sync workers, or gthread with --threads > 1) runs in a child process, bound to a unix socket in a
  private temporary folder; it dies with the front end (PR_SET_PDEATHSIG), and the front end exits when it does.
  SIGTERM/SIGINT stop accepting, let gunicorn finish what it has (its graceful timeout) and exit; SIGHUP is
  passed on (gunicorn restarts its workers).

`serve --server gunicorn` runs gunicorn alone on --host:--port, as before the front end existed.
bench/slow_clients.py measures both (and gevent workers, waitress).
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import glob
import json
import os
import re
import resource
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from typing import Callable

MAX_REQUEST_LINE = 4094          # gunicorn's limit_request_line
MAX_HEADER_LINE = 8190           # gunicorn's limit_request_field_size
MAX_HEADER_FIELDS = 100          # gunicorn's limit_request_fields
MAX_HEAD = 32 * 1024             # request line and all headers
CONNECT_WAIT_S = 10.0            # gunicorn's socket not there or refusing (starting, restarting): 503 after this
SEND_BUFFER = 32 * 1024          # SO_SNDBUF of a client socket (the kernel doubles it): what an answer a client
                                 # does not read may occupy in the kernel before the front end stops for it
LINGER_S = 2.0                   # after an error answer, read and drop what the client still sends, this long
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"transfer-encoding", b"content-length",
               b"expect", b"upgrade", b"trailer", b"x-forwarded-for", b"x-elastic-hook"}   # only nginx sets the last
_METHOD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[^\x00-\x20\x7f]+")
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large", 414: "URI Too Long",
            431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported"}


def gunicorn_application(load: Callable, *, bind: str, workers: int, threads: int, timeout: int,
                         worker_class: str | None = None, post_fork: Callable[[], None] | None = None):
    """A gunicorn application running `load()` (the WSGI app, built in each worker) on `bind`; `post_fork()` runs
    in each worker as it starts, before `load()`."""
    from gunicorn.app.base import BaseApplication  # noqa: PLC0415 - gunicorn: only the gunicorn front end

    class Application(BaseApplication):
        def load_config(self):
            self.cfg.set("bind", bind)
            self.cfg.set("workers", workers)
            self.cfg.set("threads", threads)
            self.cfg.set("timeout", timeout)
            if worker_class:
                self.cfg.set("worker_class", worker_class)
            self.cfg.set("accesslog", None)
            self.cfg.set("proc_name", "elastic-predictor")
            if "control_socket_disable" in self.cfg.settings:   # gunicorn >= 24: one socket path per user
                self.cfg.set("control_socket_disable", True)
            if post_fork is not None:
                self.cfg.set("post_fork", lambda server, worker: post_fork())

        def load(self):
            return load()     # per worker: its own connections and refit thread

    return Application()


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the front end allows a client (docs/admin-guide.md, "Slow clients")."""

    max_body: int = 4 * 1024 * 1024   # ELASTIC_PREDICTOR_MAX_BODY
    read_timeout: float = 10.0        # a whole request, from the connection being ready for it
    write_timeout: float = 30.0       # a client that does not take its answer for this long is dropped
    upstream_timeout: float = 35.0    # gunicorn's answer (its worker timeout + 5 s); then 504
    max_connections: int = 1000       # more at once: 503 and close


class _Reject(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def error_response(status: int, message: str, field: str | None = None, close: bool = True,
                   extra: tuple[bytes, ...] = ()) -> bytes:
    body = json.dumps({"error": message, "field": field}).encode()
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, "Error").encode()),
            b"Content-Type: application/json", b"Content-Length: %d" % len(body), *extra]
    if close:
        head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@dataclasses.dataclass
class _Request:
    method: bytes
    version: bytes            # b"1.0" or b"1.1"
    forward_head: bytes       # request line and end-to-end headers, for gunicorn (no terminator)
    keep_alive: bool
    body_start: int           # offset of the body in the connection's buffer
    length: int | None        # Content-Length, or None for a chunked body
    expect_continue: bool


def parse_head(head: bytes, peer: str) -> _Request:
    """The request in `head` (request line and headers, without the blank line), checked; raises _Reject."""
    lines = head.split(b"\r\n")
    request_line = lines[0]
    if len(request_line) > MAX_REQUEST_LINE:
        raise _Reject(414, f"request line longer than {MAX_REQUEST_LINE} bytes")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]) \
            or not parts[2].startswith(b"HTTP/"):
        raise _Reject(400, "malformed request line")
    version = parts[2][5:]
    if version not in (b"1.0", b"1.1"):
        raise _Reject(505, "only HTTP/1.0 and HTTP/1.1 are served") if re.fullmatch(rb"\d\.\d", version) \
            else _Reject(400, "malformed HTTP version")
    if len(lines) - 1 > MAX_HEADER_FIELDS:
        raise _Reject(431, f"more than {MAX_HEADER_FIELDS} header fields")
    kept = [request_line]
    lengths: set[bytes] = set()
    chunked = expect = False
    connection = b""
    for line in lines[1:]:
        if len(line) > MAX_HEADER_LINE:
            raise _Reject(431, f"a header line longer than {MAX_HEADER_LINE} bytes")
        name, sep, value = line.partition(b":")
        if not sep or not _FIELD_NAME.fullmatch(name):     # also a folded line, or space before the colon
            raise _Reject(400, "malformed header line")
        value = value.strip(b" \t")
        if b"\r" in line or b"\n" in line or _BAD_VALUE.search(value):
            raise _Reject(400, "control character in a header")
        lname = name.lower()
        if lname == b"content-length":
            if not _DIGITS.fullmatch(value):
                raise _Reject(400, "bad Content-Length")
            lengths.add(value.lstrip(b"0") or b"0")
        elif lname == b"transfer-encoding":
            if value.lower() != b"chunked" or chunked or version == b"1.0":
                raise _Reject(501, "only `Transfer-Encoding: chunked` is understood")
            chunked = True
        elif lname == b"expect":
            if value.lower() != b"100-continue":
                raise _Reject(400, "only `Expect: 100-continue` is understood")  # RFC 9110: 417
            expect = True
        elif lname == b"connection":
            connection += b"," + value.lower()
        if lname not in _HOP_BY_HOP:
            kept.append(line)
    if len(lengths) > 1 or (lengths and chunked):
        raise _Reject(400, "conflicting Content-Length / Transfer-Encoding")
    length = None if chunked else int(lengths.pop()) if lengths else 0
    tokens = {t.strip() for t in connection.split(b",")}
    keep_alive = b"close" not in tokens if version == b"1.1" else False
    kept.append(b"X-Forwarded-For: " + peer.encode("ascii", "replace"))
    kept.append(b"Connection: close")
    return _Request(parts[0], version, b"\r\n".join(kept), keep_alive, 0, length, expect)


class _ChunkedBody:
    """Incremental decoder of a chunked body in a growing buffer (trailers are dropped)."""

    def __init__(self, start: int, limit: int):
        self.pos, self.limit = start, limit
        self.body = bytearray()
        self.state = "size"
        self.remaining = 0

    def feed(self, buf: bytearray) -> int | None:
        """Decode what `buf` holds; the offset just past the body when it is complete, else None."""
        while True:
            if self.state in ("size", "trailer"):
                end = buf.find(b"\r\n", self.pos)
                if end < 0:
                    if len(buf) - self.pos > MAX_HEADER_LINE:
                        raise _Reject(400, "malformed chunked body")
                    return None
                line = bytes(buf[self.pos:end])
                self.pos = end + 2
                if self.state == "trailer":
                    if not line:
                        return self.pos
                    continue
                size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise _Reject(400, "malformed chunk size")
                self.remaining = int(size, 16)
                if len(self.body) + self.remaining > self.limit:
                    raise _Reject(413, f"request body larger than {self.limit} bytes", "body")
                self.state = "data" if self.remaining else "trailer"
            elif self.state == "data":
                take = min(self.remaining, len(buf) - self.pos)
                self.body += buf[self.pos:self.pos + take]
                self.pos += take
                self.remaining -= take
                if self.remaining:
                    return None
                self.state = "crlf"
            else:   # crlf after a chunk's data
                if len(buf) - self.pos < 2:
                    return None
                if buf[self.pos:self.pos + 2] != b"\r\n":
                    raise _Reject(400, "malformed chunked body")
                self.pos += 2
                self.state = "size"


def finish_response(raw: bytes, method: bytes, version: bytes, keep_alive: bool) -> tuple[bytes, bool]:
    """gunicorn's answer (it closed after it) rewritten for the client: its own Connection header, and kept
    alive only when the client asked and the answer's length is known. Returns (bytes, keep alive)."""
    end = raw.find(b"\r\n\r\n")
    if end < 0 or not raw.startswith(b"HTTP/1."):
        raise _Reject(502, "the application server sent no complete answer")
    lines = raw[:end].split(b"\r\n")
    status = int(lines[0][9:12]) if len(lines[0]) >= 12 and lines[0][9:12].isdigit() else 0
    body_len = len(raw) - end - 4
    kept, framed = [lines[0]], method == b"HEAD" or status in (204, 304) or 100 <= status < 200
    for line in lines[1:]:
        lname = line.split(b":", 1)[0].strip().lower()
        if lname in (b"connection", b"keep-alive"):
            continue
        if lname == b"content-length":
            framed = framed or line.split(b":", 1)[1].strip() == b"%d" % body_len
        elif lname == b"transfer-encoding":
            framed = framed or raw.endswith(b"\r\n\r\n")     # chunked, to its last chunk
        kept.append(line)
    keep = keep_alive and framed and version == b"1.1"
    if not keep:
        kept.append(b"Connection: close")
    return b"\r\n".join(kept) + raw[end:], keep


class _Connection(asyncio.Protocol):
    """One client connection: reads a request whole, has the upstream answer it, writes the answer back."""

    def __init__(self, front: "FrontEnd"):
        self.front = front
        self.loop = front.loop
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = "-"
        self.request: _Request | None = None
        self.chunked: _ChunkedBody | None = None
        self.state = "read"         # read | busy (upstream working) | paused (client not reading) | closing
        self.timer: asyncio.TimerHandle | None = None
        self.writing_paused = False
        self.got_bytes = False      # of the request being read
        self.continued = False

    # -- asyncio callbacks --
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        # the next request of a client is taken only once its last answer is in its socket buffer: one that
        # pipelines requests and reads nothing gets a bounded amount of work done (one or two answers)
        transport.set_write_buffer_limits(high=0)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else "-"
        self.front.connections.add(self)
        if len(self.front.connections) > self.front.limits.max_connections:
            self._fail(_Reject(503, f"more than {self.front.limits.max_connections} connections; try again"),
                       linger=False)
            return
        self._arm(self.front.limits.read_timeout)

    def connection_lost(self, exc):
        self.front.connections.discard(self)
        self._disarm()
        self.state = "closed"

    def data_received(self, data):
        if self.state == "closing":
            return                   # lingering after an error answer: dropped
        self.buf += data
        self.got_bytes = True
        if self.state == "read":
            self._advance()
        elif len(self.buf) > MAX_HEAD + self.front.limits.max_body:
            self.transport.pause_reading()     # a pipelining client far ahead of its answers

    def eof_received(self):
        if self.state in ("read", "closing"):
            return False             # nothing complete is pending (it would be in flight): close
        return True                  # half-closed while its answer is on the way (or not taken): keep writing

    def pause_writing(self):
        self.writing_paused = True

    def resume_writing(self):
        self.writing_paused = False
        if self.state == "paused":
            self._ready_for_next()

    # -- reading --
    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        self.timer = None
        if self.state == "read":
            if not self.got_bytes and not self.request:
                self.transport.close()           # idle: nothing of a request came
            else:
                self._fail(_Reject(408, f"the request did not arrive in full within "
                                        f"{self.front.limits.read_timeout:g} s"))
        elif self.state == "paused":
            self.transport.abort()               # the client does not read its answer
        elif self.state == "closing":
            if self.transport.get_write_buffer_size():
                self.transport.abort()           # nor this one
            else:
                self.transport.close()

    def _advance(self) -> None:
        try:
            self._parse()
        except _Reject as reject:
            self._fail(reject)

    def _parse(self) -> None:
        limits = self.front.limits
        if self.request is None:
            while self.buf.startswith(b"\r\n"):  # stray CRLFs between requests
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise _Reject(431, f"request head larger than {MAX_HEAD} bytes")
                if self.buf.find(b"\r\n") < 0 and len(self.buf) > MAX_REQUEST_LINE:
                    raise _Reject(414, f"request line longer than {MAX_REQUEST_LINE} bytes")
                return
            if end > MAX_HEAD:
                raise _Reject(431, f"request head larger than {MAX_HEAD} bytes")
            request = parse_head(bytes(self.buf[:end]), self.peer)
            request.body_start = end + 4
            if request.length is not None and request.length > limits.max_body:
                raise _Reject(413, f"request body larger than {limits.max_body} bytes", "body")
            self.request = request
            if request.length is None:
                self.chunked = _ChunkedBody(request.body_start, limits.max_body)
        request = self.request
        if request.length is not None:
            end = request.body_start + request.length
            if len(self.buf) < end:
                self._continue()
                return
            body = bytes(self.buf[request.body_start:end])
        else:
            end = self.chunked.feed(self.buf)
            if end is None:
                self._continue()
                return
            body = bytes(self.chunked.body)
        del self.buf[:end]
        self.request, self.chunked = None, None
        self._dispatch(request, body)

    def _continue(self) -> None:
        if self.request.expect_continue and not self.continued:
            self.continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _dispatch(self, request: _Request, body: bytes) -> None:
        self._disarm()
        self.state = "busy"
        self.transport.pause_reading()
        data = b"%s\r\nContent-Length: %d\r\n\r\n%s" % (request.forward_head, len(body), body)
        task = self.loop.create_task(self._forward(request, data))
        self.front.tasks.add(task)
        task.add_done_callback(self.front.tasks.discard)

    async def _forward(self, request: _Request, data: bytes) -> None:
        try:
            raw = await self.front.upstream(data)
            answer, keep = finish_response(raw, request.method, request.version, request.keep_alive)
        except _Reject as reject:
            answer, keep = error_response(reject.status, reject.message, reject.field), False
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the front end
            self.front.log(f"front end: request failed: {type(exc).__name__}: {exc!r}")
            answer, keep = error_response(502, f"front end error: {type(exc).__name__}"), False
        if self.state == "closed":
            return
        self.transport.write(answer)
        if not keep:
            self._close_after_write()
            return
        self._ready_for_next()

    def _ready_for_next(self) -> None:
        if self.writing_paused:                  # the client is not taking its answers: wait, bounded
            self.state = "paused"
            self._arm(self.front.limits.write_timeout)
            return
        self.state = "read"
        self.got_bytes = bool(self.buf)
        self.continued = False
        self._arm(self.front.limits.read_timeout)
        self.transport.resume_reading()
        if self.buf:
            self._advance()

    # -- ending --
    def _fail(self, reject: _Reject, linger: bool = True) -> None:
        self.transport.write(error_response(reject.status, reject.message, reject.field))
        if linger:
            self._close_after_write()
        else:
            self.transport.close()

    def _close_after_write(self) -> None:
        """Send what is buffered, then close; meanwhile drop what the client still sends, so it gets to read
        the answer (closing with unread data would reset the connection)."""
        self.state = "closing"
        self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_S if not self.writing_paused else self.front.limits.write_timeout)


class FrontEnd:
    """The asyncio server in front of gunicorn (see the module docstring)."""

    def __init__(self, sock: socket.socket, upstream_path: str, limits: Limits, log: Callable[[str], None]):
        self.sock, self.upstream_path, self.limits, self.log = sock, upstream_path, limits, log
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def upstream(self, data: bytes) -> bytes:
        """Send one complete request to gunicorn, return its whole answer (it closes after it)."""
        loop = self.loop
        deadline = loop.time() + self.limits.upstream_timeout
        connect_by = loop.time() + CONNECT_WAIT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    try:                         # a unix socket connects at once, or fails
                        sock.connect(self.upstream_path)
                        break
                    except (BlockingIOError, InterruptedError):
                        await asyncio.sleep(0.01)            # its backlog is full: gunicorn is behind
                    except (FileNotFoundError, ConnectionRefusedError):
                        await asyncio.sleep(0.05)            # gunicorn starting (or restarting)
                    if loop.time() > connect_by:
                        raise _Reject(503, "the application server is not accepting connections")
                try:
                    await loop.sock_sendall(sock, data)
                except (BrokenPipeError, ConnectionResetError):
                    pass                         # it answered before reading everything: read the answer
                chunks = []
                while True:
                    try:
                        chunk = await loop.sock_recv(sock, 262144)
                    except ConnectionResetError:  # closed with part of the request unread, after its answer
                        break
                    if not chunk:
                        break
                    chunks.append(chunk)
        except TimeoutError:
            raise _Reject(504, f"no answer from the application within {self.limits.upstream_timeout:g} s") \
                from None
        finally:
            sock.close()
        if not chunks:
            raise _Reject(502, "the application server closed the connection without an answer")
        return b"".join(chunks)

    async def serve(self, stop: asyncio.Event) -> None:
        self.loop = asyncio.get_running_loop()
        server = await self.loop.create_server(lambda: _Connection(self), sock=self.sock, backlog=2048)
        try:
            await stop.wait()
        finally:
            server.close()               # stop accepting; what is in flight goes on

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout`) for the requests in flight, then close every connection."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


FOLDER_PREFIX = "elastic-predictor-"


def prune_stale_folders(parent: str, older_than_s: float = 60.0) -> list[str]:
    """Remove the socket folders of earlier `serve`s killed with SIGKILL (nothing listens on their socket any
    more); a folder younger than `older_than_s` may be a `serve` still starting, and is left. Returns the removed."""
    removed = []
    for folder in glob.glob(os.path.join(parent, FOLDER_PREFIX + "*")):
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or \
                    time.time() - info.st_mtime < older_than_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(os.path.join(folder, "gunicorn.sock"))
                    continue                       # a live one
                except (FileNotFoundError, ConnectionRefusedError):
                    pass
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raise_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft


def listen(host: str, port: int) -> socket.socket:
    """The client-facing socket, bound and listening (so a port in use is an error at once)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def run_buffered(load: Callable, *, host: str, port: int, workers: int, threads: int, timeout: int,
                 limits: Limits, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> int:
    """Serve `load()` (built in each gunicorn worker) behind the front end; returns the exit status."""
    sock = listen(host, port)
    fds = _raise_fd_limit(2 * limits.max_connections + 256)
    if fds < 2 * limits.max_connections + 64:
        limits = dataclasses.replace(limits, max_connections=max(16, (fds - 64) // 2))
        log(f"front end: open-file limit {fds}: at most {limits.max_connections} client connections")
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    upstream = os.path.join(folder, "gunicorn.sock")
    if len(upstream) > 100:                       # AF_UNIX path limit (108)
        shutil.rmtree(folder, ignore_errors=True)
        folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir="/tmp")
        upstream = os.path.join(folder, "gunicorn.sock")
    prune_stale_folders(os.path.dirname(folder))
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:                                # gunicorn: the arbiter and its workers
        status = 1
        try:
            sock.close()
            _die_with_parent()
            if os.getppid() != parent:
                os._exit(1)
            gunicorn_application(load, bind=f"unix:{upstream}", workers=workers, threads=threads,
                                 timeout=timeout).run()
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    try:
        return asyncio.run(_supervise(sock, upstream, child, limits, log, host, port))
    finally:
        try:
            os.kill(child, signal.SIGKILL) if _alive(child) else None
        except ProcessLookupError:
            pass
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


async def _supervise(sock, upstream: str, child: int, limits: Limits, log, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exited: dict[str, int] = {}
    front = FrontEnd(sock, upstream, limits, log)

    def terminate() -> None:
        stop.set()

    def forward(signum: int) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    def reap() -> None:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pid, status = child, 0
        if pid == child and "status" not in exited:
            code = os.waitstatus_to_exitcode(status)
            exited["status"] = 128 - code if code < 0 else code      # killed by a signal: 128 + its number
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        loop.add_signal_handler(signum, terminate)
    for signum in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2):
        loop.add_signal_handler(signum, forward, signum)
    loop.add_signal_handler(signal.SIGCHLD, reap)
    reap()
    log(f"front end on {host}:{port}: requests read whole (head <= {MAX_HEAD} bytes, body <= {limits.max_body} "
        f"bytes, within {limits.read_timeout:g} s), then passed to gunicorn on unix:{upstream}")
    await front.serve(stop)
    if "status" in exited:
        status = exited["status"]
        log(f"front end: gunicorn exited with status {status}; stopping")
        await front.drain(0)
        return status if status else 1
    forward(signal.SIGTERM)                       # gunicorn finishes what it has, then exits
    await front.drain(limits.upstream_timeout)
    for _ in range(int(limits.upstream_timeout * 10)):
        if "status" in exited:
            break
        reap()
        await asyncio.sleep(0.1)
    return 0
