"""The simulated ``nvidia-cuda-mps-control`` is a real daemon process, as NVIDIA documents
it: ``-d`` detaches and leaves a pid file, commands arrive on a client's standard input, and
the simulated driver holds MPS clients to the limits the daemon was given."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from agent.errors import Conflict, InvalidRequest
from agent.gpu.sim.node import SimulatedNode
from tests.waiting import wait_for

from .conftest import NodeFactory, enable_mig

PID_FILE = "nvidia-cuda-mps-control.pid"
Reaper = Callable[[int], None]


class Daemon:
    """One pipe/log directory pair and the tool run against it."""

    def __init__(self, node: SimulatedNode, root: Path, devices: list[str] | None) -> None:
        self.node, self.pipe, self.log = node, root / "pipe", root / "log"
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        self.env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.log)}
        if devices is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)

    @property
    def tool(self) -> str:
        return str(self.node.tools_dir / "nvidia-cuda-mps-control")

    def start(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.tool, "-d"], env=self.env, capture_output=True, text=True,
                              timeout=30, check=False)

    def send(self, *lines: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.tool], env=self.env, input="".join(f"{x}\n" for x in lines),
                              capture_output=True, text=True, timeout=30, check=False)

    def pid(self) -> int:
        return int((self.pipe / PID_FILE).read_text())

    def client(self, device: str, mib: int, uid: int = 0) -> dict[str, object]:
        return self.node.add_process(device, used_memory_mib=mib,
                                     mps_pipe_directory=str(self.pipe), uid=uid)


@pytest.fixture
def l40s(make_node: NodeFactory, reap_daemons: Reaper) -> SimulatedNode:
    return make_node("l40s")


def long_root(tmp_path: Path) -> Path:
    """A directory whose socket paths are longer than sun_path's 108 bytes."""
    return tmp_path / ("d" * 60) / ("e" * 60)


def test_start_detaches_and_leaves_a_pid_file_and_a_log(l40s: SimulatedNode,
                                                        tmp_path: Path) -> None:
    """``-d`` exits 0 once the daemon serves; the pid file names it, control.log records it,
    and the driver knows it (``/v1/sim`` state), with paths beyond sun_path's limit."""
    daemon = Daemon(l40s, long_root(tmp_path), l40s.gpu_uuids()[:2])
    done = daemon.start()
    assert done.returncode == 0, done.stderr
    pid = daemon.pid()
    assert Path(f"/proc/{pid}").exists()
    assert "Control daemon started" in (daemon.log / "control.log").read_text()
    [known] = l40s.describe()["mps_daemons"]
    assert (known["pid"], known["pipe_directory"], known["devices"]) == (
        pid, str(daemon.pipe), l40s.gpu_uuids()[:2])


def test_a_second_daemon_on_the_same_pipe_directory_is_refused(l40s: SimulatedNode,
                                                               tmp_path: Path) -> None:
    """Only one daemon serves a pipe directory; the second start exits 1 and the first runs on."""
    daemon = Daemon(l40s, tmp_path / "mps", None)
    assert daemon.start().returncode == 0
    second = daemon.start()
    assert second.returncode == 1
    assert "already running" in second.stderr
    assert daemon.send("get_server_list").returncode == 0
    assert len(l40s.describe()["mps_daemons"]) == 1


def test_a_client_without_a_daemon_exits_1(l40s: SimulatedNode, tmp_path: Path) -> None:
    """No daemon on the pipe directory: every command exits 1 saying so."""
    done = Daemon(l40s, tmp_path / "mps", None).send("get_server_list")
    assert done.returncode == 1
    assert "Cannot find MPS control daemon process" in done.stderr


