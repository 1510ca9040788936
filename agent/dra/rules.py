"""What the Kubernetes API server checks in ResourceSlices beyond the OpenAPI schema
(``pkg/apis/resource/validation`` and the declarative ``+k8s:`` tags), per version, so the agent
never publishes a slice the server would refuse. ``check`` returns the violations as readable
strings; empty is valid. Read from ``k8s.io/kubernetes`` v1.34.4, v1.36.3, v1.37.2 and
``k8s.io/api`` v0.35.4; :data:`RULES` is the per-version table.

Everywhere:
- devices: at most 128 per slice; names are DNS labels, unique in the pool; at most 32
  attributes and capacities together; attribute names are C identifiers (<= 32) optionally
  behind a DNS domain and ``/``; exactly one attribute value; strings at most 64 characters;
  versions are semver 2.0.0; taints have a key and a known effect;
- pool: generation >= 0, resourceSliceCount > 0 and equal to the slices seen, one
  generation in the pool;
- exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection;
- consumed counters exist in their set and no device consumes more of a counter than the set
  has (the allocator's pool check; the server cannot see other slices from 1.35);
- consumable capacity (KEP-5075; the fields exist in every version, behind the
  ``DRAConsumableCapacity`` gate: alpha and off in 1.34 and 1.35, beta and on from 1.36, and a
  server with the gate off drops them): a capacity's ``requestPolicy`` only on a device with
  ``allowMultipleAllocations: true``; ``validValues`` or ``validRange``, not both, each
  with a ``default``; ``validValues`` at most 10, ascending, none above the capacity, the
  default among them; ``validRange`` has a ``min`` not above the capacity or the default, a
  ``max`` (if any) between ``min`` and the capacity and not below the default, and a ``step``
  (if any) with ``min + step`` within the capacity and the default and ``max`` whole steps
  above ``min``.
1.34: at most 32 shared counters in a slice, 32 counters consumed per device and 1024 per
slice; a device consumes only counter sets of its own slice; at most 4 taints a device
(effects NoSchedule, NoExecute).
1.35: a slice has shared counters or devices, not both; at most 64 devices once any device
consumes counters or has taints; at most 8 counter sets a slice, 32 counters a set, 2
consumptions a device, 32 counters a consumption; counter set names unique in the pool; a
device consumes counter sets of its pool; at most 16 taints a device (effect None too).
1.36: list-valued attributes (``bools``, ``ints``, ``strings``, ``versions``: non-empty, each
item checked as its scalar) also bring the 64-device limit, and a device has at most 48
attribute values (a list counts its items).
1.37: ``partitionTypeAttribute`` names a string attribute that every device consuming counters
carries (bare in the driver's own domain or qualified), only in a slice with such devices;
``skipNodeOperations`` may skip NodePrepareResources only with NodeUnprepareResources (or
``*``). Fields a version does not know are reported: that server would drop them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE]|)\Z")
_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18}

MAX_DEVICES = 128
MAX_DEVICES_WITH_ADVANCED_FEATURES = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_VALUE_LENGTH = 64
MAX_VALID_VALUES = 10
# 1.34
MAX_SHARED_COUNTERS_V134 = 32
MAX_COUNTERS_PER_DEVICE_V134 = 32
MAX_DEVICE_COUNTERS_PER_SLICE_V134 = 1024
# 1.35
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
_LISTS = ("bools", "ints", "strings", "versions")
_SKIP_OPERATIONS = frozenset({"NodePrepareResources", "NodeUnprepareResources", "*"})


@dataclass(frozen=True)
class Rules:
    """What one Kubernetes version's API server accepts in a ResourceSlice."""

    version: tuple[int, int]
    counters_apart: bool
    """Shared counters and devices in separate slices, counter sets visible pool-wide."""
    advanced_device_limit: bool
    """At most 64 devices in a slice with counters, taints (or, 1.36, list attributes)."""
    max_taints: int
    taint_effects: frozenset[str]
    list_attributes: bool
    partition_type_attribute: bool
    skip_node_operations: bool


