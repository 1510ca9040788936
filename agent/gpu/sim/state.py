"""The simulated node's hardware state, and its file ``<state_dir>/sim/hardware.json``.

What survives a restart of the agent (and of the simulator with it) is what survives one on a
real node: GPUs, MIG modes, GPU and compute instances, running processes, lost GPUs and their
recovery actions, compute modes and time slices, MPS control daemons (they outlive the agent)
and their servers. Faults, latencies and call counters are runtime-only and live elsewhere.

The file is a durable envelope (:mod:`agent.durable`); files from before it (one JSON
document with an optional ``sha256``) are still read. Downgrade: a simulator from before the
envelope refuses the file once and keeps it aside; its next start makes a fresh node.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from agent.durable import (
    Envelope,
    FileKind,
    Unreadable,
    document_digest,
    dump_payload,
    keep_aside,
    read_durable,
    write_durable,
)
from agent.errors import AgentError, InvalidRequest
from agent.gpu.sim.naming import gpu_uuid
from agent.gpu.sim.presets import Preset

SCHEMA_VERSION = 1
log = logging.getLogger("agent.gpu.sim")


class SimulatorStateError(AgentError):
    """The simulator's state file cannot be used (corrupt, or written by a newer version):
    ``path`` is the file, ``kept_as`` where a corrupt one was moved aside."""

    def __init__(self, detail: str, *, path: str | None = None,
                 kept_as: str | None = None) -> None:
        super().__init__(detail)
        self.path = path
        self.kept_as = kept_as

    def _fields(self) -> dict[str, Any]:
        return {"path": self.path, "kept_as": self.kept_as}


# eq=False everywhere: instances are identified by identity (the NVML facade maps handles to
# them), and two equal-looking GIs on different GPUs are different objects.
@dataclass(eq=False)
class CiState:
    id: int
    profile_id: int
    start: int
    size: int
    uuid: str


@dataclass(eq=False)
class GiState:
    id: int
    profile_id: int
    start: int
    size: int
    compute_instances: list[CiState] = field(default_factory=list)


@dataclass(eq=False)
class GpuState:
    index: int
    uuid: str
    mig_current: int = 0
    mig_pending: int = 0
    lost: bool = False
    gpu_instances: list[GiState] = field(default_factory=list)
    energy_mj: int = 0
    """Energy counter value at ``energy_at`` (wall-clock seconds); power is constant between
    two load changes, so the counter is this plus power times elapsed time."""
    energy_at: float = 0.0
    pcie_replays: int = 0
    """PCIe replays since the driver loaded (a GPU reset or driver reload clears them)."""
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_failed: bool = False
    """Row-remapping state, kept in the InfoROM on real boards: it survives everything."""
    compute_mode: int = 0
    """NVML compute mode (``nvidia-smi -c``); a GPU reset or driver reload sets DEFAULT."""
    timeslice: int = 0
    """``nvidia-smi compute-policy --set-timeslice`` value (0 Default .. 3 Long)."""
    mig_compute_modes: dict[str, int] = field(default_factory=dict)
    """MIG device UUID -> compute mode: with MIG on, the mode is a MIG device's own."""
    recovery_action: int = 0
    """NVML's recovery action (``nvmlDeviceGpuRecoveryAction_t``), kept by the driver: it
    outlives the agent, and a GPU reset or driver reload sets NONE."""
    fabric: str = "completed"
    """The GPU's multi-node NVLink condition (:data:`agent.gpu.sim.links.FABRIC_CONDITIONS`),
    set by the fabric fault control; it stays until set again."""
    fabric_status: int = 0
    """The NVML return code a ``failed`` fabric reports as its status."""


@dataclass(eq=False)
class ProcessState:
    pid: int
    device_uuid: str
    """GPU UUID (MIG off) or MIG device UUID the process runs on."""
    used_memory_mib: int
    mps_server: int | None = None
    """The pid of the MPS server this process is a client of (None: a plain process)."""


