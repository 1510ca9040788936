"""The simulated GPUs' behaviour: MIG mode, GPU and compute instances, processes, telemetry
and events, with NVML's rules and error codes. Both the NVML facade (``nvml.py``) and the
controls (``node.py``) drive this; every change is saved before the call that made it returns.

Callers hold :attr:`SimulatedHardware.lock` around every method here.

Longer than the house's ~500 lines on purpose: NVML's MIG rules (placements, overlaps,
``IN_USE``, stale handles, pending modes) all read and change the same per-GPU state under
this one lock; split by call, one instance's rules would live in several files.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pynvml

from agent.gpu.sim import links, recovery_action, telemetry
from agent.gpu.sim.faults import FaultTable
from agent.gpu.sim.naming import mig_uuid
from agent.gpu.sim.presets import CiProfile, GiProfile, GpuModel, Preset
from agent.gpu.sim.state import (
    CiState,
    GiState,
    GpuState,
    HardwareState,
    MpsDaemonState,
    MpsServerState,
    ProcessState,
)

#: Simulated processes (and MPS servers) get pids from here up, above any real one in tests.
FIRST_AUTO_PID = 100000
#: NVML's "no GPU/compute instance" in process and event records.
NO_INSTANCE = 0xFFFFFFFF
MIG_DEVICES_PER_GPU = 7
XID_FALLEN_OFF_THE_BUS = 79
XID_ROW_REMAP_EVENT = 63
XID_ROW_REMAP_FAILURE = 64
#: NVML compute modes (``nvmlComputeMode_t``; 1, EXCLUSIVE_THREAD, is no longer supported).
COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
COMPUTE_MODE_NAMES = {v: k for k, v in COMPUTE_MODES.items()}
EXCLUSIVE_PROCESS = COMPUTE_MODES["EXCLUSIVE_PROCESS"]
PROHIBITED = COMPUTE_MODES["PROHIBITED"]


def process_start_time(pid: int) -> str | None:
    """A live process's start time (``/proc/<pid>/stat`` field 22); None when it is gone
    or a zombie (a killed daemon whose reaper has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def fail(code: int) -> NoReturn:
    """Raise what pynvml raises for an NVML return code (the matching NVMLError subclass)."""
    raise pynvml.NVMLError(code)


def _overlaps(a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
    return a_start < b_start + b_size and b_start < a_start + a_size


@dataclass(frozen=True)
class Event:
    gpu_index: int
    event_type: int
    data: int
    gi_id: int = NO_INSTANCE
    ci_id: int = NO_INSTANCE


@dataclass(eq=False)
class EventSet:
    """An NVML event set: which event types it wants from which GPUs, and what arrived."""

    registrations: dict[int, int] = field(default_factory=dict)
    queue: deque[Event] = field(default_factory=deque)
    freed: bool = False


@dataclass(eq=False)
class Activity:
    """Activity counters of a GPU or GPU instance (``telemetry.activity_rates`` integrated
    over time since ``at``), runtime only: the driver's counters start with the process."""

    owner: object
    at: float
    totals: dict[str, float]


@dataclass(frozen=True)
class Placed:
    """Where a process runs: its GPU, and the GI/CI when that GPU is in MIG mode."""

    process: ProcessState
    gpu: GpuState
    gi: GiState | None = None
    ci: CiState | None = None


class SimulatedHardware:
    """The simulated GPUs of one node, their state, and the runtime-only knobs (faults,
    latencies, call counters, event sets)."""

    def __init__(self, preset: Preset, state: HardwareState,
                 commit: Callable[[HardwareState], None] | None = None) -> None:
        self.preset = preset
        self.model: GpuModel = preset.gpu
        self.state = state
        self._commit = commit
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.faults = FaultTable()
        self.latencies: dict[str, float] = {}
        self.calls: Counter[str] = Counter()
        self.event_sets: list[EventSet] = []
        #: Threads blocked in nvmlEventSetWait right now (under ``lock``): a test injects an
        #: event once its waiter is blocked, not after a guessed delay.
        self.event_waiters = 0
        # (GPU index, GI id or -1) -> counters; a GI re-created under the same id starts over.
        self._activity: dict[tuple[int, int], Activity] = {}
        self.nvlink = links.link_count(preset) > 0
        self._last_server_pid = 0

    def commit(self) -> None:
        """Make the current state durable (before the mutating call returns)."""
        if self._commit is not None:
            self._commit(self.state)

    # -- compute mode ----------------------------------------------------------------------

    def compute_mode(self, gpu: GpuState, ci: CiState | None = None) -> int:
        """The compute mode of a GPU, or of a MIG device (its own, with MIG on)."""
        if ci is not None:
            return gpu.mig_compute_modes.get(ci.uuid, 0)
        return gpu.compute_mode

    def set_compute_mode(self, gpu: GpuState, ci: CiState | None, mode: int) -> None:
        """``nvmlDeviceSetComputeMode``: with MIG on, the MIG device handle is the one to
        set (the GPU's own handle is NOT_SUPPORTED then)."""
        if mode not in COMPUTE_MODE_NAMES:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if ci is None and gpu.mig_current:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if ci is None:
            gpu.compute_mode = mode
        else:
            gpu.mig_compute_modes[ci.uuid] = mode
        self.commit()

    # -- MPS -------------------------------------------------------------------------------

    def daemon(self, pid: int) -> MpsDaemonState | None:
        return next((d for d in self.state.mps_daemons if d.pid == pid), None)

    def server(self, pid: int) -> MpsServerState | None:
        return next((v for v in self.state.mps_servers if v.pid == pid), None)

    def servers_on(self, device_uuids: set[str]) -> list[MpsServerState]:
        """MPS servers running on any of these devices."""
        return [v for v in self.state.mps_servers if device_uuids & set(v.devices)]

    def clients(self, server: MpsServerState) -> list[ProcessState]:
        return [p for p in self.state.processes if p.mps_server == server.pid]

    def exclusivity(self, device_uuid: str, *, newcomer: str,
                    server_pid: int | None = None) -> str | None:
        """Why a new process (``newcomer`` words it) may not run on a device in its compute
        mode, or None. EXCLUSIVE_PROCESS allows one process, an MPS server counting as the
        one (its clients do not); PROHIBITED none."""
        gpu, _, ci = self.find_device(device_uuid)
        mode = self.compute_mode(gpu, ci)
        if mode == PROHIBITED:
            return f"{device_uuid} is in compute mode PROHIBITED: no {newcomer} may run on it"
        if mode != EXCLUSIVE_PROCESS:
            return None
        others = [p.pid for p in self.state.processes
                  if p.device_uuid == device_uuid and p.mps_server is None]
        servers = [v.pid for v in self.servers_on({device_uuid}) if v.pid != server_pid]
        if others or servers:
            holder = (f"MPS server {servers[0]}" if servers else f"process {others[0]}")
            return (f"{device_uuid} is in compute mode EXCLUSIVE_PROCESS and {holder} runs "
                    f"on it: no {newcomer} may run there")
        return None

    def drop_server(self, server: MpsServerState) -> None:
        """An MPS server exits: its clients go with it."""
        self.state.processes = [p for p in self.state.processes if p.mps_server != server.pid]
        self.state.mps_servers.remove(server)

    def drop_daemon(self, daemon: MpsDaemonState) -> None:
        for server in [v for v in self.state.mps_servers if v.daemon_pid == daemon.pid]:
            self.drop_server(server)
        self.state.mps_daemons.remove(daemon)

    def prune_mps(self) -> bool:
        """Forget daemons whose process is gone (killed, crashed), with their servers and
        clients, as the driver sees their contexts go; whether anything was forgotten."""
        dead = [d for d in self.state.mps_daemons
                if process_start_time(d.pid) != d.start_time]
        for daemon in dead:
            self.drop_daemon(daemon)
        orphans = [v for v in self.state.mps_servers if self.daemon(v.daemon_pid) is None]
        for server in orphans:
            self.drop_server(server)
        servers = {v.pid for v in self.state.mps_servers}
        clients = [p for p in self.state.processes
                   if p.mps_server is not None and p.mps_server not in servers]
        for client in clients:
            self.state.processes.remove(client)
        if dead or orphans or clients:
            self.commit()
        return bool(dead or orphans or clients)

    def next_pid(self) -> int:
        """A pid for a new MPS server: never one a server of this run had (a new server is
        a new process), nor one in use."""
        taken = {p.pid for p in self.state.processes} | {v.pid for v in self.state.mps_servers}
        self._last_server_pid = max([FIRST_AUTO_PID - 1, self._last_server_pid, *taken]) + 1
        return self._last_server_pid

    # -- lookups ---------------------------------------------------------------------------

    def gpu(self, index: int) -> GpuState:
        return self.state.gpus[index]

    def gpu_by_uuid(self, gpu_uuid: str) -> GpuState | None:
        return next((g for g in self.state.gpus if g.uuid == gpu_uuid), None)

    def mig_devices(self, gpu: GpuState) -> Iterator[tuple[GiState, CiState]]:
        """MIG devices (one per CI) in NVML's order: by GI id, then CI id."""
        for gi in sorted(gpu.gpu_instances, key=lambda g: g.id):
            for ci in sorted(gi.compute_instances, key=lambda c: c.id):
                yield gi, ci

    def find_device(self, device_uuid: str) -> tuple[GpuState, GiState | None, CiState | None]:
        """A GPU or MIG device by UUID; KeyError if there is none."""
        for gpu in self.state.gpus:
            if gpu.uuid == device_uuid:
                return gpu, None, None
            for gi, ci in self.mig_devices(gpu):
                if ci.uuid == device_uuid:
                    return gpu, gi, ci
        raise KeyError(device_uuid)

    def bus_id(self, gpu: GpuState) -> str:
        return f"00000000:{self.preset.bus_numbers[gpu.index]:02X}:00.0"

    def gi_profile(self, gi: GiState) -> GiProfile:
        profile = self.model.gi_profile(gi.profile_id)
        assert profile is not None, "state was checked against the preset when loaded"
        return profile

    def ci_profile(self, gi: GiState, ci: CiState) -> CiProfile:
        profile = self.model.ci_profile(self.gi_profile(gi), ci.profile_id)
        assert profile is not None, "state was checked against the preset when loaded"
        return profile

    # -- processes -------------------------------------------------------------------------

    def placed_processes(self, gpu: GpuState) -> list[Placed]:
        """Processes running on this GPU or on any of its MIG devices."""
        devices: dict[str, tuple[GiState | None, CiState | None]] = {gpu.uuid: (None, None)}
        devices.update({ci.uuid: (gi, ci) for gi, ci in self.mig_devices(gpu)})
        return [Placed(p, gpu, *devices[p.device_uuid]) for p in self.state.processes
                if p.device_uuid in devices]

    def memory_used_mib(self, gpu: GpuState, gi: GiState | None = None) -> int:
        """Used memory of the whole GPU, or of one GPU instance (shared by its CIs)."""
        placed = self.placed_processes(gpu)
        if gi is None:
            return telemetry.RESERVED_GPU_MIB + sum(p.process.used_memory_mib for p in placed)
        return telemetry.RESERVED_MIG_MIB + sum(p.process.used_memory_mib for p in placed
                                                if p.gi is gi)

    def gi_utilization(self, gpu: GpuState, gi: GiState) -> int:
        """Utilisation of one GPU instance: its processes over the instance's SMs."""
        sms = self.gi_profile(gi).multiprocessors
        return telemetry.gpu_utilization(
            (p.process.pid, self.ci_profile(gi, p.ci).multiprocessors / sms)
            for p in self.placed_processes(gpu) if p.gi is gi and p.ci is not None)

    def utilization(self, gpu: GpuState) -> int:
        shares: list[tuple[int, float]] = []
        for placed in self.placed_processes(gpu):
            if placed.gi is None or placed.ci is None:
                shares.append((placed.process.pid, 1.0))
            else:
                sms = self.ci_profile(placed.gi, placed.ci).multiprocessors
                shares.append((placed.process.pid, sms / self.model.multiprocessors))
        return telemetry.gpu_utilization(shares)

    def power_mw(self, gpu: GpuState) -> int:
        return telemetry.power_mw(self.model, self.utilization(gpu))

    def energy_mj(self, gpu: GpuState, now: float | None = None) -> int:
        return telemetry.energy_mj(gpu.energy_mj, gpu.energy_at, self.power_mw(gpu),
                                   time.time() if now is None else now)

    def settle_energy(self, gpu: GpuState) -> None:
        """Fold the energy and activity so far into the counters; call before the load
        changes (both are piecewise constant between load changes)."""
        now = time.time()
        gpu.energy_mj = self.energy_mj(gpu, now)
        gpu.energy_at = now
        self._fold(gpu, None)
        for gi in gpu.gpu_instances:
            self._fold(gpu, gi)

    # -- activity (GPM, NVLink and PCIe traffic) -------------------------------------------

    def rates(self, gpu: GpuState, gi: GiState | None = None) -> dict[str, float]:
        """What the GPU (or one of its GPU instances) does per second at its current load."""
        if gi is None:
            return telemetry.activity_rates(self.utilization(gpu), 1.0, self.nvlink)
        share = self.gi_profile(gi).multiprocessors / self.model.multiprocessors
        return telemetry.activity_rates(self.gi_utilization(gpu, gi), share, self.nvlink)

    def activity(self, gpu: GpuState, gi: GiState | None = None) -> tuple[float, dict[str, float]]:
        """(monotonic time, activity counters) of the GPU or a GPU instance, as of now."""
        now = time.monotonic()
        counters = self._counters(gpu, gi, now)
        elapsed = now - counters.at
        return now, {name: counters.totals.get(name, 0.0) + rate * elapsed
                     for name, rate in self.rates(gpu, gi).items()}

    def _counters(self, gpu: GpuState, gi: GiState | None, now: float) -> Activity:
        key = (gpu.index, -1 if gi is None else gi.id)
        owner: object = gpu if gi is None else gi
        counters = self._activity.get(key)
        if counters is None or counters.owner is not owner:
            counters = self._activity[key] = Activity(owner=owner, at=now, totals={})
        return counters

    def _fold(self, gpu: GpuState, gi: GiState | None) -> None:
        counters = self._counters(gpu, gi, time.monotonic())
        counters.at, counters.totals = self.activity(gpu, gi)

    def remap_rows(self, gpu: GpuState, *, correctable: int = 0, uncorrectable: int = 0,
                   failed: bool = False) -> None:
        """Record remapped rows (what an ECC error makes the row remapper do)."""
        gpu.remapped_correctable += correctable
        gpu.remapped_uncorrectable += uncorrectable
        gpu.remap_failed = gpu.remap_failed or failed
        self.commit()

    # -- MIG mode --------------------------------------------------------------------------

    def set_mig_mode(self, gpu: GpuState, mode: int) -> int:
        """Request a MIG mode; returns the activation status NVML reports."""
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if mode == gpu.mig_current:
            changed = gpu.mig_pending != mode
            gpu.mig_pending = mode
            status = pynvml.NVML_SUCCESS
        elif mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gpu_instances:
            fail(pynvml.NVML_ERROR_IN_USE)
        elif self.placed_processes(gpu):
            # The driver cannot unbind a busy GPU: the change stays pending.
            changed = gpu.mig_pending != mode
            gpu.mig_pending = mode
            status = pynvml.NVML_ERROR_IN_USE
        elif self.model.mig_mode_needs_reset:
            changed = gpu.mig_pending != mode
            gpu.mig_pending = mode
            status = pynvml.NVML_SUCCESS
        else:
            changed = True
            gpu.mig_current = gpu.mig_pending = mode
            status = pynvml.NVML_SUCCESS
        if changed:
            self.commit()
        return int(status)

    # -- GPU instances ---------------------------------------------------------------------

    def _used_slices(self, gpu: GpuState) -> list[tuple[int, int]]:
        return [(gi.start, gi.size) for gi in gpu.gpu_instances]

    def _free_starts(self, gpu: GpuState, profile: GiProfile) -> list[int]:
        used = self._used_slices(gpu)
        return [s for s in profile.starts
                if not any(_overlaps(s, profile.size, u, n) for u, n in used)]

    def gi_remaining(self, gpu: GpuState, profile: GiProfile) -> int:
        """How many more instances of ``profile`` fit: free placements that do not overlap
        each other, capped by the profile's instance count."""
        existing = sum(1 for gi in gpu.gpu_instances if gi.profile_id == profile.id)
        fitting, end = 0, -1
        for start in sorted(self._free_starts(gpu, profile)):
            if start >= end:
                fitting, end = fitting + 1, start + profile.size
        return max(0, min(profile.instance_count - existing, fitting))

    def create_gi(self, gpu: GpuState, profile: GiProfile, start: int | None) -> GiState:
        """Create a GPU instance at ``start``, or where driver auto-placement puts it."""
        existing = sum(1 for gi in gpu.gpu_instances if gi.profile_id == profile.id)
        free = self._free_starts(gpu, profile)
        if start is None:
            start = next((s for s in profile.auto_order if s in free), None)
            if start is None:
                fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if existing >= profile.instance_count or start not in free:
            fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = profile.gi_id_at(start)
        taken = {gi.id for gi in gpu.gpu_instances}
        if gi_id in taken:  # cannot happen with the real tables; keep ids unique regardless
            gi_id = min(set(range(len(taken) + 1)) - taken)
        gi = GiState(id=gi_id, profile_id=profile.id, start=start, size=profile.size)
        gpu.gpu_instances.append(gi)
        gpu.gpu_instances.sort(key=lambda g: g.id)
        self.commit()
        self.post_event(gpu, pynvml.nvmlEventMigConfigChange, 0)
        return gi

    def destroy_gi(self, gpu: GpuState, gi: GiState) -> None:
        if gi.compute_instances:
            fail(pynvml.NVML_ERROR_IN_USE)
        gpu.gpu_instances.remove(gi)
        self.commit()
        self.post_event(gpu, pynvml.nvmlEventMigConfigChange, 0)

    # -- compute instances -----------------------------------------------------------------

    def _free_ci_placements(self, gi: GiState, profile: CiProfile) -> list[tuple[int, int]]:
        used = [(ci.start, ci.size) for ci in gi.compute_instances]
        return [p for p in profile.placements
                if not any(_overlaps(p[0], p[1], u, n) for u, n in used)]

    def ci_remaining(self, gi: GiState, profile: CiProfile) -> int:
        existing = sum(1 for ci in gi.compute_instances if ci.profile_id == profile.id)
        fitting, end = 0, -1
        for start, size in sorted(self._free_ci_placements(gi, profile)):
            if start >= end:
                fitting, end = fitting + 1, start + size
        return max(0, min(profile.instance_count - existing, fitting))

    def create_ci(self, gpu: GpuState, gi: GiState, profile: CiProfile,
                  placement: tuple[int, int] | None) -> CiState:
        """Create a compute instance at ``placement`` or at the first free one."""
        existing = sum(1 for ci in gi.compute_instances if ci.profile_id == profile.id)
        free = self._free_ci_placements(gi, profile)
        if placement is None:
            placement = free[0] if free else None
        if existing >= profile.instance_count or placement is None or placement not in free:
            fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        taken = {ci.id for ci in gi.compute_instances}
        ci_id = min(set(range(len(taken) + 1)) - taken)
        self.state.mig_serial += 1
        ci = CiState(id=ci_id, profile_id=profile.id, start=placement[0], size=placement[1],
                     uuid=mig_uuid(gpu.uuid, gi.id, ci_id, self.state.mig_serial))
        gi.compute_instances.append(ci)
        gi.compute_instances.sort(key=lambda c: c.id)
        self.commit()
        self.post_event(gpu, pynvml.nvmlEventMigConfigChange, 0)
        return ci

    def destroy_ci(self, gpu: GpuState, gi: GiState, ci: CiState) -> None:
        if any(p.process.device_uuid == ci.uuid for p in self.placed_processes(gpu)):
            fail(pynvml.NVML_ERROR_IN_USE)
        gi.compute_instances.remove(ci)
        self.commit()
        self.post_event(gpu, pynvml.nvmlEventMigConfigChange, 0)

    # -- resets ----------------------------------------------------------------------------

    def reset(self, gpu: GpuState) -> None:
        """What ``nvidia-smi -r`` does: instances gone, pending MIG mode applied, GPU back."""
        gpu.gpu_instances = []
        gpu.mig_current = gpu.mig_pending
        gpu.lost = False
        gpu.pcie_replays = 0
        gpu.compute_mode = gpu.timeslice = 0
        gpu.mig_compute_modes = {}
        gpu.recovery_action = recovery_action.NONE
        for key in [k for k in self._activity if k[0] == gpu.index]:
            del self._activity[key]

    def reload_driver(self) -> None:
        """Unload and load the kernel driver: every GPU reset; Hopper forgets MIG mode; the
        energy counters start again from zero (NVML counts them since the driver loaded). The
        kernel's boot id stays: only a reboot (:meth:`reboot`) changes it."""
        now = time.time()
        for gpu in self.state.gpus:
            self.reset(gpu)
            if not self.model.mig_mode_survives_reload:
                gpu.mig_current = gpu.mig_pending = pynvml.NVML_DEVICE_MIG_DISABLE
            gpu.energy_mj, gpu.energy_at = 0, now

    def reboot(self) -> None:
        """The node boots again: the driver loads afresh and the kernel has a new boot id."""
        self.reload_driver()
        self.state.boot_id = str(uuid.uuid4())

    # -- events ----------------------------------------------------------------------------

    def supported_events(self) -> int:
        events = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
                  | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypePState)
        if self.model.mig_capable:
            events |= pynvml.nvmlEventMigConfigChange
        if self.preset.driver.recovery_action:
            events |= pynvml.nvmlEventTypeGpuRecoveryAction
        return int(events)

    def set_recovery_action(self, gpu: GpuState, action: int) -> None:
        """The driver's new recovery action for a GPU; a change is saved and posted as an
        ``nvmlEventTypeGpuRecoveryAction`` event (its data the new action), which is when a
        real driver logs XID 154 ("GPU recovery action changed")."""
        if action == gpu.recovery_action or not self.preset.driver.recovery_action:
            return
        gpu.recovery_action = action
        self.commit()
        self.post_event(gpu, pynvml.nvmlEventTypeGpuRecoveryAction, action)

    def post_event(self, gpu: GpuState, event_type: int, data: int, *,
                   gi_id: int = NO_INSTANCE, ci_id: int = NO_INSTANCE) -> None:
        """Queue an event on every set registered for this type on this GPU, and wake waiters."""
        event = Event(gpu.index, event_type, data, gi_id, ci_id)
        for event_set in self.event_sets:
            if event_set.registrations.get(gpu.index, 0) & event_type:
                event_set.queue.append(event)
        self.changed.notify_all()

    def wait_event(self, event_set: EventSet, timeout_s: float) -> Event | None:
        """The oldest queued event, waiting up to ``timeout_s`` (the lock is released while
        waiting); None on timeout or if the set is freed meanwhile."""
        deadline = time.monotonic() + timeout_s
        self.event_waiters += 1
        try:
            while not event_set.queue and not event_set.freed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
        finally:
            self.event_waiters -= 1
        return event_set.queue.popleft() if event_set.queue else None

    def describe_gpus(self) -> list[dict[str, Any]]:
        return [{
            "index": g.index, "uuid": g.uuid, "bus_id": self.bus_id(g),
            "mig_mode": {"current": g.mig_current, "pending": g.mig_pending}
            if self.model.mig_capable else None,
            "lost": g.lost,
            "recovery_action": recovery_action.action_name(g.recovery_action)
            if self.preset.driver.recovery_action else None,
            "compute_mode": COMPUTE_MODE_NAMES.get(g.compute_mode, str(g.compute_mode)),
            "timeslice": g.timeslice,
            "fabric": g.fabric if self.preset.fabric_capable else None,
            "mig_devices": [{"uuid": ci.uuid, "gi_id": gi.id, "ci_id": ci.id,
                             "compute_mode": COMPUTE_MODE_NAMES.get(
                                 self.compute_mode(g, ci), "DEFAULT"),
                             "gi_profile_id": gi.profile_id, "ci_profile_id": ci.profile_id,
                             "placement": {"start": gi.start, "size": gi.size}}
                            for gi, ci in self.mig_devices(g)],
            "gpu_instances_without_ci": [gi.id for gi in g.gpu_instances
                                         if not gi.compute_instances],
        } for g in self.state.gpus]
