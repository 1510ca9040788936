"""What to write to the API server so that it holds the agent's slices (pure: values in, a plan
out), and which written fields the server dropped.

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


def share_fields(dropped: Iterable[str]) -> tuple[str, ...]:
    """The consumable-capacity fields among ``dropped`` field paths: a device's
    ``allowMultipleAllocations`` and any capacity's ``requestPolicy``."""
    return tuple(f for f in dropped if f == SHARE_FIELD or (
        f.startswith("spec.devices[].capacity.") and f.endswith(".requestPolicy")))


def without_shares(agent_items: Sequence[Mapping[str, Any]]) -> list[Json]:
    """The agent's pool with every device exclusive: no ``allowMultipleAllocations`` and no
    capacity ``requestPolicy`` (the capacity values stay); what a server without consumable
    capacity keeps of it anyway, written as such so that it stays in sync."""
    out: list[Json] = []
    for item in agent_items:
        spec = dict(item.get("spec", {}))
        if "devices" in spec:
            devices = []
            for device in spec.get("devices") or []:
                plain = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
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