@dataclass(eq=False)
class MpsDaemonState:
    """A running simulated ``nvidia-cuda-mps-control -d`` as the driver knows it."""

    pid: int
    start_time: str
    """The process's start time (``/proc/<pid>/stat``), so a reused pid is not taken for it."""
    pipe_directory: str
    log_directory: str
    devices: list[str]
    active_thread_percentage: int | None = None
    pinned_limits_mib: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class MpsServerState:
    """An MPS server a daemon started for one user ID, with the defaults it started with."""

    pid: int
    daemon_pid: int
    uid: int
    devices: list[str]
    active_thread_percentage: int
    pinned_limits_mib: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class HardwareState:
    preset: str
    seed: str
    boot_id: str
    gpus: list[GpuState]
    processes: list[ProcessState] = field(default_factory=list)
    mig_serial: int = 0
    """Counts compute instances ever created, so a re-created one gets a new MIG UUID."""
    mps_daemons: list[MpsDaemonState] = field(default_factory=list)
    mps_servers: list[MpsServerState] = field(default_factory=list)

    @classmethod
    def new(cls, preset: Preset) -> HardwareState:
        """A freshly installed node: new seed (so its UUIDs are its own), MIG off everywhere."""
        seed = secrets.token_hex(8)
        now = time.time()
        return cls(preset=preset.name, seed=seed, boot_id=str(uuid.uuid4()),
                   gpus=[GpuState(index=i, uuid=gpu_uuid(preset.name, seed, i), energy_at=now)
                         for i in range(preset.gpu_count)])

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "preset": self.preset,
            "seed": self.seed,
            "boot_id": self.boot_id,
            "mig_serial": self.mig_serial,
            "gpus": [{
                "index": g.index,
                "mig_current": g.mig_current,
                "mig_pending": g.mig_pending,
                "lost": g.lost,
                "energy_mj": g.energy_mj,
                "energy_at": g.energy_at,
                "pcie_replays": g.pcie_replays,
                "remapped_rows": {"correctable": g.remapped_correctable,
                                  "uncorrectable": g.remapped_uncorrectable,
                                  "failed": g.remap_failed},
                "compute_mode": g.compute_mode,
                "timeslice": g.timeslice,
                "mig_compute_modes": dict(g.mig_compute_modes),
                "recovery_action": g.recovery_action,
                "fabric": {"condition": g.fabric, "status": g.fabric_status},
                "gpu_instances": [{
                    "id": gi.id, "profile_id": gi.profile_id, "start": gi.start,
                    "size": gi.size,
                    "compute_instances": [{
                        "id": ci.id, "profile_id": ci.profile_id, "start": ci.start,
                        "size": ci.size, "uuid": ci.uuid,
                    } for ci in gi.compute_instances],
                } for gi in g.gpu_instances],
            } for g in self.gpus],
            "processes": [{"pid": p.pid, "device_uuid": p.device_uuid,
                           "used_memory_mib": p.used_memory_mib,
                           **({"mps_server": p.mps_server} if p.mps_server is not None
                              else {})} for p in self.processes],
            "mps_daemons": [{
                "pid": d.pid, "start_time": d.start_time, "pipe_directory": d.pipe_directory,
                "log_directory": d.log_directory, "devices": list(d.devices),
                "active_thread_percentage": d.active_thread_percentage,
                "pinned_limits_mib": dict(d.pinned_limits_mib),
            } for d in self.mps_daemons],
            "mps_servers": [{
                "pid": v.pid, "daemon_pid": v.daemon_pid, "uid": v.uid,
                "devices": list(v.devices),
                "active_thread_percentage": v.active_thread_percentage,
                "pinned_limits_mib": dict(v.pinned_limits_mib),
            } for v in self.mps_servers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HardwareState:
        """Parse (unknown fields ignored); KeyError/TypeError/ValueError on a bad document."""
        preset, seed = str(data["preset"]), str(data["seed"])
        gpus = [GpuState(
            index=int(g["index"]), uuid=gpu_uuid(preset, seed, int(g["index"])),
            mig_current=int(g["mig_current"]), mig_pending=int(g["mig_pending"]),
            lost=bool(g["lost"]), energy_mj=int(g.get("energy_mj", 0)),
            energy_at=float(g.get("energy_at", time.time())),
            pcie_replays=int(g.get("pcie_replays", 0)),
            remapped_correctable=int(g.get("remapped_rows", {}).get("correctable", 0)),
            remapped_uncorrectable=int(g.get("remapped_rows", {}).get("uncorrectable", 0)),
            remap_failed=bool(g.get("remapped_rows", {}).get("failed", False)),
            compute_mode=int(g.get("compute_mode", 0)),
            timeslice=int(g.get("timeslice", 0)),
            mig_compute_modes={str(k): int(v)
                               for k, v in dict(g.get("mig_compute_modes", {})).items()},
            recovery_action=int(g.get("recovery_action", 0)),
            fabric=str(g.get("fabric", {}).get("condition", "completed")),
            fabric_status=int(g.get("fabric", {}).get("status", 0)),
            gpu_instances=[GiState(
                id=int(gi["id"]), profile_id=int(gi["profile_id"]), start=int(gi["start"]),
                size=int(gi["size"]),
                compute_instances=[CiState(
                    id=int(ci["id"]), profile_id=int(ci["profile_id"]), start=int(ci["start"]),
                    size=int(ci["size"]), uuid=str(ci["uuid"]),
                ) for ci in gi["compute_instances"]],
            ) for gi in g["gpu_instances"]],
        ) for g in data["gpus"]]
        return cls(preset=preset, seed=seed, boot_id=str(data["boot_id"]), gpus=gpus,
                   processes=[ProcessState(
                       pid=int(p["pid"]), device_uuid=str(p["device_uuid"]),
                       used_memory_mib=int(p["used_memory_mib"]),
                       mps_server=None if p.get("mps_server") is None
                       else int(p["mps_server"])) for p in data["processes"]],
                   mig_serial=int(data.get("mig_serial", 0)),
                   mps_daemons=[MpsDaemonState(
                       pid=int(d["pid"]), start_time=str(d["start_time"]),
                       pipe_directory=str(d["pipe_directory"]),
                       log_directory=str(d["log_directory"]),
                       devices=[str(x) for x in d["devices"]],
                       active_thread_percentage=None if d.get("active_thread_percentage")
                       is None else int(d["active_thread_percentage"]),
                       pinned_limits_mib={str(k): int(v) for k, v
                                          in dict(d.get("pinned_limits_mib", {})).items()},
                   ) for d in data.get("mps_daemons", [])],
                   mps_servers=[MpsServerState(
                       pid=int(v["pid"]), daemon_pid=int(v["daemon_pid"]), uid=int(v["uid"]),
                       devices=[str(x) for x in v["devices"]],
                       active_thread_percentage=int(v["active_thread_percentage"]),
                       pinned_limits_mib={str(k): int(n) for k, n
                                          in dict(v.get("pinned_limits_mib", {})).items()},
                   ) for v in data.get("mps_servers", [])])


def check_consistent(state: HardwareState, preset: Preset) -> None:
    """Raise ValueError unless the state could exist on this preset's hardware."""
    model = preset.gpu
    if [g.index for g in state.gpus] != list(range(preset.gpu_count)):
        raise ValueError(f"expected GPUs 0-{preset.gpu_count - 1}")
    devices: set[str] = set()
    for gpu in state.gpus:
        devices.add(gpu.uuid)
        if gpu.mig_current not in (0, 1) or gpu.mig_pending not in (0, 1):
            raise ValueError(f"GPU {gpu.index}: bad MIG mode")
        if gpu.gpu_instances and not gpu.mig_current:
            raise ValueError(f"GPU {gpu.index}: GPU instances with MIG disabled")
        used: set[int] = set()
        for gi in gpu.gpu_instances:
            profile = model.gi_profile(gi.profile_id)
            if profile is None or gi.start not in profile.starts or gi.size != profile.size:
                raise ValueError(f"GPU {gpu.index}: bad GPU instance {gi.id}")
            slots = set(range(gi.start, gi.start + gi.size))
            if used & slots:
                raise ValueError(f"GPU {gpu.index}: overlapping GPU instances")
            used |= slots
            ci_used: set[int] = set()
            for ci in gi.compute_instances:
                ci_profile = model.ci_profile(profile, ci.profile_id)
                if ci_profile is None or (ci.start, ci.size) not in ci_profile.placements:
                    raise ValueError(f"GPU {gpu.index}: bad compute instance {gi.id}/{ci.id}")
                ci_slots = set(range(ci.start, ci.start + ci.size))
                if ci_used & ci_slots:
                    raise ValueError(f"GPU {gpu.index}: overlapping compute instances")
                ci_used |= ci_slots
                devices.add(ci.uuid)
    pids = [p.pid for p in state.processes]
    if len(pids) != len(set(pids)):
        raise ValueError("duplicate process ids")
    for process in state.processes:
        if process.device_uuid not in devices:
            raise ValueError(f"process {process.pid} on unknown device {process.device_uuid}")


def _legacy_state(document: Any) -> Any:
    """A state file from before the envelope: the document with an optional ``sha256``."""
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if "sha256" in document and document["sha256"] != document_digest(document):
        raise ValueError("checksum mismatch")
    return {k: v for k, v in document.items() if k != "sha256"}


KIND = FileKind("gpu-agent-sim-hardware", SCHEMA_VERSION, legacy=_legacy_state)


def _parse(envelope: Envelope) -> HardwareState:
    data = envelope.payload
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ValueError("not a JSON object with a schema_version")
    if data["schema_version"] > SCHEMA_VERSION:
        # Read, not refused: a newer simulator only adds fields (the payload parser ignores
        # them), so going back a version keeps the node's GPUs and instances.
        log.warning("simulator state written by a newer version; unknown fields ignored",
                    extra={"schema_version": data["schema_version"], "reads": SCHEMA_VERSION})
    return HardwareState.from_json(data)


class StateFile:
    """``hardware.json``: read once at start, replaced atomically after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, preset: Preset) -> HardwareState | None:
        """The saved state, or None if there is none yet. A file that cannot be parsed, a
        path that is not a file, or a state that does not fit the preset's hardware is kept
        aside and reported, never started over."""
        try:
            state = read_durable(self.path, KIND, _parse)
        except Unreadable as err:
            self._corrupt(err.reason, err.kept_at, err)
        if state is None:
            return None
        if state.preset != preset.name:
            raise InvalidRequest(
                f"state directory {self.path.parent.parent} holds a simulated {state.preset!r} "
                f"node, not {preset.name!r}; use --simulate {state.preset} or another state "
                "directory", errors=[{"field": "preset", "reason": f"this state directory "
                                      f"is a {state.preset!r} node"}])
        try:
            check_consistent(state, preset)
        except ValueError as err:
            try:
                kept: Path | None = keep_aside(self.path, "unreadable")
            except OSError:
                kept = None
            self._corrupt(f"ValueError: {err}", kept, err)
        return state

    def save(self, state: HardwareState) -> None:
        """Replace the file durably (blocks on fsync; the simulator's NVML calls run in the
        session's threads)."""
        write_durable(self.path, KIND, dump_payload(state.to_json()) + b"\n")

    def _corrupt(self, reason: str, kept: Path | None, err: Exception) -> NoReturn:
        where = (f"it was kept aside as {kept.name}. Inspect it, then remove it"
                 if kept is not None else "it could not be moved aside. Move it away")
        raise SimulatorStateError(
            f"simulator state {self.path} is unusable ({reason}); {where} to start a fresh "
            "simulated node (new GPU UUIDs).", path=str(self.path),
            kept_as=str(kept) if kept else None) from err
