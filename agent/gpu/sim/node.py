"""A simulated GPU node: the NVML stand-in, its durable hardware state, the /proc files the
driver would provide, and the controls (processes, faults, latency, XIDs and the recovery
actions they leave, resets) that the ``/v1/sim/*`` routes expose.

Longer than the house's ~500 lines on purpose: it is the simulator's whole control surface,
one method per control (each a few lines of validation and one change of the hardware under
its lock), kept in one class so the routes and the tests find every control in one place."""

from __future__ import annotations

import dataclasses
import math
import shlex
import stat
import sys
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import pynvml

import agent
from agent.durable import ExclusiveLock
from agent.errors import Conflict, InvalidRequest, NotFound, ProcessesRunning
from agent.gpu.sim import devfs, links, procfs, sysfs, wire
from agent.gpu.sim.driver import DriverSocket, raise_reply
from agent.gpu.sim.faults import ERROR_CODES, TOOL_FUNCTIONS, check_function
from agent.gpu.sim.hardware import (
    COMPUTE_MODE_NAMES,
    FIRST_AUTO_PID,
    NO_INSTANCE,
    XID_FALLEN_OFF_THE_BUS,
    XID_ROW_REMAP_EVENT,
    XID_ROW_REMAP_FAILURE,
    SimulatedHardware,
    process_start_time,
)
from agent.gpu.sim.nvml import SimulatedNvml
from agent.gpu.sim.presets import Preset, get_preset, preset_names
from agent.gpu.sim.recovery_action import ACTION_BY_NAME, action_after, action_name
from agent.gpu.sim.state import (
    CiState,
    GpuState,
    HardwareState,
    MpsDaemonState,
    MpsServerState,
    ProcessState,
    SimulatorStateError,
    StateFile,
)

__all__ = ["FIRST_AUTO_PID", "SimulatedNode"]

DEFAULT_PROCESS_MIB = 1024
#: Client contexts one MPS server takes per device (Volta and later).
MPS_CLIENTS_PER_DEVICE = 48
DEFAULT_THREAD_PERCENTAGE = 100
#: Environment the tool wrappers set: the driver socket the tools reach.
DRIVER_ENV = "GPU_AGENT_SIM_DRIVER"
#: ``tools_dir`` entry -> module run by its wrapper.
TOOLS = {"nvidia-smi": "agent.gpu.sim.nvidia_smi",
         "nvidia-cuda-mps-control": "agent.gpu.sim.mps_control",
         "nvidia-imex": "agent.gpu.sim.imex",
         "nvidia-imex-ctl": "agent.gpu.sim.imex_ctl"}
#: The control daemon's socket in its pipe directory.
MPS_CONTROL_SOCKET = "control"
MPS_TIMEOUT_S = 10.0
MAX_LATENCY_S = 30.0


