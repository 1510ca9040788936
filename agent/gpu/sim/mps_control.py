"""A simulated ``nvidia-cuda-mps-control``: a real process behaving as NVIDIA documents it.

- ``-d`` starts the control daemon: it detaches (double fork and ``setsid``, so killing the
  starter's process group leaves it running), writes ``nvidia-cuda-mps-control.pid`` in
  ``$CUDA_MPS_PIPE_DIRECTORY``, logs to ``$CUDA_MPS_LOG_DIRECTORY/control.log`` and serves
  the socket ``control`` in the pipe directory; the starter exits 0 once it answers. A
  second daemon on the same pipe directory is refused. ``-f`` runs it in the foreground.
- Without arguments it is a client: each line of standard input is a command sent to the
  daemon, whose reply is printed; exit 1 when no daemon runs or a command fails.

Servers and clients are hardware state: the daemon keeps its defaults and asks the
simulated driver (``$GPU_AGENT_SIM_DRIVER``) for the rest, so NVML, ``/v1/sim`` and the
daemon's answers agree, and a killed daemon's servers vanish from NVML.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from agent.gpu.sim import wire
from agent.gpu.sim.detach import detach

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
NO_DAEMON = "Cannot find MPS control daemon process"
USAGE = """Usage: nvidia-cuda-mps-control [-d | -f | -h]
  -d  start the control daemon in the background
  -f  run the control daemon in the foreground
  -h  this help
