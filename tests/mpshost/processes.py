"""Real processes for the MPS host's tests: the host itself, an "agent" that asks for a daemon,
a stand-in ``nvidia-cuda-mps-control``, and cgroups to kill them the way a runtime does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import waiting
from tests.tools import unavailable

ROOT = Path(__file__).resolve().parents[2]
PID_FILE = "nvidia-cuda-mps-control.pid"
#: Written by the stand-in daemon into its pipe directory: its pid and environment.
RECORD = "stand-in.json"
#: A file the test puts in the pipe directory to have the stand-in write /dev/shm/<name>.
SHM_PROBE = "probe-shm"

STAND_IN = '''\
#!{python}
"""A stand-in for nvidia-cuda-mps-control -d: daemonizes with a double fork as the real one
does, records its pid and environment in the pipe directory, and lives until a file "quit"
appears there (or 300 s pass)."""
import json, os, sys, time
if sys.argv[1:] != ["-d"]:
    print("stand-in: only -d is supported", file=sys.stderr)
    sys.exit(2)
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
pid_file = os.path.join(pipe, "{pid_file}")
first = os.fork()
if first:
    os.waitpid(first, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("stand-in daemon started" if os.path.exists(pid_file) else "no pid file")
    sys.exit(0 if os.path.exists(pid_file) else 1)
os.setsid()
if os.fork():
    os._exit(0)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
shm = None
if os.path.exists(os.path.join(pipe, "{probe}")):
    shm = "/dev/shm/mps-stand-in-%d" % os.getpid()
    with open(shm, "w") as probe:
        probe.write(str(os.getpid()))
with open(os.path.join(pipe, "{record}.tmp"), "w") as record:
    json.dump({{"pid": os.getpid(), "env": dict(os.environ)}}, record)
os.rename(os.path.join(pipe, "{record}.tmp"), os.path.join(pipe, "{record}"))
with open(pid_file + ".tmp", "w") as out:
    out.write(str(os.getpid()))
os.rename(pid_file + ".tmp", pid_file)
deadline = time.monotonic() + 300
while time.monotonic() < deadline and not os.path.exists(os.path.join(pipe, "quit")):
    time.sleep(0.05)
if shm:
    os.unlink(shm)
os.unlink(pid_file)
'''


def write_stand_in(path: Path) -> Path:
    """An executable stand-in for nvidia-cuda-mps-control at ``path``."""
    path.write_text(STAND_IN.format(python=sys.executable, pid_file=PID_FILE, record=RECORD,
                                    probe=SHM_PROBE))
    path.chmod(0o755)
    return path


def daemon_dirs(mps_root: Path, name: str) -> Path:
    """``<mps_root>/<name>/{pipe,log,shm}`` as the agent's MpsControl makes them; the root."""
    root = mps_root / name
    for sub in ("pipe", "log", "shm"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def mps_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment the agent sends for the daemon at ``root``."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "log"), **extra}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0,
             what: str = "condition") -> None:
    """Poll ``predicate`` until true, at most ``timeout_s``."""
    waiting.wait_for(predicate, what, timeout_s, every_s=0.05)


def daemon_pid(root: Path, timeout_s: float = 10.0) -> int:
    """The pid the daemon at ``root`` wrote in its pipe directory."""
    pid_file = root / "pipe" / PID_FILE
    wait_for(pid_file.exists, timeout_s, f"{pid_file}")
    return int(pid_file.read_text())


def record_of(root: Path) -> dict[str, object]:
    """What the stand-in daemon at ``root`` recorded (pid, environment)."""
    record: dict[str, object] = json.loads((root / "pipe" / RECORD).read_text())
    return record


def stop_daemons(mps_root: Path) -> None:
    """Kill every daemon that wrote a pid file under ``mps_root`` (test clean-up)."""
    for pid_file in mps_root.glob(f"*/pipe/{PID_FILE}"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LD_LIBRARY_PATH", None)
    return env


def _in_cgroup(cgroup: Path | None, argv: list[str]) -> list[str]:
    """``argv`` started inside ``cgroup`` (the shell moves itself there, then execs)."""
    if cgroup is None:
        return argv
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]


