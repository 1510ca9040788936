"""The MPS host's wire protocol: one JSON object per line over a Unix stream socket, one
request and one reply per connection.

Requests (``"v"`` is the protocol version, always sent):

- ``{"v": 1, "op": "ping"}`` → ``{"v": 1, "ok": true, "mps_control": ..., "mps_root": ...,
  "private_shm": bool, "imex": ... | null, "imex_root": ... | null}``: readiness, and what
  the host accepts.
- ``{"v": 1, "op": "launch", "argv": [...], "env": {...}, "timeout_s": 15.0}`` → ``{"v": 1,
  "ok": true, "returncode": 0, "output": "..."}``: one ``nvidia-cuda-mps-control -d``.
- ``{"v": 1, "op": "launch-imex", "imex": PATH, "config": PATH, "hosts": PATH,
  "timeout_s": 15.0}`` → the same answer as ``launch``: one ``nvidia-imex -c config`` start
  whose daemon sees ``hosts`` at ``/etc/hosts`` (no other key is accepted).

A refusal is ``{"v": 1, "ok": false, "error": KIND, "reason": "...", "field": "..."}`` with
KIND one of :data:`ERRORS`. A line is at most :data:`MAX_LINE` bytes either way; a peer that
sends more, anything that does not parse (nesting too deep included), or nothing within
:data:`READ_TIMEOUT_S`, is answered ``bad-request`` and dropped. The host serves its peers
concurrently up to a cap of open connections: over it, the oldest connection still waiting
for its request line is answered ``busy`` and closed to make room, and when none is waiting
the new one is (``busy`` means: try again shortly).
"""

from __future__ import annotations

import json
from typing import Any

VERSION = 1
#: The most bytes of one request or reply line, newline included.
MAX_LINE = 64 * 1024
#: How long the host waits for a request line after accepting a connection.
READ_TIMEOUT_S = 5.0
#: The most seconds a launch may ask for (the host's own bound on one start).
MAX_LAUNCH_TIMEOUT_S = 120.0
#: The ops a host answers.
OPS = ("ping", "launch", "launch-imex")
#: The keys of a ``launch-imex`` request (``v`` and ``op`` included): any other is refused.
IMEX_KEYS = ("v", "op", "imex", "config", "hosts", "timeout_s")
#: Refusal kinds: malformed or oversized request; a version the host does not speak; the
#: peer is neither root nor in the socket's group; a launch outside the host's policy; the
#: start could not be run at all; the host is at its connection cap.
ERRORS = ("bad-request", "version", "forbidden", "refused", "failed", "busy")


class ProtocolError(ValueError):
    """A line that is not a protocol message (too long, not JSON, not an object)."""


def encode(message: dict[str, Any]) -> bytes:
    """One message as its line, the version stamped in; ProtocolError when it is too long."""
    line = json.dumps({"v": VERSION, **message}, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes is over {MAX_LINE}")
    return line


def decode(line: bytes) -> dict[str, Any]:
    """A received line as a message; ProtocolError naming what is wrong with it."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line of {len(line)} bytes is over {MAX_LINE}")
    try:
        message = json.loads(line)
    except RecursionError:
        raise ProtocolError("not JSON this host reads: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise ProtocolError(f"not JSON: {err}") from None
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    return message


def refusal(kind: str, reason: str, field: str | None = None) -> dict[str, Any]:
    """A refusal reply of ``kind`` (one of :data:`ERRORS`)."""
    assert kind in ERRORS, kind
    return {"ok": False, "error": kind, "reason": reason,
            **({"field": field} if field is not None else {})}
