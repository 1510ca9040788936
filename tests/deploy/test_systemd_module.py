"""agent.systemd without a process: journald fields, the stalled-collector rule, refusals."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from agent import systemd
from agent.errors import AgentError
from agent.readiness import Readiness


def test_notify_socket_without_systemd_python_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("systemd", "systemd.daemon"):  # as if systemd-python were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(AgentError, match=r"gpu-node-agent\[systemd\]"):
        systemd.check_environment({"NOTIFY_SOCKET": "/run/systemd/notify"})
    systemd.check_environment({})  # outside systemd nothing is needed


def test_watchdog_interval() -> None:
    assert systemd.watchdog_interval({}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 10.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None


class _Collector:
    def __init__(self) -> None:
        self.reason: str | None = None

    def stale_reason(self) -> str | None:
        return self.reason


def _notifier() -> tuple[systemd.Notifier, list[str], Any]:
    sent: list[str] = []
    ctx: Any = SimpleNamespace(readiness=Readiness(), collector=_Collector(),
                               backend=SimpleNamespace(name="sim"),
                               inventory=SimpleNamespace(gpus=[1, 2]),
                               settings=SimpleNamespace(simulate=None))
    return systemd.Notifier(ctx, sent.append, 1.0), sent, ctx


def test_no_beat_while_the_collector_is_stale() -> None:
    notifier, sent, ctx = _notifier()
    assert notifier.beat() and sent == ["WATCHDOG=1"]
    ctx.collector.reason = "no successful metrics collection for 20.0s"
    assert not notifier.beat() and sent == ["WATCHDOG=1"]
    ctx.collector.reason = None
    assert notifier.beat() and sent == ["WATCHDOG=1", "WATCHDOG=1"]


def test_ready_once_with_status_lines_and_degraded_start() -> None:
    notifier, sent, ctx = _notifier()
    ctx.readiness.watchers.append(lambda _r: notifier.tick())
    ctx.readiness.set("loading inventory")
    ctx.readiness.set(None)
    ctx.readiness.set("metrics stale")
    assert sent == ["STATUS=loading inventory", "READY=1\nSTATUS=ready: 2 GPUs, backend sim",
                    "STATUS=metrics stale"]
    degraded, sent2, ctx2 = _notifier()
    ctx2.readiness.set("claims checkpoint corrupt")
    degraded.startup_finished()
    assert sent2 == ["READY=1\nSTATUS=claims checkpoint corrupt"]
    degraded.stopping()
    assert sent2[-1] == "STOPPING=1\nSTATUS=shutting down"


def test_journal_fields() -> None:
    pytest.importorskip("systemd.journal")
    sent: list[tuple[str, dict[str, str]]] = []
    handler = systemd.make_journal_handler(lambda msg, **fields: sent.append((msg, fields)))
    record = logging.makeLogRecord({"msg": "claim created", "levelno": logging.WARNING,
                                    "name": "agent.claims", "claim_id": "c-1",
                                    "request-id": "r1", "message_id": "x"})
    handler.emit(record)
    message, fields = sent[0]
    assert message == "claim created"
    assert fields["PRIORITY"] == "4" and fields["LOGGER"] == "agent.claims"
    assert fields["CLAIM_ID"] == "c-1" and fields["REQUEST_ID"] == "r1"
    assert fields["AGENT_MESSAGE_ID"] == "x"  # never a journal field of its own meaning
    assert fields["SYSLOG_IDENTIFIER"] == "gpu-agent"


def test_journal_only_when_journal_stream_is_stderr() -> None:
    st = os.fstat(sys.stderr.fileno())
    assert not systemd.journal_stream_is_stderr({})
    assert not systemd.journal_stream_is_stderr({"JOURNAL_STREAM": "1:2"})
    assert systemd.journal_stream_is_stderr({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
