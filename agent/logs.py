"""Structured logging: one line per event, ``key=value`` (text) or JSON, never secrets.

Times are one form everywhere (text logs, JSON logs, ``/v1/events``): ISO 8601 in UTC with
milliseconds, ``2026-12-01T10:15:00.123Z``. Chosen over epoch seconds because people read
these lines during an incident, the form says its time zone, sorts as text, and every log
pipeline (journald exports, Loki, Elasticsearch, ``jq``'s ``fromdate``) parses it as is.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
#: What makes a text value need quoting (one C scan, not a generator per value).
_NEEDS_QUOTES = re.compile(r'[ "=\n\t]')


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED}


def _quote(value: Any) -> str:
    text = value if type(value) is str else str(value)
    if text == "" or _NEEDS_QUOTES.search(text):
        return json.dumps(text)
    return text


@functools.lru_cache(maxsize=4)
def _second(whole: int) -> str:
    # Most lines of a busy second share it: strftime per line was a tenth of a line's cost.
    return time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(whole))


def iso_time(seconds: float) -> str:
    """Unix time as ISO 8601 UTC with milliseconds (``2026-12-01T10:15:00.123Z``)."""
    whole = int(seconds)
    millis = min(int((seconds - whole) * 1000), 999)
    return f"{_second(whole)}.{millis:03d}Z"


class TextFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value ...`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={iso_time(record.created)}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        parts += [f"{k}={_quote(v)}" for k, v in _fields(record).items()]
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(log_format: str, level: str = "info") -> None:
    """Install the chosen formatter on the root logger (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log is replaced by the agent's one-line access log.
    logging.getLogger("aiohttp.access").disabled = True
