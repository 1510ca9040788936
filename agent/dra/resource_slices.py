"""This node's devices as ``resource.k8s.io/v1`` ResourceSlices (pure: values in, dicts out).

Names, shapes and attribute values follow NVIDIA's DRA driver (``reference/dra-driver.md`` 3)
with the project's driver name, so a selector copied from NVIDIA's documentation matches once
the driver name is replaced: full GPUs ``gpu-<minor>``, MIG devices ``gpu-<minor>-mig-
<profile>-<profile id>-<start>`` (``agent/device_names.py``, the names the claims API
accepts); ``brand`` and ``architecture`` spelled as NVIDIA's go-nvlib spells them (``Nvidia``,
``Hopper``, ``Ada Lovelace``), mapped here only: the inventory's own values drive the agent's
logic and ``/v1/gpus``. The project adds ``nvlinkIsland``, ``nvlinkBandwidth`` and
``fabricClique`` (the GPU's fabric as last read: only while it is usable, see
``Fabric.clique``); NUMA, PCI bus ID and PCIe root use the standard ``resource.kubernetes.io``
names. Left out: ``addressingMode`` (the inventory does not read it).

Order: the allocator takes the first fit in name order of the slices, then in device order
inside a slice, so slice names carry a zero-padded index and devices go by GPU minor, then
(MIG) by profile and placement start.

Two modes:
- static (default): full GPUs, and the MIG devices that exist (a GPU in MIG mode is published
  as its MIG devices only);
- ``--dynamic-mig`` (partitionable devices, KEP-4815): each MIG-capable GPU gets one counter
  set ``gpu-<minor>-counter-set`` (``multiprocessors``, the engine counters, ``memory`` - each
  the largest any profile has - and ``memory-slice-<i>`` = 1 per memory slice); the full GPU
  consumes all of it and every (profile, placement) is a device consuming its profile's
  amounts and its slices, so the scheduler never books two overlapping placements.
  Kubernetes >= 1.35 wants counters and devices in separate slices (counter slices first,
  then one device slice per GPU); 1.34 wants them together (one slice per GPU).

What each GPU publishes with ``--dynamic-mig``:
- MIG off on Hopper or newer: the full GPU and every placement (the first slice prepared
  switches MIG on, ``agent/mig/devices.py``); MIG off on Ampere, or a mode change pending: the
  full GPU only, without counters (Ampere's mode is never toggled: it needs a reset);
- MIG on: the placements only (a GPU in MIG mode cannot be handed out whole);
- never a placement that overlaps an existing instance of another shape (the instance itself
  is its device), a claim's hold the scheduler may not know of (claims made over REST), or a
  transition's drain or creation mark; a GPU held whole (or with any instance or hold) does
  not publish its full GPU beside, and a GPU held whole publishes nothing but the full GPU.

Shares (``--gpu-shares``, KEP-5075 consumable capacity; refused with ``--dynamic-mig``): every
full GPU with MIG off allows multiple allocations (and carries the attribute ``shareable``:
``true``, which DeviceClass ``share.nodeagent.dev`` selects), and its ``memory`` capacity is the
shareable memory (the total rounded down to whole GiB, ``device_names.shareable_mib``) with a
request policy: a request that names no memory takes all of it (the whole GPU), otherwise
1 GiB steps from 1 GiB up to all of it; the scheduler keeps the sum of a GPU's shares within
its capacity, the agent enforces each with MPS. MIG devices stay exclusive. A GPU under
2 GiB has no valid step (the server wants ``min + step <= value``) and stays exclusive.

Health as device taints (KEP-5055, ``agent/health/taints.py``): devices of a GPU with faults
(XIDs, lost, unmonitored, fabric, quarantined, drained by an operator) stay published and carry
``taints`` (``key``, ``value`` when there is one, ``effect``, ``timeAdded`` in RFC 3339 UTC
seconds): a MIG device its GPU's and its own instance's, a placement without an instance, a
share and a full GPU the GPU's. Kubernetes 1.34 has no ``None`` effect: informational taints
are left out there. At most the version's taints a device (the heaviest kept), and a slice
with a tainted device holds at most 64 devices from 1.35. Whether the API server keeps taints
is the publisher's business (it withdraws blocking-tainted devices where it does not).

Left out everywhere: MIG devices a MIG transition drains or creates; a GPU lost before the
agent started whose device name is not known (NVML gives it no minor).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.device_names import gpu_device_name, mig_device_name, shareable_mib
from agent.dra.rules import rules_for
from agent.gpu.topology import sysfs_bus_id
from agent.gpu.types import DriverInfo, GiProfile, Gpu, Placement
from agent.health.taints import Fault, Taint, device_taints
from agent.mig.mode import switches_mig_on

API_VERSION = "resource.k8s.io/v1"
KUBERNETES_VERSIONS = ((1, 34), (1, 35), (1, 36), (1, 37))
DEFAULT_DRIVER = "gpu.nodeagent.dev"
STANDARD = "resource.kubernetes.io"
#: Devices per slice the API server accepts, and the lower limit once devices consume
#: counters or carry taints (``ResourceSliceMaxDevices[WithTaintsOrConsumesCounters]``).
MAX_DEVICES = 128
MAX_DEVICES_WITH_COUNTERS = 64
#: Counter sets per slice (Kubernetes >= 1.35, ``ResourceSliceMaxCounterSets``).
MAX_COUNTER_SETS = 8
MEMORY_SLICES = 8
#: Digits of a slice's index in its name: name order is index order up to 100,000 slices.
SLICE_INDEX_DIGITS = 5
#: The attribute (bool ``true``) a device open to several allocations (a memory share)
#: carries beside ``allowMultipleAllocations``; absent on every other device.
SHAREABLE_ATTRIBUTE = "shareable"
#: A share's granularity (and its smallest size): 1 GiB.
SHARE_STEP_MIB = 1024
#: The inventory's values as NVIDIA's driver publishes them (go-nvlib's
#: ``GetArchitectureAsString`` / ``GetBrandAsString``); unknown values pass unchanged.
NVIDIA_ARCHITECTURES = {
    "kepler": "Kepler", "maxwell": "Maxwell", "pascal": "Pascal", "volta": "Volta",
    "turing": "Turing", "ampere": "Ampere", "ada": "Ada Lovelace", "hopper": "Hopper",
    "blackwell": "Blackwell", "unknown": "Unknown"}
NVIDIA_BRANDS = {
    "quadro": "Quadro", "tesla": "Tesla", "nvs": "NVS", "grid": "Grid", "geforce": "GeForce",
    "titan": "Titan", "quadro_rtx": "QuadroRTX", "nvidia_rtx": "NvidiaRTX", "nvidia": "Nvidia",
    "geforce_rtx": "GeForceRTX", "titan_rtx": "TitanRTX", "unknown": "Unknown"}

Json = dict[str, Any]


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the renderer sees it: the inventory, what the agent knows besides, and the
    topology attributes."""

    gpu: Gpu
    draining: frozenset[Placement] = frozenset()
    """Placements a MIG transition destroys or is creating: not published."""
    held: frozenset[tuple[str | None, Placement]] = frozenset()
    """(profile, placement) of the claims' holds on MIG devices of this GPU."""
    held_whole: bool = False
    """A claim holds the whole GPU."""
    faults: tuple[Fault, ...] = ()
    """What is wrong with the GPU (the ledger's faults): its devices' taints."""
    nvlink_island: str | None = None
    nvlink_gb_s: int = 0
    pcie_root: str | None = None