@pytest.mark.parametrize(("commands", "status", "output"), [
    (["get_default_active_thread_percentage"], 0, "100.0"),
    (["set_default_active_thread_percentage 25", "get_default_active_thread_percentage"], 0,
     "25.0"),
    (["set_default_device_pinned_mem_limit 1 4G", "get_default_device_pinned_mem_limit 1"], 0,
     "4096M"),
    (["set_default_device_pinned_mem_limit 0 1500M", "get_default_device_pinned_mem_limit 0"],
     0, "1500M"),
    (["set_default_device_pinned_mem_limit 2 4G"], 1, "Invalid device"),
    (["set_default_device_pinned_mem_limit 0 4T"], 1, "Invalid memory limit"),
    (["set_default_active_thread_percentage 101"], 1, "Invalid active thread percentage"),
    (["get_client_list 4242"], 1, "not found"),
    (["no_such_command"], 1, "Unrecognized command"),
    (["get_server_list"], 0, ""),
])
def test_control_commands(l40s: SimulatedNode, tmp_path: Path, commands: list[str],
                          status: int, output: str) -> None:
    """Each command's reply and exit status (devices: UUIDs, or ordinals into
    CUDA_VISIBLE_DEVICES)."""
    daemon = Daemon(l40s, tmp_path / "mps", l40s.gpu_uuids()[2:4])
    assert daemon.start().returncode == 0
    done = daemon.send(*commands)
    assert done.returncode == status, (done.stdout, done.stderr)
    assert output in (done.stdout + done.stderr)


def _runs_mps_control(pid: int) -> bool:
    """Whether ``pid`` is (still) a running MPS control daemon (a zombie's cmdline is empty)."""
    try:
        return b"mps_control" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_quit_removes_the_pid_file_and_the_daemon(l40s: SimulatedNode, tmp_path: Path) -> None:
    """``quit`` ends the daemon: pid file gone, process gone, the driver forgets it."""
    daemon = Daemon(l40s, tmp_path / "mps", None)
    assert daemon.start().returncode == 0
    pid = daemon.pid()
    assert daemon.send("quit").returncode == 0
    wait_for(lambda: not (daemon.pipe / PID_FILE).exists(), "the pid file to go")
    assert l40s.describe()["mps_daemons"] == []
    wait_for(lambda: not _runs_mps_control(pid), f"daemon {pid} to exit")


def test_the_daemon_survives_sigkill_of_its_starters_process_group(l40s: SimulatedNode,
                                                                   tmp_path: Path) -> None:
    """Killed as a runtime kills a container's processes (SIGKILL to the starter's whole
    process group), the starter dies and the daemon still answers."""
    daemon = Daemon(l40s, tmp_path / "mps", None)
    starter = subprocess.Popen(["/bin/sh", "-c", f"'{daemon.tool}' -d && exec sleep 60"],
                               env=daemon.env, start_new_session=True)
    wait_for((daemon.pipe / PID_FILE).exists, "the daemon's pid file", 20)
    os.killpg(starter.pid, signal.SIGKILL)
    assert starter.wait(timeout=10) == -signal.SIGKILL
    assert os.getpgid(daemon.pid()) != starter.pid
    assert daemon.send("get_server_list").returncode == 0


@pytest.mark.parametrize(("limit", "mib", "accepted"), [
    ("2G", 2048, True),
    ("2G", 1000, True),
    ("2G", 2049, False),
    ("1500M", 1501, False),
    (None, 40000, True),
])
def test_the_pinned_limit_is_enforced_on_clients(l40s: SimulatedNode, tmp_path: Path,
                                                 limit: str | None, mib: int,
                                                 accepted: bool) -> None:
    """A client allocating above its server's pinned limit is refused like an OOM (naming
    used_memory_mib); one at or below it runs, and NVML reports it as an MPS client."""
    gpu = l40s.gpu_uuids()[0]
    daemon = Daemon(l40s, tmp_path / "mps", [gpu])
    assert daemon.start().returncode == 0
    if limit is not None:
        assert daemon.send(f"set_default_device_pinned_mem_limit {gpu} {limit}").returncode == 0
    handle = l40s.nvml.nvmlDeviceGetHandleByUUID(gpu)
    if not accepted:
        with pytest.raises(InvalidRequest) as refused:
            daemon.client(gpu, mib)
        assert refused.value.errors[0]["field"] == "used_memory_mib"
        assert "out of memory" in refused.value.detail
        assert l40s.nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle) == []
        return
    record = daemon.client(gpu, mib)
    clients = l40s.nvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle)
    assert [(c.pid, c.usedGpuMemory) for c in clients] == [(record["pid"], mib * 2**20)]
    [server] = l40s.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert server.usedGpuMemory == mib * 2**20
    assert daemon.send("get_server_list").stdout.split() == [str(server.pid)]
    assert daemon.send(f"get_client_list {server.pid}").stdout.split() == [str(record["pid"])]