def _field_error(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", errors=[{"field": field, "reason": message}])


def _positive_int(value: object, field: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(field, f"must be an integer >= {minimum}")
    return value


def _with_fabric(preset: Preset, cluster_uuid: str | None, clique_id: int | None) -> Preset:
    """The preset with the NVLink domain a node's flags put it in: nodes given the same
    cluster UUID and clique id form one domain. Refused where the GPUs have no fabric."""
    if cluster_uuid is None and clique_id is None:
        return preset
    if not preset.fabric_capable:
        field = "sim_cluster_uuid" if cluster_uuid is not None else "sim_clique_id"
        raise _field_error(field, f"preset {preset.name!r} has no NVLink fabric (its GPUs "
                           "answer NOT_SUPPORTED); use a preset on NVSwitch such as "
                           "gb200-nvl72")
    default_uuid, default_clique = preset.fabric or (None, 0)
    if cluster_uuid is not None:
        try:
            parsed = uuid.UUID(cluster_uuid)
        except ValueError:
            parsed = None
        if parsed is None or parsed.int == 0 or len(cluster_uuid) != 36:
            raise _field_error("sim_cluster_uuid", f"{cluster_uuid[:60]!r} is not a non-zero "
                               "UUID (e.g. 9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2)")
        default_uuid = str(parsed)
    if default_uuid is None:
        raise _field_error("sim_clique_id", f"preset {preset.name!r} has no cluster UUID: "
                           "give --sim-cluster-uuid too")
    if clique_id is not None and (isinstance(clique_id, bool) or not isinstance(clique_id, int)
                                  or not 0 <= clique_id < 1 << 32):
        raise _field_error("sim_clique_id", "must be an integer from 0 to 4294967295")
    return dataclasses.replace(preset, fabric=(
        default_uuid, clique_id if clique_id is not None else default_clique))


class SimulatedNode:
    """One simulated node, owning ``<state_dir>/sim`` (locked for its lifetime) and the
    driver's files under ``proc_root``. ``nvml`` is the object the hardware layer calls."""

    def __init__(self, preset: str, state_dir: Path, proc_root: Path, *,
                 cluster_uuid: str | None = None, clique_id: int | None = None) -> None:
        self.preset: Preset = _with_fabric(get_preset(preset), cluster_uuid, clique_id)
        self.state_dir = Path(state_dir)
        self.proc_root = Path(proc_root)
        sim_dir = self.state_dir / "sim"
        #: Where the simulated node's ``/sys`` is (PCI device links for the PCIe roots).
        self.sys_root = sim_dir / "sys"
        #: Where the simulated node's device nodes are (``<dev_root>/dev/nvidia0``, ...).
        self.dev_root = sim_dir / "root"
        #: The simulated driver tools (``nvidia-smi``, ``nvidia-cuda-mps-control``,
        #: ``nvidia-imex``, ``nvidia-imex-ctl``).
        self.tools_dir = sim_dir / "bin"
        #: The socket those tools reach the simulated driver through.
        self.driver_socket = sim_dir / "driver.sock"
        self._driver: DriverSocket | None = None
        self._lock = ExclusiveLock(sim_dir / "hardware.lock")
        self._lock.acquire()
        self._closed = False
        try:
            self._file = StateFile(sim_dir / "hardware.json")
            state = self._file.load(self.preset)
            if state is None:
                state = HardwareState.new(self.preset)
                self._file.save(state)
            self.hardware = SimulatedHardware(self.preset, state, self._save)
            self.nvml = SimulatedNvml(self.hardware)
            procfs.write_static(self.proc_root, gpu_count=self.preset.gpu_count,
                                nvswitch=self.preset.nvswitch)
            procfs.write_boot_id(self.proc_root, state.boot_id)
            sysfs.write_pci_devices(self.sys_root, self.preset)
            devfs.write_nodes(self.dev_root, gpu_count=self.preset.gpu_count,
                              imex_channels=devfs.IMEX_CHANNELS if self.preset.fabric_capable
                              else 0)
            self._write_tools()
            self._driver = DriverSocket(self.driver_socket, self._driver_request)
        except BaseException:
            self._lock.release()
            raise

    def _write_tools(self) -> None:
        """Executable wrappers running the simulated tools with this node's driver socket
        and this agent's code (whatever environment their caller passes)."""
        self.tools_dir.mkdir(parents=True, exist_ok=True)
        root = Path(agent.__file__).resolve().parent.parent
        for name, module in TOOLS.items():
            path = self.tools_dir / name
            text = (f"#!/bin/sh\nexport {DRIVER_ENV}={shlex.quote(str(self.driver_socket))}\n"
                    f"export PYTHONPATH={shlex.quote(str(root))}\n"
                    f"exec {shlex.quote(sys.executable)} -m {module} \"$@\"\n")
            if not path.is_file() or path.read_text() != text:
                tmp = path.with_name(f".{name}.tmp")
                tmp.write_text(text)
                tmp.chmod(0o755)
                tmp.replace(path)
            elif not path.stat().st_mode & stat.S_IXUSR:
                path.chmod(0o755)

    def _save(self, state: HardwareState) -> None:
        if self._closed:
            raise SimulatorStateError("simulated node is closed; its state can no longer change")
        self._file.save(state)

    def close(self) -> None:
        """Stop the driver socket and release the state directory (the state is already
        on disk)."""
        if self._driver is not None:
            self._driver.close()
            self._driver = None
        with self.hardware.lock:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> SimulatedNode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def boot_id(self) -> str:
        return self.hardware.state.boot_id

    def gpu_uuids(self) -> list[str]:
        return [g.uuid for g in self.hardware.state.gpus]

    # -- processes -------------------------------------------------------------------------

    def add_process(self, device_uuid: str, pid: int | None = None,
                    used_memory_mib: int | None = None, *,
                    mps_pipe_directory: str | None = None, uid: int = 0) -> dict[str, Any]:
        """Start a fake compute process on a GPU (MIG off) or on a MIG device; with
        ``mps_pipe_directory``, an MPS client of the daemon there, as user ``uid``: the
        daemon starts that user's server on demand and holds the client to its limits."""
        if mps_pipe_directory is not None:
            return self._add_mps_client(device_uuid, pid, used_memory_mib,
                                        mps_pipe_directory, uid)
        with self.hardware.lock:
            return self._add(device_uuid, pid, used_memory_mib)

    def _add(self, device_uuid: str, pid: int | None, used_memory_mib: int | None,
             server: MpsServerState | None = None) -> dict[str, Any]:
        """Add a process (under the hardware lock): plain, or a client of ``server``."""
        hw = self.hardware
        hw.prune_mps()
        try:
            gpu, gi, _ = hw.find_device(device_uuid)
        except KeyError:
            raise NotFound(f"no GPU or MIG device {device_uuid!r} on this node",
                           device=device_uuid) from None
        if gi is None and gpu.mig_current:
            devices = ", ".join(c.uuid for _, c in hw.mig_devices(gpu)) or "none yet"
            raise _field_error("device", f"GPU {device_uuid} is in MIG mode; "
                               f"processes run on its MIG devices ({devices})")
        if gpu.lost:
            raise Conflict(f"GPU {gpu.uuid} is lost (XID 79); reset it first", gpu=gpu.uuid)
        taken = {p.pid for p in hw.state.processes} | {v.pid for v in hw.state.mps_servers}
        if pid is None:
            pid = max([FIRST_AUTO_PID - 1, *taken]) + 1
        pid = _positive_int(pid, "pid", minimum=1)
        if pid in taken:
            raise _field_error("pid", f"process {pid} already runs on this node")
        memory = _positive_int(DEFAULT_PROCESS_MIB if used_memory_mib is None
                               else used_memory_mib, "used_memory_mib", minimum=0)
        if server is None:
            refused = hw.exclusivity(device_uuid, newcomer="other process")
            if refused is not None:
                raise Conflict(refused, gpu=gpu.uuid)
        else:
            self._check_mps_limits(server, device_uuid, memory)
        if gi is None:
            free = self.preset.gpu.memory_mib - hw.memory_used_mib(gpu)
        else:
            free = hw.gi_profile(gi).memory_mib - hw.memory_used_mib(gpu, gi)
        if memory > free:
            raise _field_error("used_memory_mib",
                               f"{memory} MiB does not fit: {free} MiB free on {device_uuid}")
        hw.settle_energy(gpu)
        process = ProcessState(pid=pid, device_uuid=device_uuid, used_memory_mib=memory,
                               mps_server=None if server is None else server.pid)
        hw.state.processes.append(process)
        hw.commit()
        return self._describe_process(process)

    def _check_mps_limits(self, server: MpsServerState, device_uuid: str, memory: int) -> None:
        limit = server.pinned_limits_mib.get(device_uuid)
        if limit is not None and memory > limit:
            raise _field_error(
                "used_memory_mib",
                f"out of memory: allocating {memory} MiB exceeds the MPS pinned device memory "
                f"limit of {limit} MiB on {device_uuid} (server {server.pid}, uid {server.uid})")
        clients = [p for p in self.hardware.clients(server) if p.device_uuid == device_uuid]
        if len(clients) >= MPS_CLIENTS_PER_DEVICE:
            raise Conflict(f"MPS server {server.pid} already has {len(clients)} clients on "
                           f"{device_uuid}, the most one device takes")

    def _add_mps_client(self, device_uuid: str, pid: int | None, used_memory_mib: int | None,
                        pipe_directory: str, uid: int) -> dict[str, Any]:
        """Connect through the daemon's own socket (so it must be alive and serving that
        pipe directory); the daemon hands the connection back to the driver. No lock is
        held meanwhile: the daemon calls the driver socket to answer."""
        uid = _positive_int(uid, "uid", minimum=0)
        pipe = Path(pipe_directory)
        try:
            reply = wire.request(pipe / MPS_CONTROL_SOCKET, {"sim_client_connect": {
                "device": device_uuid, "pid": pid, "used_memory_mib": used_memory_mib,
                "uid": uid}}, timeout_s=MPS_TIMEOUT_S)
        except (OSError, ValueError) as err:
            raise _field_error("mps_pipe_directory",
                               f"no MPS control daemon answers in {pipe_directory} "
                               f"({type(err).__name__}: {err})") from None
        record = raise_reply(reply).get("process")
        if not isinstance(record, dict):
            raise Conflict(f"the MPS control daemon in {pipe_directory} gave no answer")
        return record

    def _connect_mps_client(self, daemon_pid: int, request: dict[str, Any]) -> dict[str, Any]:
        """The daemon's half of a client connection (driver thread, under the lock)."""
        hw = self.hardware
        daemon = self._live_daemon(daemon_pid)
        device = request.get("device")
        if not isinstance(device, str) or device not in daemon.devices:
            raise _field_error("device", f"{device!r} is not a device of the MPS daemon in "
                               f"{daemon.pipe_directory} (CUDA_VISIBLE_DEVICES="
                               f"{','.join(daemon.devices)})")
        uid = _positive_int(request.get("uid", 0), "uid", minimum=0)
        server = self._server_for(daemon, uid)
        try:
            record = self._add(device, request.get("pid"), request.get("used_memory_mib"),
                               server)
        except BaseException:
            if not hw.clients(server):  # started for this client only
                hw.drop_server(server)
                hw.commit()
            raise
        return {"process": record}

    def _live_daemon(self, pid: int) -> MpsDaemonState:
        self.hardware.prune_mps()
        daemon = self.hardware.daemon(pid)
        if daemon is None:
            raise NotFound(f"no MPS control daemon {pid} is known to the simulated driver",
                           pid=pid)
        return daemon

    def _server_for(self, daemon: MpsDaemonState, uid: int) -> MpsServerState:
        """The daemon's server for ``uid``, started if need be: one user's server at a time,
        so another user's server with clients makes the new user wait (refused here)."""
        hw = self.hardware
        servers = [v for v in hw.state.mps_servers if v.daemon_pid == daemon.pid]
        mine = next((v for v in servers if v.uid == uid), None)
        if mine is not None:
            return mine
        for other in servers:
            if hw.clients(other):
                raise Conflict(
                    f"the MPS server of uid {other.uid} (pid {other.pid}) has clients: a "
                    f"client of uid {uid} would wait until they all exit (MPS serves one "
                    "user at a time)")
        for other in servers:  # idle: the daemon shuts it down for the new user
            hw.drop_server(other)
        for device in daemon.devices:
            refused = hw.exclusivity(device, newcomer="second MPS server")
            if refused is not None:
                raise Conflict(refused)
        server = MpsServerState(
            pid=hw.next_pid(), daemon_pid=daemon.pid, uid=uid, devices=list(daemon.devices),
            active_thread_percentage=DEFAULT_THREAD_PERCENTAGE
            if daemon.active_thread_percentage is None else daemon.active_thread_percentage,
            pinned_limits_mib=dict(daemon.pinned_limits_mib))
        hw.state.mps_servers.append(server)
        hw.commit()
        return server

    def remove_process(self, pid: int) -> None:
        """End a fake process (as if it exited)."""
        hw = self.hardware
        with hw.lock:
            process = next((p for p in hw.state.processes if p.pid == pid), None)
            if process is None:
                raise NotFound(f"no simulated process {pid}", pid=pid)
            hw.settle_energy(hw.find_device(process.device_uuid)[0])
            hw.state.processes.remove(process)
            hw.commit()

    def _describe_process(self, process: ProcessState) -> dict[str, Any]:
        hw = self.hardware
        gpu, gi, ci = hw.find_device(process.device_uuid)
        server = None if process.mps_server is None else hw.server(process.mps_server)
        daemon = None if server is None else hw.daemon(server.daemon_pid)
        mps = None if server is None else {
            "server": server.pid, "uid": server.uid, "daemon": server.daemon_pid,
            "pipe_directory": daemon.pipe_directory if daemon is not None else None,
            "active_thread_percentage": server.active_thread_percentage,
            "pinned_limit_mib": server.pinned_limits_mib.get(process.device_uuid)}
        return {"pid": process.pid, "device": process.device_uuid, "gpu_uuid": gpu.uuid,
                "gpu_index": gpu.index, "used_memory_mib": process.used_memory_mib,
                "gpu_instance_id": gi.id if gi is not None else None,
                "compute_instance_id": ci.id if ci is not None else None,
                "mps": mps}

    # -- faults and latency ----------------------------------------------------------------

    def add_fault(self, function: str, error: str, gpu: str | None = None, skip: int = 0,
                  times: int = 1) -> dict[str, Any]:
        """Make the (skip+1)-th matching call of ``function`` (on ``gpu``, if given) fail with
        ``error`` (an NVML_ERROR_* name), ``times`` times; ``CRASH`` kills the process there.
        ``gpu`` is a GPU's UUID or index (an index lets ``GPU_AGENT_SIM_FAULTS`` name a GPU
        of a node whose UUIDs are not known yet)."""
        hw = self.hardware
        with hw.lock:
            if isinstance(gpu, str) and gpu.isascii() and gpu.isdigit() \
                    and int(gpu) < len(hw.state.gpus):
                gpu = hw.gpu(int(gpu)).uuid
            if gpu is not None and hw.gpu_by_uuid(gpu) is None:
                raise _field_error("gpu", f"no GPU {gpu!r} on this node (a GPU UUID or index)")
            return hw.faults.add(function, error, gpu, skip, times).describe()

    def clear_faults(self) -> None:
        with self.hardware.lock:
            self.hardware.faults.clear()

    def set_latency(self, latencies: dict[str, float]) -> None:
        """Replace the per-function latency table (seconds slept at each call)."""
        if not isinstance(latencies, dict):
            raise _field_error("latencies", "must be an object of function name -> seconds")
        table: dict[str, float] = {}
        for name, seconds in latencies.items():
            check_function(name, field=f"latencies.{name}")
            if (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                    or not math.isfinite(seconds) or not 0 <= seconds <= MAX_LATENCY_S):
                raise _field_error(f"latencies.{name}",
                                   f"must be a number of seconds from 0 to {MAX_LATENCY_S:g}")
            table[name] = float(seconds)
        with self.hardware.lock:
            self.hardware.latencies = table

    # -- the NVLink fabric ------------------------------------------------------------------

    def set_fabric(self, gpu_uuid: str, condition: str, status: str | None = None) -> None:
        """What a GPU's fabric reports from now on (one of
        :data:`~agent.gpu.sim.links.FABRIC_CONDITIONS`); ``status`` is the NVML error a
        ``failed`` fabric reports (default NVML_ERROR_INSUFFICIENT_RESOURCES)."""
        if condition not in links.FABRIC_CONDITIONS:
            raise _field_error("condition", f"{condition!r} is not one of "
                               f"{', '.join(links.FABRIC_CONDITIONS)}")
        if status is not None and condition != "failed":
            raise _field_error("status", "only a failed fabric reports an error status")
        code = links.DEFAULT_FABRIC_FAILURE
        if status is not None:
            name = status if status.startswith("NVML_ERROR_") else f"NVML_ERROR_{status}"
            if name not in ERROR_CODES or ERROR_CODES[name] == pynvml.NVML_SUCCESS:
                raise _field_error("status", f"{status!r} is not an NVML error name (e.g. "
                                   "NVML_ERROR_INSUFFICIENT_RESOURCES)")
            code = ERROR_CODES[name]
        if not self.preset.fabric_capable:
            raise Conflict(f"preset {self.preset.name!r} has no NVLink fabric (its GPUs "
                           "answer NOT_SUPPORTED)")
        hw = self.hardware
        with hw.lock:
            gpu = self._whole_gpu(gpu_uuid)
            gpu.fabric = condition
            gpu.fabric_status = code if condition == "failed" else 0
            hw.commit()

    # -- XIDs, resets ----------------------------------------------------------------------

    def inject_xid(self, gpu_uuid: str, xid: int,
                   recovery_action: str | None = None) -> dict[str, Any]:
        """Raise an XID on a GPU (or MIG device): an event for every event set registered for
        it; XID 79 (fallen off the bus) also makes the GPU lost until it is reset, XID 63
        (a row remapping recorded) adds an uncorrectable remapped row, XID 64 (the remapper
        failed) sets the remapping failure, as the driver reports them. The GPU's recovery
        action follows the XID (:mod:`agent.gpu.sim.recovery_action`) or is the one named
        (``none``, ``reset``, ``reboot``, ``drain-p2p``, ``drain-and-reset``), set under the
        lock the XID's event is posted under, so a reader woken by the event sees it."""
        hw = self.hardware
        xid = _positive_int(xid, "xid", minimum=0)
        named = self._recovery_action(recovery_action)
        with hw.lock:
            try:
                gpu, gi, ci = hw.find_device(gpu_uuid)
            except KeyError:
                raise NotFound(f"no GPU or MIG device {gpu_uuid!r} on this node",
                               gpu=gpu_uuid) from None
            gi_id = gi.id if gi is not None else NO_INSTANCE
            ci_id = ci.id if ci is not None else NO_INSTANCE
            if xid == XID_FALLEN_OFF_THE_BUS and not gpu.lost:
                gpu.lost = True
                hw.commit()
            elif xid == XID_ROW_REMAP_EVENT:
                hw.remap_rows(gpu, uncorrectable=1)
            elif xid == XID_ROW_REMAP_FAILURE:
                hw.remap_rows(gpu, failed=True)
            hw.post_event(gpu, pynvml.nvmlEventTypeXidCriticalError, xid, gi_id=gi_id,
                          ci_id=ci_id)
            # Under the same lock as the event: no reader gets between the two.
            hw.set_recovery_action(gpu, named if named is not None else action_after(
                xid, gpu.recovery_action, nvlink=hw.nvlink))
            return {"gpu_uuid": gpu.uuid, "device": gpu_uuid, "xid": xid,
                    "gpu_instance_id": gi.id if gi is not None else None,
                    "compute_instance_id": ci.id if ci is not None else None,
                    "lost": gpu.lost,
                    "recovery_action": action_name(gpu.recovery_action)
                    if self.preset.driver.recovery_action else None}

    def _recovery_action(self, name: str | None) -> int | None:
        """The action a caller named, checked: a driver without the field cannot report one."""
        if name is None:
            return None
        if name not in ACTION_BY_NAME:
            raise _field_error("recovery_action", f"{name!r} is not one of "
                               f"{', '.join(ACTION_BY_NAME)}")
        driver = self.preset.driver
        if not driver.recovery_action:
            raise _field_error("recovery_action", f"driver {driver.version} of preset "
                               f"{self.preset.name!r} reports no recovery action")
        return ACTION_BY_NAME[name]

    def add_pcie_replays(self, gpu_uuid: str, count: int) -> None:
        """Count PCIe replays on a GPU (a marginal link retrying transfers)."""
        hw = self.hardware
        count = _positive_int(count, "count", minimum=1)
        with hw.lock:
            gpu = self._whole_gpu(gpu_uuid)
            gpu.pcie_replays += count
            hw.commit()

    def _whole_gpu(self, gpu_uuid: str) -> GpuState:
        gpu = self.hardware.gpu_by_uuid(gpu_uuid)
        if gpu is None:
            raise NotFound(f"no GPU {gpu_uuid!r} on this node", gpu=gpu_uuid)
        return gpu

    def reset_gpu(self, gpu_uuid: str) -> None:
        """``nvidia-smi -r``: needs an idle GPU; drops its GPU/compute instances, applies a
        pending MIG mode and brings a lost GPU back."""
        hw = self.hardware
        with hw.lock:
            gpu = self._whole_gpu(gpu_uuid)
            hw.prune_mps()
            devices = {gpu.uuid} | {ci.uuid for _, ci in hw.mig_devices(gpu)}
            busy = [p.process.pid for p in hw.placed_processes(gpu)] + [
                v.pid for v in hw.servers_on(devices)]
            if busy:
                raise ProcessesRunning(f"GPU {gpu_uuid} is in use by processes {busy}; a reset "
                                       "needs an idle GPU", gpu=gpu_uuid, pids=busy)
            hw.reset(gpu)
            hw.commit()

    def reload_driver(self, *, kill_processes: bool = False) -> None:
        """Unload and reload the driver (every GPU reset, Hopper MIG mode back to disabled;
        the boot id stays, as on a real node). Running processes block it unless
        ``kill_processes``."""
        self._reload(kill_processes=kill_processes, reboot=False)

    def reboot(self) -> None:
        """Boot the node again: every process gone, the driver loaded afresh, a new boot id."""
        self._reload(kill_processes=True, reboot=True)

    def _reload(self, *, kill_processes: bool, reboot: bool) -> None:
        hw = self.hardware
        with hw.lock:
            hw.prune_mps()
            busy = [p.pid for p in hw.state.processes] + [v.pid for v in hw.state.mps_servers]
            if busy and not kill_processes:
                raise ProcessesRunning(
                    f"processes {busy} hold the GPUs; the driver cannot be unloaded", pids=busy)
            hw.state.processes.clear()
            hw.state.mps_servers.clear()
            if reboot:
                hw.reboot()
            else:
                hw.reload_driver()
            hw.commit()
            procfs.write_boot_id(self.proc_root, hw.state.boot_id)

    # -- introspection ---------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        hw = self.hardware
        with hw.lock:
            hw.prune_mps()
            return {
                "preset": self.preset.name,
                "presets": list(preset_names()),
                "driver_version": self.preset.driver.version,
                "boot_id": hw.state.boot_id,
                "gpus": hw.describe_gpus(),
                "processes": [self._describe_process(p) for p in hw.state.processes],
                "mps_daemons": self._describe_daemons(),
                "faults": hw.faults.describe(),
                "latencies": dict(hw.latencies),
                "calls": dict(sorted(hw.calls.items())),
            }

    def _describe_daemons(self) -> list[dict[str, Any]]:
        hw = self.hardware
        return [{
            "pid": d.pid, "pipe_directory": d.pipe_directory, "log_directory": d.log_directory,
            "devices": list(d.devices),
            "defaults": {"active_thread_percentage": d.active_thread_percentage,
                         "pinned_limits_mib": dict(d.pinned_limits_mib)},
            "servers": [{
                "pid": v.pid, "uid": v.uid, "devices": list(v.devices),
                "active_thread_percentage": v.active_thread_percentage,
                "pinned_limits_mib": dict(v.pinned_limits_mib),
                "clients": [{"pid": p.pid, "device": p.device_uuid,
                             "used_memory_mib": p.used_memory_mib} for p in hw.clients(v)],
            } for v in hw.state.mps_servers if v.daemon_pid == d.pid],
        } for d in hw.state.mps_daemons]

    # -- the driver socket (simulated nvidia-smi and nvidia-cuda-mps-control) -------------

    def _driver_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request of a simulated tool (driver thread); AgentErrors become replies."""
        op = message.get("op")
        handler = {
            "tool": self._tool_call, "set_compute_mode": self._tool_compute_mode,
            "set_timeslice": self._tool_timeslice, "mps_daemon_start": self._daemon_start,
            "mps_daemon_update": self._daemon_update, "mps_daemon_quit": self._daemon_quit,
            "mps_query": self._daemon_query, "mps_start_server": self._daemon_start_server,
            "mps_client_connect": self._daemon_client_connect,
        }.get(op if isinstance(op, str) else "")
        if handler is None:
            raise _field_error("op", f"unknown simulated driver request {op!r}")
        with self.hardware.lock:
            if self._closed:
                raise Conflict("the simulated node is closed")
            return handler(message)

    def _tool_call(self, message: dict[str, Any]) -> dict[str, Any]:
        """A tool starts: count it, fire a matching fault (the message it fails with), and
        say how long it should take (its latency)."""
        hw = self.hardware
        tool = message.get("tool")
        if tool not in TOOL_FUNCTIONS:
            raise _field_error("tool", f"{tool!r} is not a simulated tool")
        assert isinstance(tool, str)
        gpu = None
        device = message.get("device")
        if isinstance(device, str):
            found = self._find(device)
            gpu = None if found is None else found[0].uuid
        hw.calls[tool] += 1
        fault = hw.faults.match(tool, gpu)
        return {"fail": None if fault is None else fault.error,
                "latency_s": hw.latencies.get(tool, 0.0)}

    def _find(self, ref: str) -> tuple[GpuState, CiState | None] | None:
        """A device as nvidia-smi's ``-i`` takes it: index, UUID (GPU or MIG), PCI bus id."""
        hw = self.hardware
        if ref.isdigit() and int(ref) < len(hw.state.gpus):
            return hw.gpu(int(ref)), None
        try:
            gpu, _, ci = hw.find_device(ref)
            return gpu, ci
        except KeyError:
            pass
        wanted = ref.upper()[-12:]
        gpu_found = next((g for g in hw.state.gpus if hw.bus_id(g)[-12:] == wanted), None)
        return None if gpu_found is None else (gpu_found, None)

    def _tool_device(self, message: dict[str, Any]) -> tuple[GpuState, CiState | None]:
        ref = message.get("device")
        found = self._find(ref) if isinstance(ref, str) else None
        if found is None:
            raise NotFound(f"No devices were found matching {ref!r}")
        if found[0].lost:
            raise Conflict(f"GPU {self.hardware.bus_id(found[0])}: Unable to determine the "
                           "device handle: GPU is lost")
        return found

    def _tool_compute_mode(self, message: dict[str, Any]) -> dict[str, Any]:
        hw = self.hardware
        gpu, ci = self._tool_device(message)
        mode = message.get("mode")
        if mode not in COMPUTE_MODE_NAMES:
            raise _field_error("mode", f"{mode!r} is not a compute mode")
        assert isinstance(mode, int)
        if ci is None and gpu.mig_current:
            raise Conflict(f"Setting compute mode for GPU {hw.bus_id(gpu)} is not supported "
                           "while MIG is enabled: set it on its MIG devices")
        name = COMPUTE_MODE_NAMES[mode]
        where = (f"MIG device {ci.uuid} of GPU {hw.bus_id(gpu)}" if ci is not None
                 else f"GPU {hw.bus_id(gpu)}")
        if hw.compute_mode(gpu, ci) == mode:
            return {"output": f"Compute mode is already set to {name} for {where}."}
        hw.set_compute_mode(gpu, ci, mode)
        return {"output": f"Set compute mode to {name} for {where}."}

    def _tool_timeslice(self, message: dict[str, Any]) -> dict[str, Any]:
        hw = self.hardware
        gpu, ci = self._tool_device(message)
        value = message.get("value")
        if isinstance(value, bool) or value not in (0, 1, 2, 3):
            raise _field_error("value", f"{value!r} is not a time slice (0-3)")
        assert isinstance(value, int)
        if ci is not None or gpu.mig_current:
            raise Conflict(f"Setting the timeslice for {ci.uuid if ci else hw.bus_id(gpu)} "
                           "is not supported on MIG devices")
        if gpu.timeslice != value:
            gpu.timeslice = value
            hw.commit()
        return {"output": f"Set timeslice to {value} for GPU {hw.bus_id(gpu)}."}

    def _daemon_start(self, message: dict[str, Any]) -> dict[str, Any]:
        """A control daemon announces itself (before its ``-d`` parent exits)."""
        hw = self.hardware
        hw.prune_mps()
        pid = _positive_int(message.get("pid"), "pid", minimum=1)
        start_time = process_start_time(pid)
        if start_time is None:
            raise NotFound(f"process {pid} does not run", pid=pid)
        pipe = str(message.get("pipe_directory"))
        if any(d.pipe_directory == pipe for d in hw.state.mps_daemons):
            raise Conflict(f"An instance of this daemon is already running in {pipe}")
        devices = message.get("devices")
        if devices is None:
            listed = [g.uuid for g in hw.state.gpus]
        elif isinstance(devices, list) and all(isinstance(d, str) for d in devices):
            listed = [d for d in devices if d]
        else:
            raise _field_error("devices", "must be a list of device UUIDs")
        unknown = [d for d in listed if self._find(d) is None]
        if unknown:
            raise _field_error("devices", f"CUDA_VISIBLE_DEVICES names no device here: "
                               f"{', '.join(unknown)}")
        uuids = []
        for ref in listed:
            found = self._find(ref)
            assert found is not None
            uuids.append(found[1].uuid if found[1] is not None else found[0].uuid)
        hw.state.mps_daemons.append(MpsDaemonState(
            pid=pid, start_time=start_time, pipe_directory=pipe,
            log_directory=str(message.get("log_directory")), devices=uuids))
        hw.commit()
        return {"devices": uuids}

    def _daemon_update(self, message: dict[str, Any]) -> dict[str, Any]:
        hw = self.hardware
        daemon = self._live_daemon(_positive_int(message.get("pid"), "pid", minimum=1))
        pct = message.get("active_thread_percentage")
        limits = message.get("pinned_limits_mib")
        daemon.active_thread_percentage = None if pct is None else int(pct)
        daemon.pinned_limits_mib = ({str(k): int(v) for k, v in limits.items()}
                                    if isinstance(limits, dict) else {})
        hw.commit()
        return {}

    def _daemon_quit(self, message: dict[str, Any]) -> dict[str, Any]:
        hw = self.hardware
        daemon = hw.daemon(_positive_int(message.get("pid"), "pid", minimum=1))
        if daemon is not None:
            hw.drop_daemon(daemon)
            hw.commit()
        return {}

    def _daemon_query(self, message: dict[str, Any]) -> dict[str, Any]:
        daemon = self._live_daemon(_positive_int(message.get("pid"), "pid", minimum=1))
        described = next(d for d in self._describe_daemons() if d["pid"] == daemon.pid)
        return {"servers": described["servers"]}

    def _daemon_start_server(self, message: dict[str, Any]) -> dict[str, Any]:
        daemon = self._live_daemon(_positive_int(message.get("pid"), "pid", minimum=1))
        server = self._server_for(daemon, _positive_int(message.get("uid"), "uid", minimum=0))
        return {"server": server.pid}

    def _daemon_client_connect(self, message: dict[str, Any]) -> dict[str, Any]:
        request = message.get("client")
        if not isinstance(request, dict):
            raise _field_error("client", "must be an object")
        return self._connect_mps_client(
            _positive_int(message.get("pid"), "pid", minimum=1), request)

