"""``gpu-agent mps-host`` as a real process, driven through HostLauncher: what it starts, what
it refuses, and what its daemons survive."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from agent.errors import SharingUnavailable
from agent.mps.host_client import HostLauncher
from agent.mpshost.policy import SYSTEM_PATH

from .processes import (
    SHM_PROBE,
    HostProcess,
    alive,
    cgroups,
    daemon_dirs,
    daemon_pid,
    in_cgroup,
    kill_cgroup,
    mps_env,
    record_of,
    require_cgroup2,
    start_agent,
    start_host,
    wait_for,
)


def _launch(host: HostProcess, argv: list[str], env: dict[str, str]) -> None:
    result = asyncio.run(HostLauncher(host.socket).launch(argv, env, timeout_s=20))
    assert result.returncode == 0, result.output


def _raw(sock_path: Path, payload: bytes) -> dict[str, object]:
    """One raw exchange on the host's socket."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(sock_path))
        conn.sendall(payload)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    reply: dict[str, object] = json.loads(answer)
    return reply


def test_the_daemon_gets_the_mps_variables_and_the_host_s_path(
        host: HostProcess, mps_root: Path, mps_control: Path) -> None:
    """A launch through the host starts the daemon with exactly the three MPS variables and
    the host's PATH, not the caller's; the socket is the owner's alone (0600)."""
    root = daemon_dirs(mps_root, "a1")
    _launch(host, [str(mps_control), "-d"],
            mps_env(root, CUDA_VISIBLE_DEVICES="GPU-0f1e", PATH="/caller/bin"))
    env = record_of(root)["env"]
    assert isinstance(env, dict)
    visible = {k: v for k, v in env.items() if k.startswith("CUDA_") or k in (
        "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH")}
    assert visible == {"CUDA_MPS_PIPE_DIRECTORY": str((root / "pipe").resolve()),
                       "CUDA_MPS_LOG_DIRECTORY": str((root / "log").resolve()),
                       "CUDA_VISIBLE_DEVICES": "GPU-0f1e",
                       "PATH": f"{mps_control.parent}:{SYSTEM_PATH}"}
    assert host.socket.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("case", [
    (["/bin/sh", "-d"], {}, "argv"),
    (["MPS", "-d", "-f"], {}, "argv"),
    (["MPS", "-d"], {"LD_PRELOAD": "/tmp/x.so"}, "env.LD_PRELOAD"),
    (["MPS", "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "/tmp"}, "env.CUDA_MPS_PIPE_DIRECTORY"),
    (["MPS", "-d"], {"CUDA_MPS_LOG_DIRECTORY": "/var/log"}, "env.CUDA_MPS_LOG_DIRECTORY"),
], ids=lambda case: case[2])
def test_refused_launches_start_nothing_and_name_the_socket_and_field(
        host: HostProcess, mps_root: Path, mps_control: Path,
        case: tuple[list[str], dict[str, str], str]) -> None:
    """A launch outside the policy is a SharingUnavailable naming the socket and the field,
    and no daemon starts."""
    argv, env, field = case
    root = daemon_dirs(mps_root, "r1")
    argv = [str(mps_control) if a == "MPS" else a for a in argv]
    with pytest.raises(SharingUnavailable) as refused:
        asyncio.run(HostLauncher(host.socket).launch(argv, {**mps_env(root), **env},
                                                     timeout_s=10))
    assert str(host.socket) in refused.value.detail
    assert f"refused ({field})" in refused.value.reason
    assert refused.value.tool == "mps-host"
    assert not (root / "pipe" / "nvidia-cuda-mps-control.pid").exists()


@pytest.mark.parametrize(("payload", "error"), [
    (b'{"v": 2, "op": "ping"}\n', "version"),
    (b'{"v": 1, "op": "shell"}\n', "bad-request"),
    (b"not json\n", "bad-request"),
    (b'{"v": 1, "op": "launch", "timeout_s": 1e9}\n', "bad-request"),
    (b"x" * (70 * 1024) + b"\n", "bad-request"),
])
def test_malformed_requests_get_a_reason_and_the_host_keeps_serving(
        host: HostProcess, payload: bytes, error: str) -> None:
    """Another version, an unknown op, not JSON, an unbounded timeout or an oversized line is
    answered with its kind of refusal; the host still answers ping afterwards."""
    reply = _raw(host.socket, payload)
    assert (reply["v"], reply["ok"], reply["error"]) == (1, False, error)
    assert asyncio.run(HostLauncher(host.socket).ping())["ok"] is True


def test_a_daemon_started_through_the_host_survives_sigkill_of_the_agent_s_group(
        host: HostProcess, mps_root: Path, mps_control: Path) -> None:
    """The agent (a process group of its own, as a container's processes are) asks the host
    for a daemon and is SIGKILLed with its whole group: the daemon runs on."""
    root = daemon_dirs(mps_root, "g1")
    agent = start_agent(mode="host", target=str(host.socket),
                        argv=[str(mps_control), "-d"], env=mps_env(root))
    pid = daemon_pid(root)
    agent.kill_group()
    assert not alive(agent.proc.pid)
    assert alive(pid)


def test_a_direct_daemon_survives_its_group_but_is_no_child_of_the_host(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """DirectLauncher starts the daemon in a session of its own: SIGKILL of the agent's
    process group misses it too (it dies with the agent's cgroup instead: see the cgroup
    tests)."""
    root = daemon_dirs(mps_root, "d1")
    agent = start_agent(mode="direct", target="", argv=[str(mps_control), "-d"],
                        env=mps_env(root))
    pid = daemon_pid(root)
    assert os.getsid(pid) != os.getsid(agent.proc.pid)
    agent.kill_group()
    assert alive(pid)


def test_a_daemon_started_through_the_host_survives_the_agent_s_cgroup_being_killed(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """Host and agent in cgroups of their own (two containers, or two systemd units): killing
    everything in the agent's cgroup, as the runtime stops a container, leaves the daemon
    running in the host's cgroup."""
    require_cgroup2()
    with cgroups("host", "agent") as groups:
        host = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control,
                          cgroup=groups["host"])
        try:
            root = daemon_dirs(mps_root, "c1")
            agent = start_agent(mode="host", target=str(host.socket),
                                argv=[str(mps_control), "-d"], env=mps_env(root),
                                cgroup=groups["agent"])
            pid = daemon_pid(root)
            assert in_cgroup(pid).endswith(f"/{groups['host'].name}")
            kill_cgroup(groups["agent"])
            agent.close()
            assert alive(pid)
            # The host's cgroup going (the mps-host container stopped) takes it along.
            kill_cgroup(groups["host"])
            wait_for(lambda: not alive(pid), 10, "the daemon to die with the host's cgroup")
        finally:
            host.stop()


def test_a_direct_daemon_dies_with_the_agent_s_cgroup(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """Why the host exists: a daemon the agent starts itself stays in the agent's cgroup, so
    killing that cgroup (a container restart, ``systemctl restart gpu-agent``) kills it."""
    require_cgroup2()
    with cgroups("agent") as groups:
        root = daemon_dirs(mps_root, "c2")
        agent = start_agent(mode="direct", target="", argv=[str(mps_control), "-d"],
                            env=mps_env(root), cgroup=groups["agent"])
        pid = daemon_pid(root)
        assert in_cgroup(pid).endswith(f"/{groups['agent'].name}")
        kill_cgroup(groups["agent"])
        agent.close()
        wait_for(lambda: not alive(pid), 10, "the daemon to die with the agent's cgroup")


def test_sigterm_stops_the_host_but_never_its_daemons(
        host: HostProcess, mps_root: Path, mps_control: Path) -> None:
    """SIGTERM: the host exits 0 and removes its socket; the daemons it started run on."""
    root = daemon_dirs(mps_root, "t1")
    _launch(host, [str(mps_control), "-d"], mps_env(root))
    pid = daemon_pid(root)
    assert host.stop() == 0
    assert not host.socket.exists()
    assert alive(pid)
    assert "daemons keep running" in host.logs()


def test_a_second_host_on_the_same_socket_refuses_to_start(
        tmp_path: Path, host: HostProcess, mps_root: Path, mps_control: Path) -> None:
    """A host that finds another answering on its socket exits 2 and leaves it serving."""
    second = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control, wait=False)
    assert second.proc.wait(30) == 2
    assert "another mps-host answers" in second.logs()
    assert asyncio.run(HostLauncher(host.socket).ping())["ok"] is True


def test_private_shm_gives_the_daemon_the_claim_s_shm_directory_at_dev_shm(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """With --private-shm what the daemon writes to /dev/shm lands in ``<root>/<id>/shm``,
    the directory the claim's containers get at /dev/shm, and not in the host's /dev/shm."""
    host = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control,
                      flags=("--private-shm",))
    try:
        root = daemon_dirs(mps_root, "s1")
        (root / "pipe" / SHM_PROBE).touch()
        _launch(host, [str(mps_control), "-d"], mps_env(root))
        pid = daemon_pid(root)
        name = f"mps-stand-in-{pid}"
        wait_for((root / "shm" / name).exists, 10, "the probe in the claim's shm")
        assert not Path("/dev/shm", name).exists()
    finally:
        host.stop()


def _exchange_as(sock_path: Path, *, uid: int, gid: int, groups: list[int]) -> dict[str, object]:
    """A ping from a forked child that dropped to ``uid``/``gid`` (and ``groups``)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                reply = _raw(sock_path, b'{"v": 1, "op": "ping"}\n')
            except OSError as err:
                reply = {"oserror": err.errno}
            os.write(write_end, json.dumps(reply).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as out:
        data = out.read()
    os.waitpid(child, 0)
    answer: dict[str, object] = json.loads(data)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to other users")
def test_only_root_and_the_socket_s_group_are_answered(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """With --socket-group the socket is 0660 and members of the group (primary or
    supplementary) are answered; a peer outside it is refused by the peer-credential check
    even when the socket's mode is opened to everyone."""
    # Somewhere other users can reach (pytest's own directory is root's alone).
    shared = Path(tempfile.mkdtemp(prefix="mps-host-test-"))
    shared.chmod(0o755)
    host = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control,
                      flags=("--socket-group", "4242"), sock=shared / "host.sock")
    try:
        assert host.socket.stat().st_mode & 0o777 == 0o660
        assert host.socket.stat().st_gid == 4242
        member = _exchange_as(host.socket, uid=65534, gid=4242, groups=[])
        supplementary = _exchange_as(host.socket, uid=65534, gid=65534, groups=[4242])
        assert member["ok"] is True and supplementary["ok"] is True
        host.socket.chmod(0o666)
        stranger = _exchange_as(host.socket, uid=65534, gid=65534, groups=[])
        assert stranger.get("ok") is False, stranger
        assert stranger["error"] == "forbidden"
        assert "uid 65534" in str(stranger["reason"])
    finally:
        host.stop()
        shutil.rmtree(shared)


def test_an_absent_host_is_sharing_unavailable_naming_the_socket(tmp_path: Path) -> None:
    """No host on the socket: the launch fails at once with SharingUnavailable naming it."""
    sock = tmp_path / "none.sock"
    with pytest.raises(SharingUnavailable) as err:
        asyncio.run(HostLauncher(sock).launch(["x", "-d"], {}, timeout_s=5))
    assert str(sock) in err.value.detail and err.value.reason == "unreachable"


def test_ping_exits_1_without_a_host(tmp_path: Path) -> None:
    """``gpu-agent mps-host --ping`` is a probe: 1 and a reason when nothing answers."""
    import subprocess  # noqa: PLC0415

    from .processes import ROOT  # noqa: PLC0415

    done = subprocess.run([sys.executable, "-m", "agent", "mps-host", "--socket",
                           str(tmp_path / "none.sock"), "--ping"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=30,
                          check=False)
    assert done.returncode == 1 and "none.sock" in done.stderr


def test_selinux_context_labels_pipe_and_shm_before_the_daemon_starts(
        tmp_path: Path, mps_root: Path, mps_control: Path) -> None:
    """With --selinux-context the host gives the daemon's pipe and shm directories (what pods
    mount) that label before starting it, and leaves the log directory alone."""
    context = b"system_u:object_r:container_file_t:s0"
    host = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control,
                      flags=("--selinux-context", context.decode()))
    try:
        root = daemon_dirs(mps_root, "l1")
        _launch(host, [str(mps_control), "-d"], mps_env(root))
        daemon_pid(root)
        for sub in ("pipe", "shm"):
            assert os.getxattr(root / sub, "security.selinux").rstrip(b"\0") == context
        assert b"container_file_t" not in _label_of(root / "log")
    finally:
        host.stop()


def _label_of(path: Path) -> bytes:
    try:
        return os.getxattr(path, "security.selinux")
    except OSError:
        return b""


def test_a_start_that_hangs_is_killed_at_its_timeout_and_reported(
        tmp_path: Path, mps_root: Path) -> None:
    """A -d start that never exits is killed at the launch's timeout; the agent gets
    SharingUnavailable saying so, and the host keeps serving."""
    hanging = tmp_path / "hanging-mps-control"
    hanging.write_text("#!/bin/sh\necho starting\nexec sleep 60\n")
    hanging.chmod(0o755)
    host = start_host(tmp_path, mps_root=mps_root, mps_control=hanging)
    try:
        root = daemon_dirs(mps_root, "h1")
        with pytest.raises(SharingUnavailable) as err:
            asyncio.run(HostLauncher(host.socket).launch([str(hanging), "-d"], mps_env(root),
                                                         timeout_s=1))
        assert "did not exit within 1 s" in err.value.reason
        assert "starting" in err.value.reason
        assert asyncio.run(HostLauncher(host.socket).ping())["ok"] is True
    finally:
        host.stop()
