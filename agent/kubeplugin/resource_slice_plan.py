"""What to write to the API server so that it holds the agent's slices (pure: values in, a plan
out), which written fields the server dropped, and the agent's pool cut to what a server
keeps (counters, consumable capacity, device taints).

The rules (those of kubelet's Go helper, ``reference/kubelet-dra.md`` 3, where they apply):

- Every slice of the pool is named by the agent; the publisher owns only its ``metadata``
  (an ownerReference to the Node, ``controller: true``, so the garbage collector removes the
  slices with the Node) and the pool: named after the node, ``resourceSliceCount`` = the
  number of desired slices, ``driver``/``nodeName`` the plugin's (the watch selects on them).
- A slice is in sync when it is the object the publisher itself last wrote for the same
  content (same resourceVersion: this absorbs what the server does to a written object -
  quantities made canonical, defaults added, fields dropped), or, for a slice written before
  this process started, when it holds every desired field with the desired value.
- Generation: consumers use only the slices of a pool's highest generation, and only when
  their number matches ``resourceSliceCount``. When anything must be written, every desired
  slice is written with generation ``max(agent's, highest existing + 1)``: above every slice
  on the server, so a half-written pool reads as incomplete (skipped by the allocator) and
  never as a mix of old and new devices; and never below the agent's durable number, so
  a restart of either side cannot go back. A plan that only deletes leftovers keeps the
  generation (nothing new is published). Chosen over the Go helper's "unchanged when at
  most one slice changes": the agent already bumps its generation on every content change,
  so that case would not arise.
- Order: delete obsolete slices (with UID and resourceVersion preconditions), update, then
  create.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Written:
    """What the publisher last wrote to a slice: the server's resourceVersion of the answer,
    the digest of the content written (generation aside), and the generation."""

    resource_version: str
    digest: str
    generation: int


@dataclass(frozen=True)
class Delete:
    name: str
    uid: str
    resource_version: str


@dataclass(frozen=True)
class ResourceSlicePlan:
    """The writes that bring the server to the desired pool, in the order to apply them."""

    generation: int
    deletes: tuple[Delete, ...] = ()
    updates: tuple[Json, ...] = ()
    creates: tuple[Json, ...] = ()
    in_sync: tuple[str, ...] = field(default=())
    """Names of desired slices already right on the server (before any bump)."""

    @property
    def empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)

    @property
    def writes(self) -> int:
        """Slices this plan creates or updates (deletes aside)."""
        return len(self.updates) + len(self.creates)


class InvalidDesired(ValueError):
    """The agent's slices cannot be published as they are (e.g. two with one name)."""


def _name(item: Mapping[str, Any]) -> str:
    return str(item.get("metadata", {}).get("name", ""))


def _generation(item: Mapping[str, Any]) -> int:
    value = item.get("spec", {}).get("pool", {}).get("generation", 0)
    return value if isinstance(value, int) else 0


def is_slot(item: Mapping[str, Any]) -> bool:
    """Whether an item of the agent's answer is the compute-domain slot (selected by node
    label, not by node name)."""
    spec = item.get("spec")
    return isinstance(spec, Mapping) and "nodeSelector" in spec and "nodeName" not in spec


def owner_reference(node_name: str, node_uid: str) -> Json:
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid,
            "controller": True}


def content(item: Mapping[str, Any]) -> Json:
    """The part of a slice the publisher decides, generation aside: what "in sync" compares."""
    metadata = item.get("metadata", {})
    spec = dict(item.get("spec", {}))
    pool = {k: v for k, v in spec.get("pool", {}).items() if k != "generation"}
    spec["pool"] = pool
    return {"metadata": {"name": metadata.get("name"),
                         "ownerReferences": metadata.get("ownerReferences", [])},
            "spec": spec}


def digest(item: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content(item), sort_keys=True).encode()).hexdigest()