def test_defaults_apply_to_servers_started_later(l40s: SimulatedNode, tmp_path: Path) -> None:
    """A server keeps the defaults it started with; the thread percentage is recorded."""
    gpu = l40s.gpu_uuids()[0]
    daemon = Daemon(l40s, tmp_path / "mps", [gpu])
    assert daemon.start().returncode == 0
    assert daemon.send("set_default_active_thread_percentage 30",
                       f"set_default_device_pinned_mem_limit {gpu} 1G").returncode == 0
    first = daemon.client(gpu, 512)
    assert daemon.send("set_default_device_pinned_mem_limit 0 8G").returncode == 0
    with pytest.raises(InvalidRequest):
        daemon.client(gpu, 2048)
    assert first["mps"] == {"server": first["mps"]["server"], "uid": 0,  # type: ignore[index]
                            "daemon": daemon.pid(), "pipe_directory": str(daemon.pipe),
                            "active_thread_percentage": 30, "pinned_limit_mib": 1024}


def test_one_user_at_a_time(l40s: SimulatedNode, tmp_path: Path) -> None:
    """A second UID's client waits while another UID's server has clients (refused here);
    once they are gone, the daemon serves the new UID with a new server."""
    gpu = l40s.gpu_uuids()[0]
    daemon = Daemon(l40s, tmp_path / "mps", [gpu])
    assert daemon.start().returncode == 0
    first = daemon.client(gpu, 100, uid=1000)
    daemon.client(gpu, 100, uid=1000)
    with pytest.raises(Conflict, match="would wait"):
        daemon.client(gpu, 100, uid=2000)
    for record in l40s.describe()["processes"]:
        l40s.remove_process(record["pid"])
    other = daemon.client(gpu, 100, uid=2000)
    assert other["mps"]["uid"] == 2000  # type: ignore[index]
    assert other["mps"]["server"] != first["mps"]["server"]  # type: ignore[index]
    assert len(daemon.send("get_server_list").stdout.split()) == 1


def test_exclusive_process_allows_the_server_and_refuses_anyone_else(
        l40s: SimulatedNode, tmp_path: Path) -> None:
    """On an EXCLUSIVE_PROCESS GPU with an MPS server, a plain process is refused and its
    clients run; a second daemon's server is refused too."""
    gpu = l40s.gpu_uuids()[0]
    smi = subprocess.run([str(l40s.tools_dir / "nvidia-smi"), "-i", gpu, "-c",
                          "EXCLUSIVE_PROCESS"], capture_output=True, timeout=30, check=False)
    assert smi.returncode == 0
    daemon = Daemon(l40s, tmp_path / "one", [gpu])
    assert daemon.start().returncode == 0
    daemon.client(gpu, 100)
    daemon.client(gpu, 100)
    with pytest.raises(Conflict, match="EXCLUSIVE_PROCESS"):
        l40s.add_process(gpu, used_memory_mib=100)
    other = Daemon(l40s, tmp_path / "two", [gpu])
    assert other.start().returncode == 0
    with pytest.raises(Conflict, match="EXCLUSIVE_PROCESS"):
        other.client(gpu, 100)
    assert other.send("start_server -uid 0").returncode == 1