_V134 = Rules((1, 34), counters_apart=False, advanced_device_limit=False, max_taints=4,
              taint_effects=frozenset({"NoSchedule", "NoExecute"}), list_attributes=False,
              partition_type_attribute=False, skip_node_operations=False)
_V135 = Rules((1, 35), counters_apart=True, advanced_device_limit=True, max_taints=16,
              taint_effects=frozenset({"NoSchedule", "NoExecute", "None"}),
              list_attributes=False, partition_type_attribute=False,
              skip_node_operations=False)
_V136 = Rules((1, 36), counters_apart=True, advanced_device_limit=True, max_taints=16,
              taint_effects=_V135.taint_effects, list_attributes=True,
              partition_type_attribute=False, skip_node_operations=False)
_V137 = Rules((1, 37), counters_apart=True, advanced_device_limit=True, max_taints=16,
              taint_effects=_V135.taint_effects, list_attributes=True,
              partition_type_attribute=True, skip_node_operations=True)
#: The versions whose rules the agent knows, oldest first.
RULES = (_V134, _V135, _V136, _V137)


def rules_for(kubernetes: tuple[int, int]) -> Rules:
    """The rules of ``kubernetes``: those of the newest known version not above it (a newer
    server keeps the newest rules known; an older one gets the oldest)."""
    known = [r for r in RULES if r.version <= kubernetes]
    return known[-1] if known else RULES[0]


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


def _label_name(name: str) -> bool:
    """A Kubernetes label key: an optional DNS-subdomain prefix and ``/``, then a name of at
    most 63 alphanumerics, ``-``, ``_`` and ``.``, alphanumeric at both ends."""
    prefix, _, ident = name.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(ident) <= 63 and bool(_LABEL_NAME.match(ident))


def _check_scalar(where: str, kind: str, raw: Any, problems: list[str]) -> None:
    if kind in ("string", "version") and len(str(raw)) > MAX_VALUE_LENGTH:
        problems.append(f"{where}: longer than {MAX_VALUE_LENGTH} characters")
    if kind == "version" and not _SEMVER.match(str(raw)):
        problems.append(f"{where}: {raw!r} is not a semver 2.0.0 version")


def _check_attribute(where: str, value: Any, rules: Rules, problems: list[str]) -> int:
    """Check one attribute; the number of values it holds (a list counts its items)."""
    if not isinstance(value, dict) or len(value) != 1:
        problems.append(f"{where}: exactly one value must be specified")
        return 1
    kind, raw = next(iter(value.items()))
    if kind not in _LISTS:
        _check_scalar(where, kind, raw, problems)
        return 1
    if not rules.list_attributes:
        problems.append(f"{where}: list values ({kind}) need Kubernetes 1.36 or newer")
        return 1
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: {kind} must be a non-empty list")
        return 1
    for i, item in enumerate(raw):
        _check_scalar(f"{where}.{kind}[{i}]", kind[:-1], item, problems)
    return len(raw)


def _check_taints(where: str, taints: Any, rules: Rules, problems: list[str]) -> None:
    if len(taints) > rules.max_taints:
        problems.append(f"{where}: {len(taints)} taints (at most {rules.max_taints})")
    for i, taint in enumerate(taints):
        key = str(taint.get("key", "")) if isinstance(taint, dict) else ""
        effect = taint.get("effect") if isinstance(taint, dict) else None
        if not _label_name(key):
            problems.append(f"{where}.taints[{i}]: bad key {key!r}")
        if effect not in rules.taint_effects:
            problems.append(f"{where}.taints[{i}]: effect {effect!r} is not one of "
                            f"{', '.join(sorted(rules.taint_effects))}")


