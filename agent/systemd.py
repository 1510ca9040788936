"""Running under systemd: ``sd_notify`` (READY, STATUS, WATCHDOG, STOPPING) and journald.

Only systemd-python (the ``systemd`` extra) speaks the protocols; there is deliberately no
hand-written notify client. When systemd starts the agent with ``Type=notify`` it sets
``NOTIFY_SOCKET``; without systemd-python the agent then refuses to start (see
:func:`check_environment`) rather than being killed later for never saying ``READY=1``.

- ``READY=1`` is sent once start-up reconciliation finished (readiness became ready, or
  start-up ended degraded, e.g. with a corrupt claims checkpoint that needs an operator).
- ``STATUS=`` follows every readiness change, so ``systemctl status`` says what it is doing.
- ``WATCHDOG=1`` comes from a heartbeat task on the event loop: a blocked loop cannot beat,
  and the heartbeat also withholds beats while the metrics collector has had no successful
  round for longer than its staleness limit (a hung collector thread).
- ``STOPPING=1`` when a signal starts the graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError

if TYPE_CHECKING:
    from agent.wiring import Node

log = logging.getLogger("agent.systemd")

#: Test hook (honoured only with ``--simulate``): block the event loop this many seconds
#: after the agent became ready, so tests can see the watchdog stop beating.
STALL_ENV = "GPU_AGENT_TEST_STALL_LOOP_AFTER_S"
_STALL_FOR_S = 3600.0
#: Longest sleep of the heartbeat task (it also re-checks the status line then).
_TICK_S = 0.5

_MISSING_MESSAGE = (
    "NOTIFY_SOCKET is set (systemd started the agent with Type=notify) but systemd-python "
    "is not installed; install the agent with the systemd extra "
    "(pip install 'gpu-node-agent[systemd]', or the python3-systemd package) or remove "
    "Type=notify from the unit")


def _daemon_module() -> Any:
    return importlib.import_module("systemd.daemon")  # optional: only under systemd


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Refuse to start under ``Type=notify`` without systemd-python (a clear message)."""
    env = os.environ if env is None else env
    if not env.get("NOTIFY_SOCKET"):
        return
    try:
        _daemon_module()
    except ImportError as err:
        raise AgentError(_MISSING_MESSAGE) from err


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` beats (a third of ``WATCHDOG_USEC``), or None."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6 / 3


class Notifier:
    """Tells systemd what the agent is doing; :meth:`attach` returns None outside systemd."""

    def __init__(self, node: Node, send: Callable[[str], Any],
                 watchdog_s: float | None) -> None:
        self._node = node
        self._send = send
        self.watchdog_s = watchdog_s
        self._task: asyncio.Task[None] | None = None
        self._status: str | None = None
        self._ready_sent = False
        self._startup_finished = False
        self._withheld: str | None = None
        self._stall_after: float | None = None

    @classmethod
    def attach(cls, node: Node, env: Mapping[str, str] | None = None) -> Notifier | None:
        env = os.environ if env is None else env
        if not env.get("NOTIFY_SOCKET"):
            return None
        check_environment(env)
        daemon = _daemon_module()
        return cls(node, daemon.notify, watchdog_interval(env))

    def start(self) -> None:
        self._node.readiness.watchers.append(lambda _reason: self.tick())
        self.tick()
        self._task = asyncio.create_task(self._run(), name="systemd-notify")
        stall = os.environ.get(STALL_ENV)
        if stall and self._node.settings.simulate:
            self._stall_after = float(stall)

    def startup_finished(self) -> None:
        """Start-up ended (possibly degraded): READY=1 even if readiness has a reason."""
        self._startup_finished = True
        self.tick()

    def stopping(self) -> None:
        self._send("STOPPING=1\nSTATUS=shutting down")
        self._status = "shutting down"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def status_line(self) -> str:
        reason = self._node.readiness.reason
        if reason is None:
            node = self._node
            return f"ready: {len(node.inventory.gpus)} GPUs, backend {node.backend.name}"
        return reason

    def tick(self) -> None:
        """Send STATUS= on a change, and READY=1 once start-up reconciliation is done."""
        status = self.status_line()
        lines = []
        if status != self._status:
            lines.append(f"STATUS={status}")
            self._status = status
        if not self._ready_sent and (self._node.readiness.ready or self._startup_finished):
            lines.insert(0, "READY=1")
            self._ready_sent = True
            self._maybe_arm_stall()
        if lines:
            self._send("\n".join(lines))

    def healthy(self) -> str | None:
        """Why the heartbeat must not beat (a stalled collector), or None."""
        return self._node.collector.stale_reason()

    def beat(self) -> bool:
        reason = self.healthy()
        if reason is not None:
            if reason != self._withheld:
                log.error("watchdog heartbeat withheld", extra={"reason": reason})
                self._withheld = reason
            return False
        self._withheld = None
        self._send("WATCHDOG=1")
        return True

    async def _run(self) -> None:
        next_beat = time.monotonic()
        while True:
            self.tick()
            now = time.monotonic()
            if self.watchdog_s is not None and now >= next_beat:
                self.beat()
                next_beat = now + self.watchdog_s
            await asyncio.sleep(_TICK_S if self.watchdog_s is None
                                else min(_TICK_S, self.watchdog_s))

    def _maybe_arm_stall(self) -> None:
        if self._stall_after is None:
            return
        log.warning("test hook: the event loop will stall", extra={"after_s": self._stall_after})
        asyncio.get_running_loop().call_later(self._stall_after, time.sleep, _STALL_FOR_S)


# --- journald ----------------------------------------------------------------------------

_RESERVED_FIELDS = {"MESSAGE", "MESSAGE_ID", "PRIORITY", "CODE_FILE", "CODE_LINE",
                    "CODE_FUNC", "SYSLOG_IDENTIFIER", "ERRNO", "INVOCATION_ID"}


def journal_field(name: str) -> str:
    """A structured-log key as a journal field name (upper case, ``[A-Z0-9_]``)."""
    field = re.sub(r"[^A-Z0-9_]", "_", name.upper()).lstrip("_") or "FIELD"
    if field[0].isdigit() or field in _RESERVED_FIELDS:
        field = f"AGENT_{field}"
    return field


def journal_stream_is_stderr(env: Mapping[str, str] | None = None) -> bool:
    """``JOURNAL_STREAM`` names stderr's device:inode (systemd connected it to journald)."""
    env = os.environ if env is None else env
    value = env.get("JOURNAL_STREAM", "")
    if not value:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return value == f"{st.st_dev}:{st.st_ino}"


def make_journal_handler(sender: Callable[..., Any] | None = None) -> logging.Handler:
    """A handler sending each record to journald with its structured fields as fields."""
    from agent.logs import _fields  # noqa: PLC0415

    # The optional dependency (the repository's systemd/ folder would confuse static imports).
    journal = importlib.import_module("systemd.journal")
    base: Any = journal.JournalHandler

    class _Handler(base):  # type: ignore[misc]
        def emit(self, record: logging.LogRecord) -> None:
            try:
                fields = {journal_field(k): str(v) for k, v in _fields(record).items()}
                if record.exc_info:
                    fields["EXCEPTION_TEXT"] = logging.Formatter().formatException(
                        record.exc_info)
                self.send(record.getMessage(), PRIORITY=str(self.map_priority(record.levelno)),
                          LOGGER=record.name, CODE_FILE=record.pathname,
                          CODE_LINE=str(record.lineno), CODE_FUNC=record.funcName,
                          SYSLOG_IDENTIFIER="gpu-agent", **fields)
            except Exception:  # logging must never raise
                self.handleError(record)

    return _Handler(**({"sender_function": sender} if sender is not None else {}))


def configure_journal(level: str, env: Mapping[str, str] | None = None) -> bool:
    """Log to journald instead of stderr when systemd connected stderr to the journal."""
    if not journal_stream_is_stderr(env):
        return False
    try:
        handler = make_journal_handler()
    except ImportError:
        return False  # stderr lines still reach the journal, just without fields
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return True
