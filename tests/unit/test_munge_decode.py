"""The service decodes munge credentials with libmunge in its own process (#24.4: an `unmunge` run a credential
cost a fork of the worker, and a flood of valid credentials for made-up job ids held the plan workers' CPU).
Against a private munged; both ways (in process, `unmunge`) give the same answers."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from predictor.auth import AuthError, LibMunge, Unmunger

pytestmark = pytest.mark.skipif(shutil.which("munged") is None or LibMunge.load() is None,
                                reason="munge is not installed (.ci/setup installs it)")


@pytest.fixture
def munged(tmp_path):
    key = tmp_path / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = tmp_path / "munge.socket"
    proc = subprocess.Popen(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                             f"--pid-file={tmp_path / 'munged.pid'}", f"--log-file={tmp_path / 'munged.log'}",
                             f"--seed-file={tmp_path / 'munged.seed'}"])
    for _ in range(200):  # until its socket answers
        if subprocess.run(["munge", f"--socket={sock}", "-n"], capture_output=True).returncode == 0:
            break
        time.sleep(0.05)
    yield str(sock)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)


def _sign(sock: str, payload: str) -> str:
    return subprocess.run(["munge", f"--socket={sock}", "-s", payload], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_in_process_and_unmunge_decode_alike(munged):
    lib, run = Unmunger(munged), Unmunger(munged, in_process=False)
    assert isinstance(lib.lib, LibMunge) and run.lib is None
    payload = "elastic-predictor/1 job=12 sha256=" + "ab" * 32
    a, b = lib.decode(_sign(munged, payload)), run.decode(_sign(munged, payload))
    assert (a.uid, a.gid, a.payload.strip()) == (b.uid, b.gid, b.payload.strip()) == (os.getuid(), os.getgid(),
                                                                                      payload)


@pytest.mark.parametrize("in_process", [True, False])
def test_a_replayed_credential_is_refused_and_says_so(munged, in_process):
    u = Unmunger(munged, in_process=in_process)
    cred = _sign(munged, "x")
    u.decode(cred)
    with pytest.raises(AuthError) as err:
        u.decode(cred)
    assert err.value.status == 401 and err.value.reason == "bad_credential" and "replayed" in str(err.value)


def test_a_forged_credential_is_refused(munged):
    with pytest.raises(AuthError) as err:
        Unmunger(munged).decode("MUNGE:" + "A" * 40 + ":")
    assert err.value.status == 401 and err.value.reason == "bad_credential"


def test_munged_unreachable_is_a_503_not_a_bad_credential(munged, tmp_path):
    cred = _sign(munged, "x")
    with pytest.raises(AuthError) as err:
        Unmunger(str(tmp_path / "no.socket")).decode(cred)
    assert err.value.status == 503 and err.value.reason == "munge_unavailable"