def _check_device(where: str, device: dict[str, Any], rules: Rules,
                  problems: list[str]) -> None:
    name = str(device.get("name", ""))
    if not _DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f"{where}: name {name!r} is not a DNS label")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"{where}: {len(attributes) + len(capacity)} attributes and "
                        f"capacities (at most {MAX_ATTRIBUTES_AND_CAPACITIES})")
    values = 0
    for key, value in attributes.items():
        if not _qualified_name(key):
            problems.append(f"{where}.attributes: bad name {key!r}")
        values += _check_attribute(f"{where}.attributes[{key}]", value, rules, problems)
    if rules.list_attributes and values > MAX_ATTRIBUTE_VALUES:
        problems.append(f"{where}: {values} attribute values (at most {MAX_ATTRIBUTE_VALUES})")
    shared = device.get("allowMultipleAllocations")
    if shared not in (None, True, False):
        problems.append(f"{where}: allowMultipleAllocations {shared!r} is not a bool")
    for key, value in capacity.items():
        if not _qualified_name(key):
            problems.append(f"{where}.capacity: bad name {key!r}")
        try:
            total = quantity(value.get("value"))
        except (ValueError, AttributeError):
            problems.append(f"{where}.capacity[{key}]: bad quantity {value!r}")
            continue
        policy = value.get("requestPolicy")
        if policy is None:
            continue
        if shared is not True:
            problems.append(f"{where}.capacity[{key}].requestPolicy: allowMultipleAllocations "
                            "must be true")
        else:
            _check_request_policy(f"{where}.capacity[{key}].requestPolicy", policy, total,
                                  problems)
    _check_taints(where, device.get("taints") or [], rules, problems)


def _quantities(where: str, policy: dict[str, Any], names: Sequence[str],
                problems: list[str]) -> dict[str, Decimal]:
    """The quantities of ``policy`` under ``names`` that are set; bad ones reported."""
    found: dict[str, Decimal] = {}
    for name in names:
        if policy.get(name) is None:
            continue
        try:
            found[name] = quantity(policy[name])
        except ValueError:
            problems.append(f"{where}.{name}: bad quantity {policy[name]!r}")
    return found


def _check_request_policy(where: str, policy: Any, total: Decimal,
                          problems: list[str]) -> None:
    """The server's ``validateRequestPolicy`` for one capacity of value ``total``."""
    if not isinstance(policy, dict):
        problems.append(f"{where}: {policy!r} is not an object")
        return
    values, span = policy.get("validValues") or [], policy.get("validRange")
    if values and span is not None:
        problems.append(f"{where}: validValues and validRange cannot both be given")
        return
    if not values and span is None:
        return
    default = _quantities(where, policy, ("default",), problems).get("default")
    if default is None:
        problems.append(f"{where}.default: required with validValues or validRange")
        return
    if values:
        options = [_quantities(f"{where}.validValues[{i}]", {"v": v}, ("v",), problems)
                   .get("v") for i, v in enumerate(values)]
        known = [v for v in options if v is not None]
        if len(values) > MAX_VALID_VALUES:
            problems.append(f"{where}.validValues: {len(values)} values (at most "
                            f"{MAX_VALID_VALUES})")
        if known != sorted(known):
            problems.append(f"{where}.validValues: not in ascending order")
        if any(v > total for v in known):
            problems.append(f"{where}.validValues: a value above the capacity {total}")
        if default not in known:
            problems.append(f"{where}.validValues: the default {default} is not among them")
        return
    if not isinstance(span, dict):
        problems.append(f"{where}.validRange: {span!r} is not an object")
        return
    bounds = _quantities(f"{where}.validRange", span, ("min", "max", "step"), problems)
    low, high, step = bounds.get("min"), bounds.get("max"), bounds.get("step")
    if low is None:
        problems.append(f"{where}.validRange.min: required")
        return
    if low > total:
        problems.append(f"{where}.validRange.min: {low} is above the capacity {total}")
    if default < low:
        problems.append(f"{where}.default: {default} is below min {low}")
    if high is not None:
        if low > high:
            problems.append(f"{where}.validRange.max: min {low} is above max {high}")
        if high > total:
            problems.append(f"{where}.validRange.max: {high} is above the capacity {total}")
        if default > high:
            problems.append(f"{where}.default: {default} is above max {high}")
    if step is not None:
        if step <= 0:
            problems.append(f"{where}.validRange.step: {step} must be positive")
            return
        if low + step > total:
            problems.append(f"{where}.validRange.step: min + step ({low + step}) is above "
                            f"the capacity {total}")
        for name, value in (("default", default), ("max", high)):
            if value is not None and (value - low) % step:
                problems.append(f"{where}.{name if name == 'default' else 'validRange.max'}:"
                                f" {value} is not a whole number of steps ({step}) above "
                                f"min {low}")


