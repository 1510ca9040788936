"""A TCP relay between the kubelet plugin and the API server, for fault tests: the plugin's
kubeconfig names the relay, which passes the TLS bytes through untouched (the server's
certificate is for 127.0.0.1, whatever the port), and the test can

- ``cut()`` it: the listener closes (connects are refused, as with a stopped server on this
  host) and every open connection is aborted, the plugin's watch included;
- ``restore()`` it on the same port: a server that is back;
- ``hold()`` it: bytes from the plugin wait in the relay until ``release()`` (a stalled
  server), with ``held_bytes`` counting what arrived meanwhile, so a test knows a request is
  stuck there.

The harness's ``apiserver`` cannot be stopped and started again on the same directory for
this: every start writes a new CA, service-account key and admin token, so the plugin's
kubeconfig and token would not be valid for the new server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
#: Each control call's limit (they are local and quick).
CONTROL_TIMEOUT_S = 10.0


class ApiServerLink:
    """The relay to ``upstream`` (``https://127.0.0.1:PORT``), its own event loop in a thread."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("https://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="api-link",
                                        daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._open = asyncio.Event()
        self._open.set()
        self.port = 0
        self.held_bytes = 0
        self.accepted = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(CONTROL_TIMEOUT_S)

    def start(self) -> ApiServerLink:
        self._thread.start()
        self._run(self._listen())
        return self

    def kubeconfig(self, source: Path, path: Path) -> Path:
        """A copy of the JSON kubeconfig ``source`` (mode 0600) whose server is the relay."""
        config = json.loads(source.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = self.url
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def cut(self) -> None:
        """Refuse new connections and abort the open ones."""
        self._run(self._cut())

    def restore(self) -> None:
        """Accept again, on the same port."""
        self._run(self._listen())

    def hold(self) -> None:
        """From now on the plugin's bytes wait in the relay (``held_bytes`` counts them)."""
        def close_gate() -> None:
            self.held_bytes = 0
            self._open.clear()
        self._loop.call_soon_threadsafe(close_gate)
        self._run(asyncio.sleep(0))  # the gate is closed when this returns

    def release(self) -> None:
        """Forward what was held, and everything after it."""
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        if self._thread.is_alive():
            self.release()
            with contextlib.suppress(Exception):
                self._run(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CONTROL_TIMEOUT_S)
        self._loop.close()

    # --- in the relay's loop ---

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port,
                                                      reuse_address=True)
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _shutdown(self) -> None:
        await self._cut()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer, gated=True)),
                 asyncio.ensure_future(self._pump(up_reader, writer, gated=False))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the relay is closing: asyncio's stream callback must not see this
        finally:
            for pump in pumps:
                pump.cancel()
            for side in (writer, up_writer):
                self._writers.discard(side)
                side.transport.abort()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *,
                    gated: bool) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await source.read(65536):
                if gated and not self._open.is_set():
                    self.held_bytes += len(chunk)
                    await self._open.wait()
                sink.write(chunk)
                await sink.drain()