def _omitted(value: Any) -> bool:
    """Values an API server leaves out of what it returns (Go's ``omitempty``): their absence
    in a read-back is neither a difference nor a dropped field."""
    return value is None or value == "" or value is False or value == 0 or value in ({}, [])


# A Kubernetes quantity: a decimal number, then a binary or decimal suffix or an exponent.
_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_SUFFIX: dict[str, int | Decimal] = {
    "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
#: Keys whose string values are quantities in a slice (capacity and counter ``value``, a
#: capacity's ``requestPolicy``); attributes never use them (``string``, ``int``, ...).
QUANTITY_KEYS = frozenset({"value", "default", "min", "max", "step"})


def quantity_value(text: str) -> Decimal | None:
    """The number a quantity string means (``80Gi`` and ``81920Mi`` alike), None if it is
    not one."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        return None
    suffix = match[2] or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return Decimal(match[1]) * Decimal(10) ** int(suffix[1:])
    return Decimal(match[1]) * _SUFFIX[suffix]


def same_value(wanted: Any, actual: Any, key: str | None = None) -> bool:
    """Equal, or, under a quantity key, the same quantity: the API server writes quantities
    canonically (``81920Mi`` reads back as ``80Gi``)."""
    if wanted == actual:
        return True
    if key in QUANTITY_KEYS and isinstance(wanted, str) and isinstance(actual, str):
        number = quantity_value(wanted)
        return number is not None and number == quantity_value(actual)
    return False


def holds(wanted: Any, actual: Any, key: str | None = None) -> bool:
    """Whether ``actual`` has every field of ``wanted`` with its value (fields the server
    added, such as defaults, are allowed; lists must match item by item; quantities are
    compared by value)."""
    if isinstance(wanted, Mapping):
        if not isinstance(actual, Mapping):
            return False
        return all((name in actual and holds(value, actual[name], str(name)))
                   or (name not in actual and _omitted(value))
                   for name, value in wanted.items())
    if isinstance(wanted, list):
        return (isinstance(actual, list) and len(wanted) == len(actual)
                and all(holds(w, a, key) for w, a in zip(wanted, actual, strict=True)))
    return same_value(wanted, actual, key)


def dropped_fields(written: Any, read: Any, path: str = "") -> tuple[str, ...]:
    """Fields of ``written`` that ``read`` lacks, as paths with ``[]`` for list items
    (``spec.devices[].consumesCounters``), sorted and without repeats. A server drops the
    fields a disabled feature gate guards and answers the rest; values it rewrote (a
    canonical quantity) are not drops, nor are empty values it omits."""
    found: set[str] = set()
    _collect_dropped(written, read, path, found)
    return tuple(sorted(found))


def _collect_dropped(written: Any, read: Any, path: str, found: set[str]) -> None:
    if isinstance(written, Mapping):
        if not isinstance(read, Mapping):
            return
        for key, value in written.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in read:
                if not _omitted(value):
                    found.add(where)
            else:
                _collect_dropped(value, read[key], where, found)
    elif isinstance(written, list) and isinstance(read, list):
        if len(read) < len(written):
            found.add(f"{path}[]")
            return
        for w, r in zip(written, read, strict=False):
            _collect_dropped(w, r, f"{path}[]", found)


#: Fields a server drops when partitionable devices are off: without them the scheduler
#: would book placements that overlap, so the devices that consume counters are withdrawn.
COUNTER_FIELDS = ("spec.devices[].consumesCounters", "spec.sharedCounters")


def without_counters(agent_items: Sequence[Mapping[str, Any]]) -> list[Json]:
    """The agent's pool without counter sets and without every device that consumes them
    (dynamic MIG placements, and the whole GPU that shares their counters): what is safe to
    publish where the server cannot keep counters. Slices left empty go, but one remains."""
    kept: list[Json] = []
    for item in agent_items:
        spec = {k: v for k, v in item.get("spec", {}).items() if k != "sharedCounters"}
        devices = [d for d in spec.get("devices") or [] if not d.get("consumesCounters")]
        if devices:
            kept.append({**item, "spec": {**spec, "devices": devices}})
    if not kept and agent_items:
        first = agent_items[0]
        spec = {k: v for k, v in first.get("spec", {}).items() if k != "sharedCounters"}
        kept.append({**first, "spec": {**spec, "devices": []}})
    return kept


#: Fields a server drops when consumable capacity (``DRAConsumableCapacity``) is off: without
#: them a shareable GPU reads as an exclusive one whose memory no request counts, so the
#: publisher stops offering shares and publishes the GPUs whole.
SHARE_FIELD = "spec.devices[].allowMultipleAllocations"
SHAREABLE_ATTRIBUTE = "shareable"


def share_fields(dropped: Iterable[str]) -> tuple[str, ...]:
    """The consumable-capacity fields among ``dropped`` field paths: a device's
    ``allowMultipleAllocations`` and any capacity's ``requestPolicy``."""
    return tuple(f for f in dropped if f == SHARE_FIELD or (
        f.startswith("spec.devices[].capacity.") and f.endswith(".requestPolicy")))


def without_shares(agent_items: Sequence[Mapping[str, Any]]) -> list[Json]:
    """The agent's pool with every device exclusive: no ``allowMultipleAllocations``, no
    ``shareable`` attribute and no capacity ``requestPolicy`` (the capacity values stay);
    what a server without consumable capacity keeps of it anyway (and no device a share
    class selects), written as such so that it stays in sync."""
    out: list[Json] = []
    for item in agent_items:
        spec = dict(item.get("spec", {}))
        if "devices" in spec:
            devices = []
            for device in spec.get("devices") or []:
                plain = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
                if isinstance(device.get("attributes"), Mapping):
                    # The agent's mark of a shareable device (agent/dra/resource_slices.py),
                    # which DeviceClass share.nodeagent.dev selects: a GPU published whole
                    # must not match it.
                    plain["attributes"] = {k: v for k, v in device["attributes"].items()
                                           if k != SHAREABLE_ATTRIBUTE}
                if isinstance(device.get("capacity"), Mapping):
                    plain["capacity"] = {
                        name: ({k: v for k, v in value.items() if k != "requestPolicy"}
                               if isinstance(value, Mapping) else value)
                        for name, value in device["capacity"].items()}
                devices.append(plain)
            spec["devices"] = devices
        out.append({**item, "spec": spec})
    return out


def desired_resource_slices(agent_items: Sequence[Mapping[str, Any]], *, node_name: str,
                   node_uid: str, driver: str, generation: int) -> list[Json]:
    """The agent's slices as the publisher writes them: its owner reference, pool and
    generation; the rest as the agent rendered it."""
    count = len(agent_items)
    out: list[Json] = []
    for item in agent_items:
        spec = dict(item.get("spec", {}))
        spec.update(driver=driver, nodeName=node_name,
                    pool={**spec.get("pool", {}), "name": node_name, "generation": generation,
                          "resourceSliceCount": count})
        metadata = {k: v for k, v in item.get("metadata", {}).items()
                    if k in ("name", "labels", "annotations")}
        metadata["ownerReferences"] = [owner_reference(node_name, node_uid)]
        out.append({"apiVersion": item.get("apiVersion", "resource.k8s.io/v1"),
                    "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
    return out


def plan(agent_items: Sequence[Mapping[str, Any]], existing: Iterable[Mapping[str, Any]], *,
         node_name: str, node_uid: str, driver: str,
         written: Mapping[str, Written] | None = None) -> ResourceSlicePlan:
    """The writes that make ``existing`` (this node's slices of this driver on the server)
    the agent's pool; ``written`` is what this publisher wrote before. No ``agent_items``
    means the pool is deleted."""
    written = written or {}
    names = [_name(item) for item in agent_items]
    if len(set(names)) != len(names) or "" in names:
        raise InvalidDesired(f"the agent's slices need distinct names, got {names}")
    on_server = {_name(item): item for item in existing}
    agent_generation = max((_generation(item) for item in agent_items), default=0)
    # In-sync checks need the bodies; the generation is decided after them.
    wanted = desired_resource_slices(agent_items, node_name=node_name, node_uid=node_uid,
                            driver=driver, generation=0)
    obsolete = tuple(Delete(name, str(item["metadata"].get("uid", "")),
                            str(item["metadata"].get("resourceVersion", "")))
                     for name, item in sorted(on_server.items()) if name not in names)
    kept_generations = {_generation(on_server[n]) for n in names if n in on_server}
    in_sync = tuple(body["metadata"]["name"] for body in wanted
                    if _in_sync(body, on_server.get(body["metadata"]["name"]), written))
    if len(in_sync) == len(wanted) and len(kept_generations) <= 1:
        current = kept_generations.pop() if kept_generations else agent_generation
        return ResourceSlicePlan(generation=current, deletes=obsolete, in_sync=in_sync)
    highest = max((_generation(item) for item in on_server.values()), default=0)
    generation = max(agent_generation, highest + 1 if on_server else 1)
    updates: list[Json] = []
    creates: list[Json] = []
    for body in desired_resource_slices(agent_items, node_name=node_name, node_uid=node_uid,
                               driver=driver, generation=generation):
        current_item = on_server.get(body["metadata"]["name"])
        if current_item is None:
            creates.append(body)
        else:
            body["metadata"]["resourceVersion"] = str(
                current_item["metadata"].get("resourceVersion", ""))
            updates.append(body)
    return ResourceSlicePlan(generation=generation, deletes=obsolete, updates=tuple(updates),
                     creates=tuple(creates), in_sync=in_sync)


def _in_sync(body: Json, current: Mapping[str, Any] | None,
             written: Mapping[str, Written]) -> bool:
    if current is None:
        return False
    mine = written.get(body["metadata"]["name"])
    version = str(current.get("metadata", {}).get("resourceVersion", ""))
    if mine is not None and mine.resource_version == version:
        return mine.digest == digest(body)
    return holds(content(body), content(current))


# --- device taints ---


class TaintSupport(Enum):
    """What the API server does with device taints (``DRADeviceTaints``), found by a dry-run
    probe at start and by the server's answers to real writes; it only ever goes down."""

    UNKNOWN = "unknown"
    """Not asked yet: published as :attr:`NONE` would be (fail closed)."""
    KEPT = "kept"
    BLOCKING_ONLY = "blocking-only"
    """Keeps ``NoSchedule`` and ``NoExecute`` taints but refuses effect ``None``."""
    NONE = "none"
    """Keeps no taints (the gate is off: the server drops them silently)."""


#: The field a server drops when ``DRADeviceTaints`` is off.
TAINT_FIELD = "spec.devices[].taints"
#: The key of the probe's one taint (under the driver's domain).
TAINT_PROBE_KEY = "taint-probe"


def is_blocking(taint: Mapping[str, Any]) -> bool:
    """Whether a taint keeps claims off (``NoSchedule``, ``NoExecute``, or an effect this code
    does not know, fail closed); ``None`` is informational."""
    return taint.get("effect") != "None"


@dataclass(frozen=True)
class TaintedPool:
    """The pool as a server of some :class:`TaintSupport` can hold it: ``items``, and what of
    the agent's pool it leaves out (``withdrawn``: (device, its taints as one line) for each
    device with a blocking taint; ``stripped``: how many informational taints)."""

    items: tuple[Json, ...]
    withdrawn: tuple[tuple[str, str], ...] = ()
    stripped: int = 0


def _taint_text(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def for_taint_support(agent_items: Sequence[Mapping[str, Any]],
                      support: TaintSupport) -> TaintedPool:
    """The agent's pool for a server of ``support``: as it is where taints are kept;
    without informational taints where only those are refused; and where no taint is kept
    (or that is not known yet) without every device that has a blocking taint and without the
    other devices' taints, so a device that must keep claims off never reads as healthy.
    Every slice stays, emptied or not (a taint that comes and goes changes no slice count)."""
    if support is TaintSupport.KEPT:
        return TaintedPool(tuple(dict(item) for item in agent_items))
    withdrawn: list[tuple[str, str]] = []
    stripped = 0
    out: list[Json] = []
    for item in agent_items:
        spec = dict(item.get("spec", {}))
        if "devices" in spec:
            devices: list[Json] = []
            for device in spec.get("devices") or []:
                taints = [t for t in device.get("taints") or [] if isinstance(t, Mapping)]
                if not taints:
                    devices.append(device)
                    continue
                if support is TaintSupport.BLOCKING_ONLY:
                    kept = [t for t in taints if is_blocking(t)]
                    stripped += len(taints) - len(kept)
                    devices.append({**device, "taints": kept} if kept else
                                   {k: v for k, v in device.items() if k != "taints"})
                elif any(is_blocking(t) for t in taints):
                    withdrawn.append((str(device.get("name", "")),
                                      ", ".join(_taint_text(t) for t in taints)))
                else:
                    stripped += len(taints)
                    devices.append({k: v for k, v in device.items() if k != "taints"})
            spec["devices"] = devices
        out.append({**item, "spec": spec})
    return TaintedPool(tuple(out), tuple(withdrawn), stripped)


def has_taints(bodies: Iterable[Mapping[str, Any]], *, informational: bool = False) -> bool:
    """Whether any device of ``bodies`` carries a taint (an informational one, if asked)."""
    return any(isinstance(t, Mapping) and (not informational or not is_blocking(t))
               for body in bodies for device in body.get("spec", {}).get("devices") or []
               for t in device.get("taints") or [])


#: A taint field in a refusal's message (``spec.devices[1].taints[0].effect``); the slice's
#: name, quoted in the message too, may hold any word.
_TAINT_PATH = re.compile(r"devices\[\d+\]\.taints\b")


def taint_refusal(support: TaintSupport, bodies: Sequence[Mapping[str, Any]],
                  message: str) -> TaintSupport | None:
    """The support to fall back to after the server refused (400/422, ``message``) a write of
    ``bodies``; None when the refusal is not about taints (no body carries one, or the
    message names no taint field). One step at a time: a refusal of bodies with
    informational taints first drops those (a 1.34 server with the gate refuses effect
    ``None``), then every taint."""
    if not _TAINT_PATH.search(message) or not has_taints(bodies):
        return None
    if support is TaintSupport.KEPT and has_taints(bodies, informational=True):
        return TaintSupport.BLOCKING_ONLY
    return TaintSupport.NONE


def dropped_taints(dropped: Iterable[str]) -> tuple[str, ...]:
    """The taint fields among ``dropped`` field paths: the taints, some of them (a shorter
    list), or a field of theirs."""
    return tuple(f for f in dropped
                 if f.startswith(TAINT_FIELD) and f[len(TAINT_FIELD):][:1] in ("", "[", "."))


def taint_probe(*, node_name: str, driver: str) -> Json:
    """A slice of this node's pool with one device and one ``NoSchedule`` taint, to be created
    with ``dryRun=All`` (nothing is stored): the answer shows whether the server keeps
    taints. A generated name, so no slice of that name can be in the way."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node_name}-{TAINT_PROBE_KEY}-"},
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": node_name, "generation": 0, "resourceSliceCount": 1},
                     "devices": [{"name": TAINT_PROBE_KEY, "taints": [
                         {"key": f"{driver}/{TAINT_PROBE_KEY}", "effect": "NoSchedule"}]}]}}


def probe_answer(probe: Mapping[str, Any], answer: Mapping[str, Any]) -> TaintSupport:
    """What the server's answer to :func:`taint_probe` says: taints kept, or dropped."""
    return TaintSupport.NONE if dropped_taints(dropped_fields(probe, answer)) \
        else TaintSupport.KEPT