Without options, control commands are read from standard input."""
READY_TIMEOUT_S = 10.0
CONNECTION_TIMEOUT_S = 5.0
_LIMIT = re.compile(r"^([0-9]{1,9})([MmGg])$")


class Refused(Exception):
    """A command the daemon answers with an error."""


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")
    return pipe, log


def _visible() -> list[str] | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def _driver(message: dict[str, Any]) -> dict[str, Any]:
    """A request to the simulated driver; its error reply raised as :class:`Refused`."""
    path = os.environ.get("GPU_AGENT_SIM_DRIVER")
    if not path:
        raise Refused("the NVIDIA driver is not reachable (GPU_AGENT_SIM_DRIVER is not set)")
    try:
        reply = wire.request(Path(path), message)
    except (OSError, ValueError) as err:
        raise Refused(f"the NVIDIA driver is not reachable ({path}: {err})") from None
    error = reply.get("error")
    if isinstance(error, dict):
        raise Refused(str(error.get("detail")))
    return reply


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X", "")


def _running(pipe: Path) -> int | None:
    """The pid of a daemon that owns ``pipe`` and answers there, or None."""
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    try:
        with wire.connect(pipe / SOCKET, timeout_s=CONNECTION_TIMEOUT_S):
            return pid
    except OSError:
        return None


class Daemon:
    """The control daemon's state (its defaults) and its command table."""

    def __init__(self, pipe: Path, log: Path, devices: list[str]) -> None:
        self.pipe = pipe
        self.log_path = log / "control.log"
        self.devices = devices
        self.pid = os.getpid()
        self.thread_percentage: int | None = None
        self.pinned_mib: dict[str, int] = {}
        self.quitting = False

    def log(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        with contextlib.suppress(OSError), self.log_path.open("a") as out:
            out.write(f"[{stamp}] {line}\n")

    def _servers(self) -> list[dict[str, Any]]:
        servers = _driver({"op": "mps_query", "pid": self.pid}).get("servers")
        return servers if isinstance(servers, list) else []

    def _device(self, ref: str) -> str:
        """A device as the commands take it: UUID, or ordinal into CUDA_VISIBLE_DEVICES."""
        if ref.isdigit() and int(ref) < len(self.devices):
            return self.devices[int(ref)]
        if ref in self.devices:
            return ref
        raise Refused(f"Invalid device {ref!r}: not one of this daemon's devices")

    def _push(self, pct: int | None, pinned: dict[str, int]) -> None:
        _driver({"op": "mps_daemon_update", "pid": self.pid,
                 "active_thread_percentage": pct, "pinned_limits_mib": pinned})
        self.thread_percentage, self.pinned_mib = pct, pinned

    def command(self, line: str) -> str:
        """Run one control command; its output, or :class:`Refused`."""
        words = line.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        if name == "get_server_list" and not args:
            return "\n".join(str(s["pid"]) for s in self._servers())
        if name == "start_server" and len(args) == 2 and args[0] == "-uid" \
                and args[1].isdigit():
            _driver({"op": "mps_start_server", "pid": self.pid, "uid": int(args[1])})
            return ""
        if name in ("get_client_list", "get_server_status") and len(args) == 1:
            server = next((s for s in self._servers() if str(s["pid"]) == args[0]), None)
            if server is None:
                raise Refused(f"Server {args[0]} not found")
            if name == "get_server_status":
                return "ACTIVE"
            return "\n".join(str(c["pid"]) for c in server["clients"])
        if name == "ps" and not args:
            rows = ["PID ID SERVER DEVICE NAMESPACE COMMAND"]
            ident = 0
            for server in self._servers():
                ident += 1
                rows.append(f"{server['pid']} {ident} - - - nvidia-cuda-mps-server")
                for client in server["clients"]:
                    ident += 1
                    rows.append(f"{client['pid']} {ident} {server['pid']} {client['device']} "
                                "- sim-client")
            return "\n".join(rows)
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                pct = float(args[0])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise Refused(f"Invalid active thread percentage {args[0]!r}")
            self._push(int(pct), dict(self.pinned_mib))
            return ""
        if name == "get_default_active_thread_percentage" and not args:
            return f"{float(100 if self.thread_percentage is None else self.thread_percentage)}"
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            device = self._device(args[0])
            match = _LIMIT.match(args[1])
            if match is None or int(match[1]) == 0:
                raise Refused(f"Invalid memory limit {args[1]!r}: an integer followed by M or G")
            mib = int(match[1]) * (1024 if match[2] in "Gg" else 1)
            self._push(self.thread_percentage, {**self.pinned_mib, device: mib})
            return ""
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return f"{self.pinned_mib.get(self._device(args[0]), 0)}M"
        if name == "quit" and not args:
            self.quitting = True
            return ""
        raise Refused(f"Unrecognized command {line.strip()!r}")

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        client = message.get("sim_client_connect")
        if isinstance(client, dict):
            try:
                reply = wire.request(Path(os.environ["GPU_AGENT_SIM_DRIVER"]), {
                    "op": "mps_client_connect", "pid": self.pid, "client": client})
            except (KeyError, OSError, ValueError) as err:
                return {"error": {"kind": "conflict",
                                  "detail": f"the NVIDIA driver is not reachable ({err})"}}
            if reply.get("process"):
                self.log(f"client {reply['process'].get('pid')} connected")
            return reply
        line = str(message.get("command", ""))
        try:
            output = self.command(line)
        except Refused as err:
            self.log(f"{line.strip()}: {err}")
            return {"ok": False, "output": str(err)}
        self.log(line.strip())
        return {"ok": True, "output": output}

    def cleanup(self) -> None:
        with contextlib.suppress(Refused):
            _driver({"op": "mps_daemon_quit", "pid": self.pid})
        for name in (PID_FILE, SOCKET):
            with contextlib.suppress(OSError):
                (self.pipe / name).unlink()
        self.log("exit")

    def serve(self, listener: socket.socket) -> None:
        while not self.quitting:
            try:
                conn, _ = listener.accept()
            except InterruptedError:
                continue
            with conn:
                conn.settimeout(CONNECTION_TIMEOUT_S)
                try:
                    reply = self.answer(wire.receive(conn))
                    wire.send(conn, reply)
                except (OSError, ValueError):
                    continue


def _start(ready: int | None) -> NoReturn:
    """Become the daemon (in this process); report on ``ready`` (a pipe), then serve."""
    pipe, log = _dirs()

    def report(text: str) -> None:
        if ready is None:
            if text != "ok":
                print(text, file=sys.stderr)
        else:
            with contextlib.suppress(OSError):
                os.write(ready, text.encode()[:4000])
                os.close(ready)

    try:
        pipe.mkdir(parents=True, exist_ok=True)
        log.mkdir(parents=True, exist_ok=True)
        if _running(pipe) is not None:
            raise Refused(f"An instance of this daemon is already running in {pipe}")
        listener = wire.listen(pipe / SOCKET)
        registered = _driver({"op": "mps_daemon_start", "pid": os.getpid(),
                              "pipe_directory": str(pipe), "log_directory": str(log),
                              "devices": _visible()})
    except (Refused, OSError) as err:
        report(f"error: {err}")
        os._exit(1)
    daemon = Daemon(pipe, log, [str(d) for d in registered.get("devices", [])])
    (pipe / PID_FILE).write_text(f"{daemon.pid}\n")

    def terminated(*_: object) -> None:
        daemon.cleanup()
        os._exit(0)

    signal.signal(signal.SIGTERM, terminated)
    daemon.log(f"Control daemon started: pid {daemon.pid}, devices {','.join(daemon.devices)}")
    report("ok")
    try:
        daemon.serve(listener)
    finally:
        listener.close()
        daemon.cleanup()
    os._exit(0)


def daemonize() -> int:
    """``-d``: check for an injected fault, fork the daemon off, wait until it serves."""
    devices = _visible()
    try:
        started = _driver({"op": "tool", "tool": "nvidia-cuda-mps-control",
                           "device": devices[0] if devices else None})
    except Refused as err:
        print(f"An error occurred while starting the daemon: {err}", file=sys.stderr)
        return 1
    latency = float(started.get("latency_s") or 0.0)
    if latency > 0:
        time.sleep(latency)
    if started.get("fail"):
        print(f"An error occurred while starting the daemon: {started['fail']}",
              file=sys.stderr)
        return 1
    text = detach(_start, READY_TIMEOUT_S)
    if text == "ok":
        return 0
    message = text.removeprefix("error: ") or \
        f"the daemon did not start within {READY_TIMEOUT_S:g} s"
    print(f"An error occurred while starting the daemon: {message}", file=sys.stderr)
    return 1


def client(lines: list[str]) -> int:
    """Send each command line to the daemon; print its replies."""
    pipe, _ = _dirs()
    status = 0
    for line in lines:
        if not line.strip():
            continue
        if _running(pipe) is None:
            print(NO_DAEMON, file=sys.stderr)
            return 1
        try:
            reply = wire.request(pipe / SOCKET, {"command": line.strip()},
                                 timeout_s=CONNECTION_TIMEOUT_S * 2)
        except (OSError, ValueError):
            print(NO_DAEMON, file=sys.stderr)
            return 1
        output = str(reply.get("output", ""))
        if output:
            print(output, file=sys.stdout if reply.get("ok") else sys.stderr)
        if not reply.get("ok"):
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["-d"]:
        return daemonize()
    if args == ["-f"]:
        _start(None)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args:
        print(f"Unknown option {args[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return client(sys.stdin.read().splitlines())


if __name__ == "__main__":
    sys.exit(main())
