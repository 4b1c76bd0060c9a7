"""What a job signs to write to the prediction service: the client side of predictor.auth's munge check, used by
the runtime (elastic_launcher.reporting) and checked by the service (predictor.auth) against the same payload."""
from __future__ import annotations

import hashlib
import subprocess
from datetime import timedelta
from pathlib import Path

__all__ = ["DEFAULT_TIMEOUT", "MUNGE_HEADER", "MungeError", "PAYLOAD_PREFIX", "munge_payload", "munge_sign"]

MUNGE_HEADER = "X-Elastic-Munge"
PAYLOAD_PREFIX = "elastic-predictor/1"
DEFAULT_TIMEOUT = timedelta(seconds=5)


class MungeError(Exception):
    """`munge` could not sign (daemon down, bad socket)."""


def munge_payload(body: bytes, job_id: int) -> str:
    """The text a job signs: binds the job id and the SHA-256 of the exact body bytes it sends."""
    return f"{PAYLOAD_PREFIX} job={int(job_id)} sha256={hashlib.sha256(body).hexdigest()}"


def munge_sign(body: bytes, job_id: int, socket: str | Path | None = None,
               timeout: timedelta = DEFAULT_TIMEOUT) -> dict[str, str]:
    """Sign `body` for job `job_id` with the local munged; returns the header to send with it.

    Send exactly these `body` bytes (`data=body`, not a re-serialised `json=`), e.g.
    `requests.post(url, data=body, headers={"Content-Type": "application/json", **munge_sign(body, job)})`.

    Args:
        socket: munged's socket (`munge --socket`); None uses munge's default.

    Raises:
        MungeError: munge is missing, timed out or failed (its message included).
    """
    argv = ["munge", "-s", munge_payload(body, job_id)]
    if socket:
        argv.append(f"--socket={socket}")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout.total_seconds(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MungeError(f"cannot run munge: {exc}") from exc
    if proc.returncode != 0 or not proc.stdout.startswith("MUNGE:"):
        raise MungeError(f"munge failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return {MUNGE_HEADER: proc.stdout.strip()}
