"""The CDI specs the agent maintains: one transient spec per prepared claim and the node-wide
spec naming every device by index and UUID. Derived state: rebuilt at start-up from the
checkpoint and the hardware, rewritten after every MIG change."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.claims.checkpoint import PreparedDevice
from agent.durable import ExclusiveLock, write_atomic
from agent.errors import AgentError, StateLocked
from agent.gpu.types import Gpu
from cdi.build import CLAIM_KIND, NODE_KIND, NamedEdits, build_spec, claim_device
from cdi.names import qualified, spec_file_name, transient_file_name
from cdi.nvidia import (
    DriverFiles,
    HostDevices,
    common_edits,
    gpu_edits,
    imex_channel_edits,
    mig_edits,
    parse_mig_minors,
    parse_proc_devices,
)
from cdi.spec import ContainerEdits, Mount
from cdi.store import SpecStore

log = logging.getLogger("agent.claims.cdi")
_LIBRARIES = ("libcuda.so.*", "libnvidia-ml.so.*", "libnvidia-ptxjitcompiler.so.*",
              "libnvidia-nvvm.so.*", "libcudadebugger.so.*")
_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "lib/x86_64-linux-gnu", "usr/lib")
_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced")
#: Devices whose edits are kept (a node has at most a few hundred GPU and MIG minors).
_EDITS_CACHED = 4096


#: Where a container's CUDA clients find the claim's MPS daemon (NVIDIA's default path, so a
#: client that sets nothing itself still reaches it).
MPS_PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
_MPS_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")


def with_mps(edits: ContainerEdits, root: Path) -> ContainerEdits:
    """A device's edits plus what its MPS clients need, as NVIDIA's driver gives them: the
    pipe directory's environment variable and bind mounts of ``<root>/pipe`` and
    ``<root>/shm`` (MPS clients share pinned host memory through ``/dev/shm``)."""
    mounts = (Mount(host_path=str(root / "pipe"), container_path=MPS_PIPE_IN_CONTAINER,
                    options=_MPS_MOUNT_OPTIONS),
              Mount(host_path=str(root / "shm"), container_path="/dev/shm",
                    options=_MPS_MOUNT_OPTIONS))
    return edits.model_copy(update={
        "env": (*(edits.env or ()), f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_IN_CONTAINER}"),
        "mounts": (*(edits.mounts or ()), *mounts)})


def read_host_devices(proc_root: Path) -> HostDevices:
    """Device majors and MIG capability minors from ``/proc`` (or the simulator's)."""
    def read(rel: str) -> str:
        try:
            return (proc_root / rel).read_text()
        except OSError:
            return ""
    return HostDevices(majors=parse_proc_devices(read("devices")),
                       mig_minors=parse_mig_minors(read("driver/nvidia-caps/mig-minors")))


def find_driver_files(driver_root: Path) -> DriverFiles:
    """The versioned driver libraries and binaries under a driver root, to bind-mount."""
    libraries: list[Path] = []
    for lib_dir in _LIB_DIRS:
        for pattern in _LIBRARIES:
            libraries += sorted((driver_root / lib_dir).glob(pattern))
    binaries = [p for name in _BINARIES for p in (driver_root / "usr/bin" / name,) if p.exists()]
    return DriverFiles(libraries=tuple(p for p in libraries if not p.is_symlink()),
                       binaries=tuple(binaries))


def agent_id(state_dir: Path) -> str:
    """This agent's id, kept in its state directory (made on first use): the owner its CDI
    specs are marked with, so another agent sharing the spec directory leaves them alone."""
    path = state_dir / "agent.id"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if text:
        return text
    made = f"gpu-agent-{secrets.token_hex(8)}"
    try:
        write_atomic(path, f"{made}\n".encode(), mode=0o644)
    except OSError:
        # A full state directory must not stop the agent; an id derived from the directory
        # still tells this agent's specs from another's, and is written at a later start.
        return f"gpu-agent-{hashlib.sha256(str(state_dir.absolute()).encode()).hexdigest()[:16]}"
    return made


class CdiDirectoryLock:
    """One live agent per CDI directory: an ``flock`` on ``.gpu-agent.lock`` in it, held for
    the agent's life. A second agent on the same ``--cdi-dir`` (with another state directory)
    would remove the first one's specs as stale; it is refused at start instead."""

    def __init__(self, spec_dir: Path, state_dir: Path) -> None:
        self._lock = ExclusiveLock(spec_dir / ".gpu-agent.lock")
        self._spec_dir = spec_dir
        self._state_dir = state_dir

    def acquire(self) -> None:
        """Take the lock or raise :class:`AgentError` naming the other agent."""
        try:
            self._lock.acquire()
        except StateLocked as err:
            raise AgentError(
                f"--cdi-dir {self._spec_dir} is in use by another running gpu-agent (pid "
                f"{err.holder_pid}); each agent needs its own CDI directory, or stop "
                f"the other agent first (this one's state directory is {self._state_dir})"
            ) from err

    def release(self) -> None:
        self._lock.release()


def default_dev_root(driver_root: Path | None) -> Path:
    """Where the driver's device nodes are when nobody says: under the driver root when it
    has them (a driver container's root with its own ``dev/nvidiactl``), else the host's
    ``/`` (as NVIDIA's tools decide)."""
    if driver_root is not None and (driver_root / "dev" / "nvidiactl").exists():
        return driver_root
    return Path("/")


class CdiWriter:
    def __init__(self, spec_dir: Path, proc_root: Path, driver_root: Path | None = None, *,
                 owner: str | None = None, dev_root: Path | None = None) -> None:
        """``owner`` marks every spec written and limits removal to specs with that mark (or
        none); without it the writer treats every spec of its kinds as its own. ``dev_root``
        is where the nodes a spec names are looked for (``<dev_root>/dev/nvidia0``)."""
        self.store = SpecStore(spec_dir, (NODE_KIND, CLAIM_KIND), owner=owner)
        self._proc_root = proc_root
        self._driver_root = driver_root
        self.dev_root = dev_root if dev_root is not None else default_dev_root(driver_root)
        self._dev_prefix = str(self.dev_root).rstrip("/")
        self._host: HostDevices | None = None
        # Edits are a function of the host facts (read once, above) and the device's minors:
        # built once per device and reused, as every prepare builds them twice (its device
        # nodes, then its spec). The common edits are cached only without a driver root,
        # whose files may change under a running agent.
        self._edits: dict[tuple[int, int, int], ContainerEdits] = {}
        self._common_edits: ContainerEdits | None = None

    @property
    def host(self) -> HostDevices:
        if self._host is None:
            self._host = read_host_devices(self._proc_root)
        return self._host

    def _nodes_and_env(self) -> ContainerEdits:
        """The common edits without the driver's files."""
        if self._common_edits is None:
            self._common_edits = common_edits(self.host)
        return self._common_edits

    def _common(self) -> ContainerEdits:
        if self._driver_root is not None:
            return common_edits(self.host, find_driver_files(self._driver_root))
        return self._nodes_and_env()

    def device_edits(self, device: PreparedDevice, parent_minor: int) -> ContainerEdits:
        if device.kind == "gpu":
            key = (parent_minor, -1, -1)
        else:
            assert device.gi_id is not None and device.ci_id is not None
            key = (parent_minor, device.gi_id, device.ci_id)
        edits = self._edits.get(key)
        if edits is None:
            edits = gpu_edits(parent_minor) if key[1] < 0 else \
                mig_edits(self.host, parent_minor, key[1], key[2])
            if len(self._edits) < _EDITS_CACHED:
                self._edits[key] = edits
        return edits

    def channel_edits(self, channel: int) -> ContainerEdits:
        """An IMEX channel's device node (:class:`HostFactsError` when ``/proc/devices``
        lists no IMEX channel major)."""
        return imex_channel_edits(self.host, channel)

    def device_nodes(self, devices: Sequence[tuple[PreparedDevice, int]]) -> list[str]:
        """The device node paths of a claim's spec that must exist on the host before it is
        answered: the GPUs' and the common ones (control, UVM), the nodes the driver makes
        when it is ready. MIG capability nodes are left out: hosts create them on demand
        (nvidia-modprobe), and the spec gives their type, major and minor, so a runtime
        makes them in the container without a host node."""
        edits = [self.device_edits(d, minor) for d, minor in devices]
        edits.append(self._nodes_and_env())
        return list(dict.fromkeys(n.path for e in edits for n in e.device_nodes or ()
                                  if not n.path.startswith("/dev/nvidia-caps/")))

    def missing_nodes(self, paths: Sequence[str]) -> list[str]:
        """The paths among ``paths`` with no node under the device root yet."""
        return [p for p in paths if not os.path.exists(f"{self._dev_prefix}/{p.lstrip('/')}")]

    def write_claim(self, uid: str, devices: Sequence[tuple[PreparedDevice, int]], *,
                    mps_roots: Mapping[str, Path] | None = None,
                    channels: Sequence[tuple[str, int]] = ()) -> Path:
        """The claim's transient spec (``k8s.gpu.nodeagent.dev-claim_<uid>.json``); a device
        under one of the claim's MPS daemons (``mps_roots``: each daemon's directory by device
        UUID) also gets that daemon's pipe and shm directories; ``channels`` are the claim's
        IMEX channels (device name, channel number)."""
        def edits(device: PreparedDevice, minor: int) -> ContainerEdits:
            own = self.device_edits(device, minor)
            state = device.sharing_state
            root = (mps_roots or {}).get(device.uuid or device.gpu)
            if root is None or state is None or state.strategy != "MPS":
                return own
            return with_mps(own, root)
        spec = build_spec(CLAIM_KIND, [
            NamedEdits((claim_device(uid, d.device_name),), edits(d, minor))
            for d, minor in devices] + [
            NamedEdits((claim_device(uid, name),), self.channel_edits(channel))
            for name, channel in channels], self._common())
        return self.store.write(spec, spec_id=uid)

    @staticmethod
    def qualified_name(uid: str, device_name: str) -> str:
        return qualified(CLAIM_KIND, claim_device(uid, device_name))

    def claim_path(self, uid: str) -> Path:
        return self.store.directory / transient_file_name(CLAIM_KIND, uid)

    def claim_specs(self) -> list[Path]:
        """Every claim spec file in the directory (ours, by kind)."""
        prefix = transient_file_name(CLAIM_KIND, "x")[: -len("x.json")]
        return [p for p in self.store.owned() if p.name.startswith(prefix)]

    def write_node(self, gpus: Sequence[Gpu]) -> Path | None:
        """Every device by index and UUID, MIG devices as ``<gpu>:<mig>`` and ``MIG-<uuid>``,
        and ``all``; MIG-enabled GPUs get no full-GPU entry (as nvidia-ctk does)."""
        devices: list[NamedEdits] = []
        for gpu in gpus:
            if not gpu.health.healthy and gpu.static.minor < 0:
                continue
            if gpu.mig_mode is not None and gpu.mig_mode.current:
                devices += [NamedEdits((f"{gpu.index}:{d.index}", d.uuid), mig_edits(
                    self.host, gpu.static.minor, d.gi_id, d.ci_id)) for d in gpu.mig_devices]
            else:
                devices.append(NamedEdits((str(gpu.index), gpu.uuid),
                                          gpu_edits(gpu.static.minor)))
        path = self.store.directory / spec_file_name(NODE_KIND)
        if not devices:
            self.store.remove(path)
            return None
        return self.store.write(build_spec(NODE_KIND, devices, self._common(), with_all=True))
