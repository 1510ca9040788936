"""What the Kubernetes API server checks in ResourceSlices beyond the OpenAPI schema
(``pkg/apis/resource/validation``), per version, so the agent never publishes a slice the
server would refuse. ``check`` returns the violations as readable strings; empty is valid.

Rules (1.34 and 1.35 as noted):
- devices: at most 128 per slice, 64 once any device consumes counters or has taints; names
  are DNS labels, unique in the pool; at most 32 attributes and capacities together;
  attribute names are C identifiers (<= 32) optionally behind a DNS domain and ``/``;
  exactly one attribute value; strings at most 64 characters; versions are semver 2.0.0;
- pool: generation >= 0, resourceSliceCount > 0 and equal to the slices seen, one
  generation in the pool;
- exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection;
- 1.34: at most 32 shared counters in a slice, 32 counters consumed per device and 1024 per
  slice; a device consumes only counter sets of its own slice;
- 1.35: a slice has shared counters or devices, not both; at most 8 counter sets a slice,
  32 counters a set, 2 consumptions a device, 32 counters a consumption; counter set names
  unique in the pool; a device consumes counter sets of its pool;
- everywhere: consumed counters exist in their set and no device consumes more of a counter
  than the set has.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE]|)\Z")
_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18}

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE_LENGTH = 64
# 1.34
MAX_SHARED_COUNTERS_V134 = 32
MAX_COUNTERS_PER_DEVICE_V134 = 32
MAX_DEVICE_COUNTERS_PER_SLICE_V134 = 1024
# 1.35
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32


def quantity(text: object) -> Decimal:
    """A Kubernetes quantity (``80Gi``, ``16``, ``1.5k``) as a number; ValueError otherwise."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = Decimal(match[1]), match[2]
    if suffix[:1] in ("e", "E") and len(suffix) > 1 and suffix[1:].lstrip("+-").isdigit():
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * Decimal(_SUFFIX[suffix])


def _qualified_name(name: str) -> bool:
    domain, _, ident = name.rpartition("/")
    if domain and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain)):
        return False
    return len(ident) <= 32 and bool(_C_IDENTIFIER.match(ident))


def _check_attribute(where: str, value: Any, problems: list[str]) -> None:
    if not isinstance(value, dict) or len(value) != 1:
        problems.append(f"{where}: exactly one value must be specified")
        return
    kind, raw = next(iter(value.items()))
    if kind in ("string", "version") and len(str(raw)) > MAX_VALUE_LENGTH:
        problems.append(f"{where}: longer than {MAX_VALUE_LENGTH} characters")
    if kind == "version" and not _SEMVER.match(str(raw)):
        problems.append(f"{where}: {raw!r} is not a semver 2.0.0 version")


def _check_device(where: str, device: dict[str, Any], problems: list[str]) -> None:
    name = str(device.get("name", ""))
    if not _DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f"{where}: name {name!r} is not a DNS label")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"{where}: {len(attributes) + len(capacity)} attributes and "
                        f"capacities (at most {MAX_ATTRIBUTES_AND_CAPACITIES})")
    for key, value in attributes.items():
        if not _qualified_name(key):
            problems.append(f"{where}.attributes: bad name {key!r}")
        _check_attribute(f"{where}.attributes[{key}]", value, problems)
    for key, value in capacity.items():
        if not _qualified_name(key):
            problems.append(f"{where}.capacity: bad name {key!r}")
        try:
            quantity(value.get("value"))
        except (ValueError, AttributeError):
            problems.append(f"{where}.capacity[{key}]: bad quantity {value!r}")