def test_a_killed_daemon_takes_its_servers_and_clients_out_of_nvml(l40s: SimulatedNode,
                                                                   tmp_path: Path) -> None:
    """SIGKILL of the daemon: NVML no longer reports its server or clients; a new daemon
    can start on the same pipe directory."""
    gpu = l40s.gpu_uuids()[0]
    daemon = Daemon(l40s, tmp_path / "mps", [gpu])
    assert daemon.start().returncode == 0
    daemon.client(gpu, 300)
    handle = l40s.nvml.nvmlDeviceGetHandleByUUID(gpu)
    assert len(l40s.nvml.nvmlDeviceGetComputeRunningProcesses(handle)) == 1
    os.kill(daemon.pid(), signal.SIGKILL)
    wait_for(lambda: l40s.nvml.nvmlDeviceGetComputeRunningProcesses(handle) == [],
             "the driver to forget the killed daemon's processes")
    assert l40s.nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle) == []
    assert l40s.describe()["mps_daemons"] == []
    assert daemon.send("get_server_list").returncode == 1
    killed = daemon.pid()
    assert daemon.start().returncode == 0  # the stale pid file and socket are no obstacle
    assert daemon.pid() != killed
    assert daemon.send("get_server_list").returncode == 0


def test_daemon_and_clients_survive_a_restart_of_the_node(tmp_path: Path,
                                                          reap_daemons: Reaper) -> None:
    """The daemon outlives the simulated node (an agent restart): the new node still sees
    its server and clients and serves its commands."""
    state, proc = tmp_path / "state", tmp_path / "proc"
    node = SimulatedNode("l40s", state, proc)
    gpu = node.gpu_uuids()[0]
    daemon = Daemon(node, tmp_path / "mps", [gpu])
    assert daemon.start().returncode == 0
    record = daemon.client(gpu, 700)
    node.close()
    node = SimulatedNode("l40s", state, proc)
    try:
        node.nvml.nvmlInit()
        daemon.node = node
        handle = node.nvml.nvmlDeviceGetHandleByUUID(gpu)
        assert [p.pid for p in node.nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)] == [
            record["pid"]]
        assert daemon.send("get_server_list").stdout.split() == [
            str(record["mps"]["server"])]  # type: ignore[index]
    finally:
        node.close()


@pytest.mark.parametrize(("skip", "times", "outcomes"), [
    (0, 1, [1, 0]),
    (1, 1, [0, 1, 0]),
    (0, 2, [1, 1, 0]),
])
def test_a_fault_fails_the_next_daemon_start(l40s: SimulatedNode, tmp_path: Path, skip: int,
                                             times: int, outcomes: list[int]) -> None:
    """A fault on ``nvidia-cuda-mps-control`` fails ``-d`` starts (after ``skip``, ``times``
    times; exit 1, its message, no daemon left); client commands do not consume it."""
    l40s.add_fault("nvidia-cuda-mps-control", "MPS is not supported on this GPU", skip=skip,
                   times=times)
    results = []
    for n in range(len(outcomes)):
        daemon = Daemon(l40s, tmp_path / f"mps-{n}", None)
        daemon.send("get_server_list")
        done = daemon.start()
        results.append(done.returncode)
        if done.returncode:
            assert "MPS is not supported on this GPU" in done.stderr
            assert not (daemon.pipe / PID_FILE).exists()
    assert results == outcomes
    assert len(l40s.describe()["mps_daemons"]) == results.count(0)


def test_mig_devices_are_served_by_uuid(make_node: NodeFactory, tmp_path: Path,
                                        reap_daemons: Reaper) -> None:
    """A daemon on a MIG device: its clients and server are reported on that MIG device."""
    node = make_node("dgx-h100")
    handle = enable_mig(node, 0)
    gi = node.nvml.nvmlDeviceCreateGpuInstance(handle, 19)
    node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig_handle = node.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    mig = node.nvml.nvmlDeviceGetUUID(mig_handle)
    daemon = Daemon(node, tmp_path / "mps", [mig])
    assert daemon.start().returncode == 0
    assert daemon.send("set_default_device_pinned_mem_limit 0 2G").returncode == 0
    client = daemon.client(mig, 1024)
    with pytest.raises(InvalidRequest):
        daemon.client(mig, 4096)
    assert [p.pid for p in node.nvml.nvmlDeviceGetMPSComputeRunningProcesses(mig_handle)] == [
        client["pid"]]
    [server] = node.nvml.nvmlDeviceGetComputeRunningProcesses(mig_handle)
    assert server.gpuInstanceId != pynvml.NVML_VALUE_NOT_AVAILABLE_uint
    assert server.pid == client["mps"]["server"]  # type: ignore[index]