@dataclass(frozen=True)
class RenderOptions:
    driver: str
    node_name: str
    kubernetes: tuple[int, int]
    dynamic_mig: bool = False
    gpu_shares: bool = False
    """Full GPUs with MIG off are shareable with a memory request policy (module docstring)."""
    generation: int = 1
    no_execute: bool = False
    """Lost GPUs and reboot-class faults taint ``NoExecute`` (``--no-execute-taints``)."""


def semver(text: str) -> str | None:
    """A version as semver 2.0.0 wants it: three numeric parts without leading zeros
    (``9.0`` -> ``9.0.0``, ``535.104.05`` -> ``535.104.5``); None if it has no number."""
    parts = re.findall(r"\d+", text)
    if not parts:
        return None
    numbers = [str(int(p)) for p in parts[:3]]
    numbers += ["0"] * (3 - len(numbers))
    return ".".join(numbers)


def _attr(value: str | int | bool, kind: str | None = None) -> Json:
    if kind == "version":
        return {"version": value}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _qty(value: int) -> Json:
    return {"value": str(value)}


def _mib(value: int) -> str:
    return f"{value}Mi"


_WEIGHT = {"NoExecute": 2, "NoSchedule": 1, "None": 0}


def rfc3339(epoch_s: float) -> str:
    """A time as Kubernetes writes ``metav1.Time``: UTC, whole seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def taint_json(taint: Taint) -> Json:
    """A taint as a ResourceSlice device carries it (``value`` only when there is one)."""
    doc: Json = {"key": taint.key, "effect": taint.effect, "timeAdded": rfc3339(taint.time_added)}
    if taint.value is not None:
        doc["value"] = taint.value
    return doc


def published_taints(taints: Sequence[Taint], kubernetes: tuple[int, int]) -> list[Json]:
    """The taints a device is published with for ``kubernetes``: without the ``None``
    effect before 1.35, at most the version's limit (the heaviest kept), in key order."""
    rules = rules_for(kubernetes)
    kept = [t for t in taints if t.effect in rules.taint_effects]
    if len(kept) > rules.max_taints:
        kept = sorted(kept, key=lambda t: -_WEIGHT[t.effect])[:rules.max_taints]
    return [taint_json(t) for t in sorted(kept, key=lambda t: t.key)]