def check(slices: Sequence[dict[str, Any]], kubernetes: tuple[int, int]) -> list[str]:
    """Every rule above that ``slices`` (one pool) break, for this Kubernetes version."""
    problems: list[str] = []
    v135 = kubernetes >= (1, 35)
    pool_sets: dict[str, dict[str, Decimal]] = {}
    device_names: set[str] = set()
    pools: dict[str, set[tuple[int, int]]] = {}
    per_slice_sets: list[dict[str, dict[str, Decimal]]] = []
    for i, item in enumerate(slices):
        where = f"slice {i}"
        spec = item.get("spec", {})
        driver = str(spec.get("driver", ""))
        if not _DNS_SUBDOMAIN.match(driver) or len(driver) > 63:
            problems.append(f"{where}: driver {driver!r} is not a lower-case DNS subdomain")
        pool = spec.get("pool", {})
        generation, count = pool.get("generation", -1), pool.get("resourceSliceCount", 0)
        if not isinstance(generation, int) or generation < 0:
            problems.append(f"{where}: pool generation {generation!r} must be >= 0")
        if not isinstance(count, int) or count <= 0:
            problems.append(f"{where}: resourceSliceCount {count!r} must be > 0")
        pools.setdefault(str(pool.get("name", "")), set()).add((generation, count))
        chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
                  if spec.get(k) not in (None, False, "")]
        if len(chosen) != 1:
            problems.append(f"{where}: exactly one of nodeName, nodeSelector, allNodes, "
                            f"perDeviceNodeSelection is required (got {chosen})")
        counter_sets = spec.get("sharedCounters")
        devices = spec.get("devices")
        if v135 and counter_sets is not None and devices is not None:
            problems.append(f"{where}: only one of sharedCounters or devices is allowed")
        own: dict[str, dict[str, Decimal]] = {}
        total_counters = 0
        for cs in counter_sets or []:
            name = str(cs.get("name", ""))
            counters = cs.get("counters") or {}
            total_counters += len(counters)
            if not _DNS_LABEL.match(name):
                problems.append(f"{where}: counter set name {name!r} is not a DNS label")
            if name in own or (v135 and name in pool_sets):
                problems.append(f"{where}: counter set {name!r} defined twice")
            if not counters:
                problems.append(f"{where}: counter set {name!r} has no counters")
            if v135 and len(counters) > MAX_COUNTERS_PER_SET:
                problems.append(f"{where}: counter set {name!r} has {len(counters)} counters "
                                f"(at most {MAX_COUNTERS_PER_SET})")
            values: dict[str, Decimal] = {}
            for counter, value in counters.items():
                if not _DNS_LABEL.match(counter):
                    problems.append(f"{where}: counter name {counter!r} is not a DNS label")
                try:
                    values[counter] = quantity(value.get("value"))
                except (ValueError, AttributeError):
                    problems.append(f"{where}: counter {counter!r} has a bad value {value!r}")
            own[name] = values
            pool_sets[name] = values
        if v135 and len(counter_sets or []) > MAX_COUNTER_SETS:
            problems.append(f"{where}: {len(counter_sets or [])} counter sets "
                            f"(at most {MAX_COUNTER_SETS})")
        if not v135 and total_counters > MAX_SHARED_COUNTERS_V134:
            problems.append(f"{where}: {total_counters} shared counters "
                            f"(at most {MAX_SHARED_COUNTERS_V134})")
        per_slice_sets.append(own)
        devices = devices or []
        consuming = any(d.get("consumesCounters") or d.get("taints") for d in devices)
        limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if consuming else MAX_DEVICES
        if len(devices) > limit:
            why = " once devices consume counters or have taints" if consuming else ""
            problems.append(f"{where}: {len(devices)} devices (at most {limit}{why})")
        for d, device in enumerate(devices):
            name = str(device.get("name", ""))
            if name in device_names:
                problems.append(f"{where}: device {name!r} appears twice in the pool")
            device_names.add(name)
            _check_device(f"{where}.devices[{d}] {name}", device, problems)
    for i, item in enumerate(slices):
        _check_consumption(i, item.get("spec", {}), per_slice_sets[i], pool_sets=pool_sets,
                           v135=v135, problems=problems)
    for name, seen in pools.items():
        generations = {g for g, _ in seen}
        counts = {c for _, c in seen}
        if len(generations) > 1:
            problems.append(f"pool {name!r}: slices with different generations {generations}")
        if counts != {sum(1 for s in slices if s.get('spec', {}).get('pool', {})
                          .get('name') == name)}:
            problems.append(f"pool {name!r}: resourceSliceCount {counts} does not match the "
                            "slices published")
    return problems


def _check_consumption(i: int, spec: dict[str, Any], own: dict[str, dict[str, Decimal]], *,
                       pool_sets: dict[str, dict[str, Decimal]], v135: bool,
                       problems: list[str]) -> None:
    visible = pool_sets if v135 else own
    slice_total = 0
    for device in spec.get("devices") or []:
        where = f"slice {i} device {device.get('name')}"
        consumptions = device.get("consumesCounters") or []
        if v135 and len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
            problems.append(f"{where}: {len(consumptions)} counter consumptions "
                            f"(at most {MAX_CONSUMPTIONS_PER_DEVICE})")
        device_total = 0
        seen_sets: set[str] = set()
        for consumption in consumptions:
            set_name = str(consumption.get("counterSet", ""))
            counters = consumption.get("counters") or {}
            device_total += len(counters)
            if set_name in seen_sets:
                problems.append(f"{where}: counter set {set_name!r} consumed twice")
            seen_sets.add(set_name)
            if v135 and len(counters) > MAX_COUNTERS_PER_CONSUMPTION:
                problems.append(f"{where}: {len(counters)} counters in one consumption "
                                f"(at most {MAX_COUNTERS_PER_CONSUMPTION})")
            available = visible.get(set_name)
            if available is None:
                scope = "pool" if v135 else "slice"
                problems.append(f"{where}: counter set {set_name!r} is not defined in the "
                                f"{scope}")
                continue
            for counter, value in counters.items():
                if counter not in available:
                    problems.append(f"{where}: counter {counter!r} is not in {set_name!r}")
                    continue
                try:
                    used = quantity(value.get("value"))
                except (ValueError, AttributeError):
                    problems.append(f"{where}: counter {counter!r} has a bad value {value!r}")
                    continue
                if used > available[counter]:
                    problems.append(f"{where}: consumes {used} of {counter!r}, more than the "
                                    f"{available[counter]} in {set_name!r}")
        slice_total += device_total
        if not v135 and device_total > MAX_COUNTERS_PER_DEVICE_V134:
            problems.append(f"{where}: consumes {device_total} counters "
                            f"(at most {MAX_COUNTERS_PER_DEVICE_V134})")
    if not v135 and slice_total > MAX_DEVICE_COUNTERS_PER_SLICE_V134:
        problems.append(f"slice {i}: devices consume {slice_total} counters in all "
                        f"(at most {MAX_DEVICE_COUNTERS_PER_SLICE_V134})")