@dataclass
class HostProcess:
    """A running ``gpu-agent mps-host``, in a process group of its own."""

    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path

    def stop(self) -> int:
        """SIGTERM, and its exit status (SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def start_host(tmp: Path, *, mps_root: Path, mps_control: Path, flags: tuple[str, ...] = (),
               cgroup: Path | None = None, env: dict[str, str] | None = None,
               wait: bool = True, sock: Path | None = None) -> HostProcess:
    """Start ``gpu-agent mps-host`` as a separate container would run it: its own process
    group (and ``cgroup`` when given); wait until it answers ``--ping``. The host confines
    every daemon in a mount namespace of its own, so it needs CAP_SYS_ADMIN: without root the
    test is unavailable (a skip on a laptop, a failure in CI)."""
    if os.geteuid() != 0:
        unavailable("the MPS host needs CAP_SYS_ADMIN (root) to confine its daemons")
    sock = sock or tmp / "host.sock"
    log = tmp / f"host-{uuid.uuid4().hex[:6]}.log"
    argv = [sys.executable, "-m", "agent", "mps-host", "--socket", str(sock),
            "--mps-root", str(mps_root), "--mps-control", str(mps_control), *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(_in_cgroup(cgroup, argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env or _env(),
                                start_new_session=True)
    host = HostProcess(proc, sock, log)
    if wait:
        def answers() -> bool:
            if proc.poll() is not None:
                raise AssertionError("mps-host exited")
            return subprocess.run([sys.executable, "-m", "agent", "mps-host", "--socket",
                                   str(sock), "--ping"], env=_env(), capture_output=True,
                                  timeout=30, check=False).returncode == 0
        try:
            waiting.wait_for(answers, "mps-host to answer --ping", 30, every_s=0.1)
        except AssertionError as err:
            host.stop()
            raise AssertionError(f"mps-host did not come up ({err}):\n{host.logs()}") from None
    return host


AGENT = textwrap.dedent('''\
    import asyncio, json, sys, time
    from pathlib import Path
    from agent.mps.direct import DirectLauncher
    from agent.mps.host_client import HostLauncher
    mode, target = sys.argv[1], sys.argv[2]
    argv, env = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    launcher = HostLauncher(Path(target)) if mode == "host" else DirectLauncher()
    result = asyncio.run(launcher.launch(argv, env, timeout_s=20))
    print(json.dumps({"returncode": result.returncode}), flush=True)
    time.sleep(300)
''')


@dataclass
class AgentStandIn:
    """An "agent": a process in a group of its own that had a daemon started and lives on."""

    proc: subprocess.Popen[bytes]

    def kill_group(self) -> None:
        """SIGKILL to its whole process group, as a terminal or a harness kills a job."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """Wait for it to be gone and close its pipes."""
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def start_agent(*, mode: str, target: str, argv: list[str], env: dict[str, str],
                cgroup: Path | None = None) -> AgentStandIn:
    """An agent stand-in that starts one daemon with ``mode`` ``host`` (HostLauncher on the
    socket ``target``) or ``direct`` (DirectLauncher) and stays up until killed."""
    proc = subprocess.Popen(
        _in_cgroup(cgroup, [sys.executable, "-c", AGENT, mode, target, json.dumps(argv),
                            json.dumps(env)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_env(),
        start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    agent = AgentStandIn(proc)
    if not line:
        assert proc.stderr is not None
        error = proc.stderr.read().decode()
        agent.close()
        raise AssertionError(f"agent stand-in failed: {error}")
    assert json.loads(line) == {"returncode": 0}
    return agent


# --- cgroups: how a container runtime or systemd stops everything of a container or unit --


def cgroup2_root() -> Path | None:
    """A writable cgroup v2 mount with ``cgroup.kill`` (Linux 5.14+), or None."""
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "cgroup2":
                mount = Path(fields[4])
                if (os.access(mount, os.W_OK)
                        and (mount / "cgroup.procs").exists()):
                    return mount
    return None


def require_cgroup2() -> None:
    """Skip where no writable cgroup v2 is (a developer's container); under CI, fail: CI must
    be able to kill a cgroup as a runtime does."""
    if cgroup2_root() is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs a writable cgroup v2 mount (cgroup.kill) for this test")
        pytest.skip("no writable cgroup v2 here")


@contextlib.contextmanager
def cgroups(*names: str) -> Iterator[dict[str, Path]]:
    """Fresh sibling cgroups, killed and removed afterwards."""
    root = cgroup2_root()
    assert root is not None
    base = root / f"gpu-agent-test-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    made = {name: base / name for name in names}
    for path in made.values():
        path.mkdir()
    try:
        yield made
    finally:
        for path in made.values():
            kill_cgroup(path)
            path.rmdir()
        base.rmdir()


def kill_cgroup(path: Path) -> None:
    """SIGKILL everything in the cgroup at once (``cgroup.kill``, what systemd and runc do to
    stop a unit or a container) and wait until it is empty."""
    (path / "cgroup.kill").write_text("1")
    wait_for(lambda: "populated 0" in (path / "cgroup.events").read_text(), 10,
             f"{path} to empty")


def in_cgroup(pid: int) -> str:
    """The cgroup v2 path of ``pid``."""
    with open(f"/proc/{pid}/cgroup", encoding="ascii") as cgroup:
        for line in cgroup:
            if line.startswith("0::"):
                return line[3:].strip()
    return ""