def _tainted(device: Json, facts: GpuFacts, options: RenderOptions,
             instance: tuple[int, int | None] | None = None) -> Json:
    """``device`` with the taints of the GPU's faults that reach it (none: unchanged)."""
    taints = published_taints(device_taints(facts.faults, driver=options.driver,
                                            no_execute=options.no_execute, instance=instance),
                              options.kubernetes)
    return {**device, "taints": taints} if taints else device


def _gpu_attributes(facts: GpuFacts, driver: DriverInfo) -> Json:
    """Attributes a GPU's devices share (a MIG device carries its parent's)."""
    s = facts.gpu.static
    attrs: Json = {
        "productName": _attr(s.name[:64]),
        "brand": _attr(NVIDIA_BRANDS.get(s.brand, s.brand)),
        "architecture": _attr(NVIDIA_ARCHITECTURES.get(s.architecture, s.architecture)),
    }
    for name, text in (("cudaComputeCapability", s.cuda_compute_capability),
                       ("driverVersion", driver.driver_version),
                       ("cudaDriverVersion", driver.cuda_driver_version)):
        version = semver(text)
        if version is not None:
            attrs[name] = _attr(version, "version")
    if s.pci_bus_id:
        attrs[f"{STANDARD}/pciBusID"] = _attr(sysfs_bus_id(s.pci_bus_id))
    if facts.pcie_root:
        attrs[f"{STANDARD}/pcieRoot"] = _attr(facts.pcie_root)
    if s.numa_node is not None:
        attrs[f"{STANDARD}/numaNode"] = _attr(s.numa_node)
    if facts.nvlink_island:
        attrs["nvlinkIsland"] = _attr(facts.nvlink_island)
    attrs["nvlinkBandwidth"] = _attr(facts.nvlink_gb_s)
    # The fabric as last read, not as at start-up: a GPU whose registration is not done (or
    # failed) has no clique, so no claim matching on one can land on it.
    clique = facts.gpu.fabric.clique if facts.gpu.fabric else None
    if clique:
        attrs["fabricClique"] = _attr(clique[:64])
    return attrs


def _profile_capacity(profile: GiProfile, placement: Placement, *,
                      multiprocessors: int | None = None) -> Json:
    capacity: Json = {
        "multiprocessors": _qty(profile.multiprocessors if multiprocessors is None
                                else multiprocessors),
        "copyEngines": _qty(profile.copy_engines),
        "decoders": _qty(profile.decoders),
        "encoders": _qty(profile.encoders),
        "jpegEngines": _qty(profile.jpeg_engines),
        "ofaEngines": _qty(profile.ofa_engines),
        "memory": {"value": _mib(profile.memory_mib)},
    }
    for i in range(placement.start, placement.end):
        capacity[f"memorySlice{i}"] = _qty(1)
    return capacity


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def counters_of(profiles: Sequence[GiProfile]) -> dict[str, int]:
    """A GPU's shared counters: the per-dimension maximum over its profiles (memory in MiB),
    and one counter per memory slice."""
    counters = {
        "multiprocessors": max(p.multiprocessors for p in profiles),
        "copy-engines": max(p.copy_engines for p in profiles),
        "decoders": max(p.decoders for p in profiles),
        "encoders": max(p.encoders for p in profiles),
        "jpeg-engines": max(p.jpeg_engines for p in profiles),
        "ofa-engines": max(p.ofa_engines for p in profiles),
        "memory": max(p.memory_mib for p in profiles),
    }
    counters.update({f"memory-slice-{i}": 1 for i in range(MEMORY_SLICES)})
    return counters


def consumption_of(profile: GiProfile, placement: Placement) -> dict[str, int]:
    """What one (profile, placement) device takes from its GPU's counters."""
    used = {
        "multiprocessors": profile.multiprocessors,
        "copy-engines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpeg-engines": profile.jpeg_engines,
        "ofa-engines": profile.ofa_engines,
        "memory": profile.memory_mib,
    }
    used.update({f"memory-slice-{i}": 1 for i in range(placement.start, placement.end)})
    return used


