"""What the controller writes and sends: the records log and the predictor client.

`RecordLog`: each decision, measurement and transition is one JSON line in `run_dir/records.jsonl` and a
record of the logger `elastic_launcher.records`. `PredictorClient`: `POST /v1/observations` (with the bearer
token) and `POST /v1/plan`, each with a timeout and behind one circuit breaker; it never raises.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import requests

log = logging.getLogger("elastic_launcher.controller")
records_log = logging.getLogger("elastic_launcher.records")


class RecordLog:
    """Decisions, measurements and transitions: one JSON line each in `records.jsonl` and a log record."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[dict] = []

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "t": round(time.time(), 3), **fields}
        self.items.append(record)
        with open(self.path, "a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
        records_log.info("%s", json.dumps(record, sort_keys=True), extra={"record": record})
        return record


class PredictorClient:
    """POST /v1/observations and /v1/plan with a per-request timeout and a circuit breaker.

    Never raises: when the service is unset, unreachable or answers garbage, `plan` returns None and the
    controller falls back to its own measured-efficiency heuristic; the breaker then skips the service for
    `cooldown_s`.
    """

    def __init__(self, url: Optional[str], token: Optional[str], timeout_s: float, cooldown_s: float = 30.0):
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self._open_until = 0.0
        self.last_error: Optional[str] = None

    def _post(self, path: str, body) -> Optional[dict]:
        if self.url is None or time.monotonic() < self._open_until:
            return None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            reply = requests.post(self.url + path, json=body, headers=headers, timeout=self.timeout_s)
            if reply.status_code >= 400:
                raise ValueError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return reply.json()
        except (requests.RequestException, ValueError) as exc:
            self.last_error = f"{path}: {exc}"
            self._open_until = time.monotonic() + self.cooldown_s
            log.warning("predictor %s unavailable (%s); using the launcher heuristic", self.url, exc)
            return None

    def observe(self, records: list[dict]) -> bool:
        return bool(records) and self._post("/v1/observations", records) is not None

    def plan(self, body: dict) -> Optional[dict]:
        reply = self._post("/v1/plan", body)
        return reply if isinstance(reply, dict) and reply.get("action") in ("keep", "rewrite") else None