def _has_lists(device: dict[str, Any]) -> bool:
    return any(isinstance(v, dict) and any(k in v for k in _LISTS)
               for v in (device.get("attributes") or {}).values())


def _check_spec_fields(where: str, spec: dict[str, Any], rules: Rules,
                       problems: list[str]) -> None:
    """The 1.37 fields: ``partitionTypeAttribute`` and ``skipNodeOperations``."""
    partition = spec.get("partitionTypeAttribute")
    if partition is not None:
        if not rules.partition_type_attribute:
            problems.append(f"{where}: partitionTypeAttribute needs Kubernetes 1.37 or newer")
        else:
            _check_partition_type(where, str(partition), spec, problems)
    skip = spec.get("skipNodeOperations")
    if skip is not None:
        if not rules.skip_node_operations:
            problems.append(f"{where}: skipNodeOperations needs Kubernetes 1.37 or newer")
        elif not isinstance(skip, list) or any(op not in _SKIP_OPERATIONS for op in skip):
            problems.append(f"{where}: skipNodeOperations {skip!r} has an unknown operation")
        elif "NodePrepareResources" in skip and not {"NodeUnprepareResources", "*"} & set(skip):
            problems.append(f"{where}: NodePrepareResources cannot be skipped unless "
                            "NodeUnprepareResources is also skipped")


def _check_partition_type(where: str, name: str, spec: dict[str, Any],
                          problems: list[str]) -> None:
    consuming = [d for d in spec.get("devices") or [] if d.get("consumesCounters")]
    if not consuming:
        problems.append(f"{where}: partitionTypeAttribute may only be set on a slice with "
                        "devices that consume counters")
        return
    if "/" not in name or not _qualified_name(name):
        problems.append(f"{where}: partitionTypeAttribute {name!r} is not a fully qualified "
                        "attribute name")
        return
    bare = name.removeprefix(f"{spec.get('driver', '')}/")
    for device in consuming:
        attributes = device.get("attributes") or {}
        value = attributes.get(name, attributes.get(bare) if bare != name else None)
        if value is None:
            problems.append(f"{where} device {device.get('name')}: consumes counters, so it "
                            f"must carry the partition type attribute {name!r}")
        elif not isinstance(value, dict) or "string" not in value:
            problems.append(f"{where} device {device.get('name')}: {name!r} must be a string "
                            "(partitionTypeAttribute names it)")


def check(slices: Sequence[dict[str, Any]], kubernetes: tuple[int, int]) -> list[str]:
    """Every rule above that ``slices`` (one pool) break, for this Kubernetes version."""
    problems: list[str] = []
    rules = rules_for(kubernetes)
    v135 = rules.counters_apart
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
        advanced = rules.advanced_device_limit and any(
            d.get("consumesCounters") or d.get("taints") or (rules.list_attributes
                                                             and _has_lists(d))
            for d in devices)
        limit = MAX_DEVICES_WITH_ADVANCED_FEATURES if advanced else MAX_DEVICES
        if len(devices) > limit:
            why = (" once devices consume counters, have taints or list attributes"
                   if advanced else "")
            problems.append(f"{where}: {len(devices)} devices (at most {limit}{why})")
        _check_spec_fields(where, spec, rules, problems)
        for d, device in enumerate(devices):
            name = str(device.get("name", ""))
            if name in device_names:
                problems.append(f"{where}: device {name!r} appears twice in the pool")
            device_names.add(name)
            _check_device(f"{where}.devices[{d}] {name}", device, rules, problems)
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
