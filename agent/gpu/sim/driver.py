"""The simulated driver's socket (``<state>/sim/driver.sock``): how the simulated
``nvidia-smi`` and ``nvidia-cuda-mps-control`` processes reach the hardware state of the
:class:`~agent.gpu.sim.node.SimulatedNode` that serves it. One thread, one short request per
connection, each bounded by a timeout; it stops when the node closes."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import AgentError, Conflict, InvalidRequest, NotFound
from agent.gpu.sim import wire

log = logging.getLogger("agent.gpu.sim")

Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: How long one connection may take to send its request and take the reply.
CONNECTION_TIMEOUT_S = 5.0
_ACCEPT_POLL_S = 1.0


def error_reply(err: AgentError) -> dict[str, Any]:
    """An agent error as a reply (kind, detail, errors), rebuilt by :func:`raise_reply`."""
    kind = ("not_found" if isinstance(err, NotFound) else
            "invalid" if isinstance(err, InvalidRequest) else "conflict")
    errors = err.errors if isinstance(err, InvalidRequest) else []
    return {"error": {"kind": kind, "detail": err.detail, "errors": errors}}


def raise_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply, or the agent error it carries raised again."""
    error = reply.get("error")
    if not isinstance(error, dict):
        return reply
    detail = str(error.get("detail", "simulated driver error"))
    if error.get("kind") == "not_found":
        raise NotFound(detail)
    if error.get("kind") == "invalid":
        errors = error.get("errors")
        raise InvalidRequest(detail, errors=[dict(e) for e in errors if isinstance(e, dict)]
                             if isinstance(errors, list) else [])
    raise Conflict(detail)


class DriverSocket:
    """Serves ``handler`` on a Unix socket at ``path`` from a daemon thread."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._stop = threading.Event()
        self._sock = wire.listen(path)
        self._sock.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._serve, name="sim-driver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (waits for the request in hand) and remove the socket file."""
        self._stop.set()
        with contextlib.suppress(OSError), wire.connect(self.path, timeout_s=1.0):
            pass  # wakes the accept: the thread sees the stop at once
        self._thread.join(timeout=CONNECTION_TIMEOUT_S + 1)
        self._sock.close()
        try:
            self.path.unlink(missing_ok=True)
        except OSError as err:  # a read-only state directory: the next start replaces it
            log.warning("simulator driver socket not removed",
                        extra={"path": str(self.path), "error": err.strerror or str(err)})

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                if self._stop.is_set():
                    return
                conn.settimeout(CONNECTION_TIMEOUT_S)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            message = wire.receive(conn)
        except (OSError, ValueError) as err:
            log.warning("sim driver: bad request", extra={"error": str(err)})
            return
        try:
            reply = self._handler(message)
        except AgentError as err:
            reply = error_reply(err)
        except Exception as err:  # a bug in a handler must not stop the driver
            log.exception("sim driver: request failed")
            reply = {"error": {"kind": "conflict", "detail": f"{type(err).__name__}: {err}"}}
        with contextlib.suppress(OSError):
            wire.send(conn, reply)
