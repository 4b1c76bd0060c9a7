"""`elastic-predictor import`: JSON lines of observations and profiles, every line validated before any write.

A line is an observation record (`slurm_plugin.contracts.records.validate_record`) or a profile (`"kind": "profile"`, or an
object with `tensors` and no `kind`), validated by the same `register` the API uses. A bad line becomes one
message `FILE:LINE: FIELD: what is wrong`; the CLI decides whether the good lines are stored.
"""
from __future__ import annotations

import dataclasses
import json
from typing import BinaryIO, Iterator

from predictor.errors import ValidationError
from slurm_plugin.contracts.records import validate_record


@dataclasses.dataclass
class Parsed:
    """What a file holds: validated records, profiles to store (name -> body), messages of bad lines."""

    records: list[dict] = dataclasses.field(default_factory=list)
    profiles: dict[str, dict] = dataclasses.field(default_factory=dict)
    bad: list[str] = dataclasses.field(default_factory=list)

    def put_profile(self, name: str, body: dict) -> bool:
        """`register` stores through this (in place of the store): nothing is written yet."""
        created = name not in self.profiles
        self.profiles[name] = body
        return created


def _lines(file: BinaryIO, name: str) -> Iterator[tuple[str, object]]:
    """`(where, item)` of each non-blank line; item is a ValidationError when the line is not JSON text."""
    for number, raw in enumerate(file, start=1):
        where = f"{name}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield where, ValidationError("line", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield where, ValidationError("line", f"not valid JSON: {exc}")


def read_jsonl(file: BinaryIO, name: str) -> Parsed:
    """Read and validate every line of `file` (opened in binary; `name` is what messages call it)."""
    from predictor.api.profiles import register  # noqa: PLC0415 - imports Flask

    parsed = Parsed()
    for where, item in _lines(file, name):
        try:
            if isinstance(item, ValidationError):
                raise item
            if isinstance(item, dict) and (item.get("kind") == "profile" or "tensors" in item and "kind" not in item):
                register(parsed, {k: v for k, v in item.items() if k != "kind"})
            else:
                parsed.records.append(validate_record(item, "record"))
        except ValidationError as exc:
            parsed.bad.append(f"{where}: {exc}")
    return parsed
