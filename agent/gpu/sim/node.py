"""A simulated GPU node: the NVML stand-in, its durable hardware state, the /proc files the
driver would provide, and the controls (processes, faults, latency, XIDs, resets) that the
``/v1/sim/*`` routes expose."""

from __future__ import annotations

import math
from pathlib import Path
from types import TracebackType
from typing import Any

import pynvml

from agent.durable import ExclusiveLock
from agent.errors import Conflict, InvalidRequest, NotFound, ProcessesRunning
from agent.gpu.sim import devfs, procfs, sysfs
from agent.gpu.sim.faults import check_function
from agent.gpu.sim.hardware import (
    NO_INSTANCE,
    XID_FALLEN_OFF_THE_BUS,
    XID_ROW_REMAP_EVENT,
    XID_ROW_REMAP_FAILURE,
    SimulatedHardware,
)
from agent.gpu.sim.nvml import SimulatedNvml
from agent.gpu.sim.presets import Preset, get_preset, preset_names
from agent.gpu.sim.state import (
    GpuState,
    HardwareState,
    ProcessState,
    SimulatorStateError,
    StateFile,
)

FIRST_AUTO_PID = 100000
DEFAULT_PROCESS_MIB = 1024
MAX_LATENCY_S = 30.0


def _field_error(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", errors=[{"field": field, "reason": message}])


def _positive_int(value: object, field: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(field, f"must be an integer >= {minimum}")
    return value


class SimulatedNode:
    """One simulated node, owning ``<state_dir>/sim`` (locked for its lifetime) and the
    driver's files under ``proc_root``. ``nvml`` is the object the hardware layer calls."""

    def __init__(self, preset: str, state_dir: Path, proc_root: Path) -> None:
        self.preset: Preset = get_preset(preset)
        self.state_dir = Path(state_dir)
        self.proc_root = Path(proc_root)
        sim_dir = self.state_dir / "sim"
        #: Where the simulated node's ``/sys`` is (PCI device links for the PCIe roots).
        self.sys_root = sim_dir / "sys"
        #: Where the simulated node's device nodes are (``<dev_root>/dev/nvidia0``, ...).
        self.dev_root = sim_dir / "root"
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
            devfs.write_nodes(self.dev_root, gpu_count=self.preset.gpu_count)
        except BaseException:
            self._lock.release()
            raise

    def _save(self, state: HardwareState) -> None:
        if self._closed:
            raise SimulatorStateError("simulated node is closed; its state can no longer change")
        self._file.save(state)

    def close(self) -> None:
        """Release the state directory (the state is already on disk)."""
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
                    used_memory_mib: int | None = None) -> dict[str, Any]:
        """Start a fake compute process on a GPU (MIG off) or on a MIG device."""
        hw = self.hardware
        with hw.lock:
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
            taken = {p.pid for p in hw.state.processes}
            if pid is None:
                pid = max([FIRST_AUTO_PID - 1, *taken]) + 1
            pid = _positive_int(pid, "pid", minimum=1)
            if pid in taken:
                raise _field_error("pid", f"process {pid} already runs on this node")
            memory = _positive_int(DEFAULT_PROCESS_MIB if used_memory_mib is None
                                   else used_memory_mib, "used_memory_mib", minimum=0)
            if gi is None:
                free = self.preset.gpu.memory_mib - hw.memory_used_mib(gpu)
            else:
                free = hw.gi_profile(gi).memory_mib - hw.memory_used_mib(gpu, gi)
            if memory > free:
                raise _field_error("used_memory_mib",
                                   f"{memory} MiB does not fit: {free} MiB free on {device_uuid}")
            hw.settle_energy(gpu)
            process = ProcessState(pid=pid, device_uuid=device_uuid, used_memory_mib=memory)
            hw.state.processes.append(process)
            hw.commit()
            return self._describe_process(process)

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
        gpu, gi, ci = self.hardware.find_device(process.device_uuid)
        return {"pid": process.pid, "device": process.device_uuid, "gpu_uuid": gpu.uuid,
                "gpu_index": gpu.index, "used_memory_mib": process.used_memory_mib,
                "gpu_instance_id": gi.id if gi is not None else None,
                "compute_instance_id": ci.id if ci is not None else None}

    # -- faults and latency ----------------------------------------------------------------

    def add_fault(self, function: str, error: str, gpu: str | None = None, skip: int = 0,
                  times: int = 1) -> dict[str, Any]:
        """Make the (skip+1)-th matching call of ``function`` (on ``gpu``, if given) fail with
        ``error`` (an NVML_ERROR_* name), ``times`` times; ``CRASH`` kills the process there."""
        hw = self.hardware
        with hw.lock:
            if gpu is not None and hw.gpu_by_uuid(gpu) is None:
                raise _field_error("gpu", f"no GPU {gpu!r} on this node (GPU UUIDs only)")
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

    # -- XIDs, resets ----------------------------------------------------------------------

    def inject_xid(self, gpu_uuid: str, xid: int) -> dict[str, Any]:
        """Raise an XID on a GPU (or MIG device): an event for every event set registered for
        it; XID 79 (fallen off the bus) also makes the GPU lost until it is reset, XID 63
        (a row remapping recorded) adds an uncorrectable remapped row, XID 64 (the remapper
        failed) sets the remapping failure, as the driver reports them."""
        hw = self.hardware
        xid = _positive_int(xid, "xid", minimum=0)
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
            return {"gpu_uuid": gpu.uuid, "device": gpu_uuid, "xid": xid,
                    "gpu_instance_id": gi.id if gi is not None else None,
                    "compute_instance_id": ci.id if ci is not None else None,
                    "lost": gpu.lost}

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
            busy = [p.process.pid for p in hw.placed_processes(gpu)]
            if busy:
                raise ProcessesRunning(f"GPU {gpu_uuid} is in use by processes {busy}; a reset "
                                       "needs an idle GPU", gpu=gpu_uuid, pids=busy)
            hw.reset(gpu)
            hw.commit()

    def reload_driver(self, *, kill_processes: bool = False) -> None:
        """Unload and reload the driver (every GPU reset, Hopper MIG mode back to disabled,
        new boot id). Running processes block it unless ``kill_processes`` (a reboot)."""
        hw = self.hardware
        with hw.lock:
            busy = [p.pid for p in hw.state.processes]
            if busy and not kill_processes:
                raise ProcessesRunning(
                    f"processes {busy} hold the GPUs; the driver cannot be unloaded", pids=busy)
            hw.state.processes.clear()
            hw.reload_driver()
            hw.commit()
            procfs.write_boot_id(self.proc_root, hw.state.boot_id)

    # -- introspection ---------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        hw = self.hardware
        with hw.lock:
            return {
                "preset": self.preset.name,
                "presets": list(preset_names()),
                "boot_id": hw.state.boot_id,
                "gpus": hw.describe_gpus(),
                "processes": [self._describe_process(p) for p in hw.state.processes],
                "faults": hw.faults.describe(),
                "latencies": dict(hw.latencies),
                "calls": dict(sorted(hw.calls.items())),
            }
