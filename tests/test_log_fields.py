"""Every structured log call names fields a LogRecord does not have: logging raises KeyError
for ``extra={"created": ...}`` when the record is made, which happens only at a level that is
enabled, so a clash hides in tests run at a quieter level and fails on a node."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What ``Logger.makeRecord`` refuses to overwrite.
RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _extra_keys() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for keyword in node.keywords:
                if keyword.arg == "extra" and isinstance(keyword.value, ast.Dict):
                    found.extend((str(path.relative_to(ROOT)), node.lineno, key.value)
                                 for key in keyword.value.keys
                                 if isinstance(key, ast.Constant) and isinstance(key.value, str))
    return found


def test_the_scan_finds_the_agents_log_fields() -> None:
    """The scan sees the log calls (a broken scan would pass vacuously)."""
    assert len(_extra_keys()) > 50


def test_no_log_field_overwrites_a_log_record_attribute() -> None:
    """No ``extra`` key is one of LogRecord's own attributes."""
    clashes = [f"{path}:{line}: {key!r}" for path, line, key in _extra_keys() if key in RESERVED]
    assert not clashes, "log fields that logging refuses:\n" + "\n".join(clashes)
