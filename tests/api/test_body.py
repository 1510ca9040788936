"""JSON bodies from clients (agent/api/body.py): what is refused, and that refusing stays cheap
for the worst inputs a megabyte allows."""

from __future__ import annotations

import contextlib
import time

import pytest

from agent.api.access import summarise_body
from agent.api.body import MAX_DEPTH, BodyError, load_json


@pytest.mark.parametrize(("raw", "value"), [
    (b'{"a": [1, {"b": "c"}]}', {"a": [1, {"b": "c"}]}),
    (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, load_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)),
    (b'{"a": "[[[[' + b"[" * 1000 + b'"}', {"a": "[[[[" + "[" * 1000}),
    (b'["\\\\", "\\"[", [[]]]', ["\\", '"[', [[]]]),
    (b'{"n": ' + b"9" * 20 + b"}", {"n": int("9" * 20)}),
])
def test_accepted(raw: bytes, value: object) -> None:
    """Well-formed JSON up to the bounds parses as json would."""
    assert load_json(raw) == value


@pytest.mark.parametrize(("raw", "reason"), [
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "deep"),
    (b'{"a": ' * 600 + b"1" + b"}" * 600, "deep"),
    (b'{"a": 1, "a": 2}', "twice"),
    (b'{"x": {"a": 1, "a": 1}}', "twice"),
    (b'{"n": ' + b"9" * 21 + b"}", "digits"),
    (b'{"n": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"n": 1e99999}', "range"),
    (b'{"n": NaN}', "not JSON"),
    (b'{"n": -Infinity}', "not JSON"),
    (b'{"a": "\xff"}', "UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "UTF-8"),
    (b"{", "not valid JSON"),
])
def test_refused(raw: bytes, reason: str) -> None:
    """Each refusal is a BodyError whose message names the reason."""
    with pytest.raises(BodyError, match=reason):
        load_json(raw)


@pytest.mark.parametrize("raw", [
    b"[" * 401 + b'"' + b'\\"' * 300_000,       # escaped quotes, never closed
    b"[]" * 500_000,                             # a megabyte of shallow brackets
    b"[" * 1_000_000,                            # a megabyte of opening brackets
    b"[" * 401 + b'"\\\n' * 300_000,
])
def test_refusal_is_cheap(raw: bytes) -> None:
    """A megabyte of the worst bracket and quote patterns is judged in linear time: well under
    a second of this thread's CPU (40-90 ms here; a quadratic scan would take minutes). CPU
    time, not wall time, so a loaded machine that runs the thread less cannot fail it."""
    started = time.thread_time()
    with contextlib.suppress(BodyError):
        load_json(raw)
    assert time.thread_time() - started < 0.5


@pytest.mark.parametrize(("raw", "ctype", "expected"), [
    (b"[" * 600 + b"]" * 600, "application/json", "refused: nested more than 400 deep"),
    (b'{"token": "s3cret", "a": 1}', "application/json", '{"token":"<redacted>","a":1}'),
    (b'{"a": ' * 50 + b"1" + b"}" * 50, "application/json", '"..."'),
    (b"\xff" * 10, "application/json", "refused: not UTF-8"),
    (b"x" * 20_000, "application/json", "<20000 bytes application/json>"),
    (b"abc", "text/plain", "<3 bytes text/plain>"),
])
def test_audit_summaries_never_raise(raw: bytes, ctype: str, expected: str) -> None:
    """The audit line's body summary is short, secret-free and written for any body."""
    summary = summarise_body(raw, ctype)
    assert expected in summary
    assert len(summary) <= 310
