"""elastic_common.lua's HTTP client: HTTP/1.1 keep-alive between submissions, and a connection the
server closed while idle (gunicorn's keep-alive timeout) is replaced within the same budget."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.unit.test_lua_hook import REWRITE, install, job, kinds, run_hook


class Server:
    """/v1/plan answering REWRITE over HTTP/1.1; `close_after_reply` drops each connection right after
    its reply without saying so (as a keep-alive timeout does); counts connections and requests."""

    def __init__(self, close_after_reply: bool):
        self.close_after_reply = close_after_reply
        self.connections = 0
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                outer.connections += 1

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                payload = json.dumps(REWRITE).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.close_connection = close_after_reply

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=[False, True], ids=["kept-open", "closed-while-idle"])
def server(request):
    srv = Server(close_after_reply=request.param)
    yield srv
    srv.close()


def test_submissions_share_one_connection_or_replace_a_closed_one(tmp_path, server):
    cases = [{"job_desc": job(time_limit=t), "sleep": 0.05} for t in (1, 2, 3, 4)]   # distinct: no cache hits
    results = run_hook(install(tmp_path, server.url, budget_ms=100), cases)
    assert all(r["job_desc"]["min_nodes"] == 2 for r in results), [kinds(r, "user_msg") for r in results]
    assert all(r["elapsed"] < 0.1 for r in results)
    assert server.requests == 4
    assert server.connections == (4 if server.close_after_reply else 1)


def test_http_1_0_server_gets_a_connection_per_request(tmp_path):
    from tests.unit.test_lua_hook import Predictor      # BaseHTTPRequestHandler's default: HTTP/1.0, closes

    predictor = Predictor()
    try:
        results = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(time_limit=t)} for t in (1, 2)])
        assert [r["job_desc"]["min_nodes"] for r in results] == [2, 2]
        assert len(predictor.requests) == 2
    finally:
        predictor.close()