def _counters_json(values: dict[str, int]) -> Json:
    return {name: {"value": _mib(v) if name == "memory" else str(v)}
            for name, v in values.items()}


def _shareable(device: Json, total_mib: int) -> Json:
    """``device`` (a full GPU) open to several allocations, each a whole number of GiB of
    its shareable memory; unchanged when that is under two steps."""
    shareable = shareable_mib(total_mib)
    if shareable < 2 * SHARE_STEP_MIB:
        return device
    # Whole GiB, spelled as the server writes them back.
    whole = f"{shareable // 1024}Gi"
    step = f"{SHARE_STEP_MIB // 1024}Gi"
    # ``allowMultipleAllocations`` is a device field CEL sees only where consumable capacity
    # is on (a DeviceClass naming it is refused elsewhere), so the attribute is what the
    # shipped share.nodeagent.dev class selects on; the publisher drops both together.
    return {**device, "allowMultipleAllocations": True,
            "attributes": {**device["attributes"], SHAREABLE_ATTRIBUTE: _attr(True)},
            "capacity": {**device["capacity"], "memory": {
                "value": whole,
                "requestPolicy": {"default": whole,
                                  "validRange": {"min": step, "max": whole, "step": step}}}}}


def _static_devices(facts: GpuFacts, driver: DriverInfo, options: RenderOptions, *,
                    shares: bool = False) -> list[Json]:
    gpu = facts.gpu
    s = gpu.static
    shared = _gpu_attributes(facts, driver)
    if gpu.mig_mode is None or not gpu.mig_mode.current:
        whole = _full_gpu(facts, shared, None)
        return [_tainted(_shareable(whole, s.memory_total_mib) if shares else whole, facts,
                         options)]
    by_name = {p.name: p for p in gpu.profiles}
    devices = []
    for device in sorted(gpu.mig_devices, key=lambda d: (d.placement.start, d.gi_id, d.ci_id)):
        profile = by_name.get(device.profile)
        if profile is None or device.placement in facts.draining:
            continue
        devices.append(_tainted({
            "name": mig_device_name(s.minor, profile.name, profile.id, device.placement.start),
            "attributes": {"type": _attr("mig"), "uuid": _attr(device.uuid),
                           "profile": _attr(profile.name), "parentUUID": _attr(s.uuid),
                           **shared},
            "capacity": _profile_capacity(profile, device.placement,
                                          multiprocessors=device.multiprocessors),
        }, facts, options, (device.gi_id, device.ci_id)))
    return devices


def _full_gpu(facts: GpuFacts, shared: Json, counters: dict[str, int] | None) -> Json:
    s = facts.gpu.static
    device: Json = {"name": gpu_device_name(s.minor),
                    "attributes": {"type": _attr("gpu"), "uuid": _attr(s.uuid), **shared},
                    "capacity": {"memory": {"value": _mib(s.memory_total_mib)}}}
    if counters is not None:
        device["consumesCounters"] = [{"counterSet": counter_set_name(s.minor),
                                       "counters": _counters_json(counters)}]
    return device


def _dynamic_devices(facts: GpuFacts, driver: DriverInfo,
                     options: RenderOptions) -> tuple[Json | None, list[Json]]:
    """(the GPU's counter set or None, its devices), as the module docstring says."""
    gpu = facts.gpu
    s = gpu.static
    mode = gpu.mig_mode
    mig_on = mode is not None and mode.current
    if not gpu.profiles or (mode is not None and mode.pending != mode.current) or (
            not mig_on and not switches_mig_on(gpu)):
        return None, _static_devices(facts, driver, options)
    counter_set = counter_set_name(s.minor)
    counters = counters_of(gpu.profiles)
    shared = _gpu_attributes(facts, driver)
    if facts.held_whole:
        return ({"name": counter_set, "counters": _counters_json(counters)},
                [] if mig_on else [_tainted(_full_gpu(facts, shared, counters), facts,
                                            options)])
    by_name = {p.name: p for p in gpu.profiles}
    instances = {(d.profile, d.placement): d for d in gpu.mig_devices if d.profile in by_name}
    # What occupies memory slices: each instance and each hold (a device at exactly its
    # profile and placement is its own), and every drain or creation mark (nothing stays).
    occupied: set[tuple[str | None, Placement]] = {*instances, *facts.held}
    marked = [(None, placement) for placement in facts.draining]
    devices: list[Json] = []
    if not mig_on and not occupied and not marked:
        devices.append(_tainted(_full_gpu(facts, shared, counters), facts, options))
    for profile in gpu.profiles:
        for placement in profile.placements:
            here = (profile.name, placement)
            if any(placement.overlaps(p) and (q, p) != here for q, p in (*occupied, *marked)):
                continue
            attrs: Json = {"type": _attr("mig"), "profile": _attr(profile.name),
                           "parentUUID": _attr(s.uuid)}
            instance = instances.get(here)
            if instance is not None:
                attrs["uuid"] = _attr(instance.uuid)
            devices.append(_tainted({
                "name": mig_device_name(s.minor, profile.name, profile.id, placement.start),
                "attributes": {**attrs, **shared},
                "capacity": _profile_capacity(profile, placement),
                "consumesCounters": [{"counterSet": counter_set, "counters": _counters_json(
                    consumption_of(profile, placement))}],
            }, facts, options, None if instance is None else (instance.gi_id, instance.ci_id)))
    return {"name": counter_set, "counters": _counters_json(counters)}, devices


