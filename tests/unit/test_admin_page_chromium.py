"""The /admin page in a real browser: `elastic-predictor serve` (gunicorn) on localhost with a seeded
history, Debian's headless Chromium takes a screenshot and dumps the DOM.

Needs the `chromium` apt package (CI installs it); fails, never skips, without it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_admin_views import PLAN, seed_records

pytestmark = pytest.mark.slow  # gunicorn and a headless Chromium

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]
PLOT_BLUE = np.array([0x1F, 0x77, 0xB4]) / 255.0   # plots.COLORS[0]


def _status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5.0) as response:
        response.read()
        return response.status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0, data: bytes | None = None) -> bytes:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("live")
    jsonl = work / "seed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in seed_records()))
    db = work / "p.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_PREDICTOR_")}
    cli = [sys.executable, "-m", "predictor.cli"]
    subprocess.run(cli + ["import", "--db", str(db), str(jsonl)], check=True, env=env, capture_output=True, timeout=120)
    port = _free_port()
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen(cli + ["serve", "--host", "127.0.0.1", "--port", str(port), "--db", str(db),
                                   "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (work / "serve.log").read_text()
            try:
                if json.loads(_get(base + "/healthz"))["model_version"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the service did not fit its model within 120 s"
            time.sleep(0.3)
        for _ in range(3):
            _get(base + "/v1/plan", data=json.dumps(PLAN).encode())
        for plot in ("/admin/plots/scaling.png", "/admin/plots/links.png"):   # drawn in the background (#14.4)
            while _status(base + plot) != 200:
                assert time.monotonic() < deadline, f"{plot} was not drawn within 120 s"
                time.sleep(0.1)
        yield base, work
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("headless Chromium is not installed: apt-get install -y chromium", pytrace=False)
    return path


def _run_chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


def test_admin_page_screenshot_shows_tables_and_plots(live_server, tmp_path):
    base, work = live_server
    shot = work / "admin.png"   # kept beside the server log for a human look
    proc = _run_chromium(["--window-size=1280,2600", f"--screenshot={shot}", base + "/admin"], tmp_path / "profile")
    assert shot.exists() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    from matplotlib.image import imread  # matplotlib loads with the first plot, not at collection

    image = imread(str(shot))[:, :, :3]
    assert image.shape[:2] == (2600, 1280)
    colours = np.unique((image * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 100, "the screenshot is (nearly) a single colour"
    blue = np.all(np.abs(image - PLOT_BLUE) < 0.05, axis=-1).sum()
    assert blue > 500, "no plot lines in the screenshot: the PNG plots did not load"


def test_admin_page_dom_in_the_browser(live_server, tmp_path):
    base, _ = live_server
    proc = _run_chromium(["--dump-dom", base + "/admin"], tmp_path / "profile")
    dom = proc.stdout
    assert "<h1>elastic-predictor</h1>" in dom, proc.stderr[-2000:]
    assert dom.count('href="/admin/decisions/d-') == 3 and ">rewrite<" in dom
    assert ">resnet50<" in dom and ">gpt2<" in dom and ">nvlink<" in dom
    assert 'src="/admin/plots/scaling.png"' in dom and 'src="/admin/plots/links.png"' in dom