def _chunks(items: list[Json], size: int) -> list[list[Json]]:
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


def _device_chunks(devices: list[Json], kubernetes: tuple[int, int]) -> list[list[Json]]:
    """Devices without counters in slices of the most the server takes: fewer once any of
    them carries taints (1.35 on)."""
    limited = rules_for(kubernetes).advanced_device_limit and any(
        d.get("taints") for d in devices)
    return _chunks(devices, MAX_DEVICES_WITH_COUNTERS if limited else MAX_DEVICES)


def resource_slice_name(node: str, driver: str, index: int) -> str:
    """A DNS-subdomain object name for slice ``index`` of this node's pool; the index is
    zero-padded so that name order is index order (``-00010`` after ``-00002``)."""
    base = re.sub(r"[^a-z0-9.-]+", "-", f"{node}-{driver}".lower()).strip("-.")
    return f"{base[:240]}-{index:0{SLICE_INDEX_DIGITS}d}"


def render(gpus: Sequence[GpuFacts], driver_info: DriverInfo,
           options: RenderOptions) -> list[Json]:
    """The pool's ResourceSlices, in a stable order."""
    specs: list[Json] = []  # slice specs without the pool, filled in at the end
    # A GPU without a minor (lost before the agent started, and not known from before) has
    # no device name.
    published = [f for f in gpus if f.gpu.static.minor >= 0]
    published.sort(key=lambda f: f.gpu.static.minor)
    kubernetes = options.kubernetes
    if not options.dynamic_mig:
        devices = [d for f in published
                   for d in _static_devices(f, driver_info, options, shares=options.gpu_shares)]
        specs = [{"devices": chunk} for chunk in _device_chunks(devices, kubernetes)]
    else:
        per_gpu = [_dynamic_devices(f, driver_info, options) for f in published]
        sets = [cs for cs, _ in per_gpu if cs is not None]
        if options.kubernetes >= (1, 35):
            specs.extend({"sharedCounters": sets[i:i + MAX_COUNTER_SETS]}
                         for i in range(0, len(sets), MAX_COUNTER_SETS))
        # GPU by GPU in minor order, so that slice order is device order: a partitioned
        # GPU's devices in slices of their own, GPUs without counters side by side.
        plain: list[Json] = []
        for counter_set, devices in per_gpu:
            if counter_set is None:
                plain.extend(devices)
                continue
            if plain:
                specs.extend({"devices": chunk} for chunk in _device_chunks(plain, kubernetes))
                plain = []
            if options.kubernetes < (1, 35):
                # 1.34: a device may only consume counters of its own slice.
                specs.append({"sharedCounters": [counter_set], "devices": devices})
            elif devices:
                specs.extend({"devices": chunk}
                             for chunk in _chunks(devices, MAX_DEVICES_WITH_COUNTERS))
        if plain:
            specs.extend({"devices": chunk} for chunk in _device_chunks(plain, kubernetes))
        if not specs:
            specs = [{"devices": []}]
    pool = {"name": options.node_name, "generation": options.generation,
            "resourceSliceCount": len(specs)}
    slices = []
    for index, body in enumerate(specs):
        spec: Json = {"driver": options.driver, "pool": dict(pool),
                      "nodeName": options.node_name}
        spec.update(body)
        slices.append({"apiVersion": API_VERSION, "kind": "ResourceSlice",
                       "metadata": {"name": resource_slice_name(options.node_name, options.driver,
                                                       index)},
                       "spec": spec})
    return slices
