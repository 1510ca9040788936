"""From a ResourceClaim to the agent's claims API and back to kubelet's answer (pure).

A claim may hold devices of several drivers, and of this driver on other nodes' pools (a
network-attached pool, or a claim shared across nodes): only the allocation results of this
driver *and* this node's pool are the agent's to prepare (NVIDIA's plugin once checkpointed
other drivers' results, PR #1371).

Shares (consumable capacity): a result with a ``shareID`` is one share of a shareable GPU;
two shares of one device in a claim are two devices. Its ``consumedCapacity.memory`` and
``shareID`` go to the agent as the device's ``capacity`` and ``share_id``, and the share ID
the agent answers goes back to kubelet (the v1 protocol's ``share_id``).

Sharing configs: the allocation's opaque device configs (``status.allocation.devices.config``)
for this driver carry ``resource.nodeagent.dev/v1beta1`` ``GpuConfig`` or
``MigDeviceConfig`` objects whose ``sharing`` is NVIDIA's shape (``resource.nvidia.com``: a
claim ports by changing the apiVersion and the driver). They are decoded strictly (an
unknown field is an error, and a ``MigDeviceConfig`` has no ``timeSlicingConfig``), the
class's configs before the claim's, and the last that applies to a device wins; a config
naming ``requests`` applies to the devices of those requests (``<request>`` covers its
subrequests) and must be of the device's kind, one naming none applies to every device of its
kind. The device's ``sharing`` then goes to the agent as it is: the agent validates the
values. Opaque configs of other drivers are not ours and are ignored.

Shapes: every part of the ResourceClaim read here is checked for its JSON type before it is
used (``results`` an array of objects, ``device`` a string, ...), and so is the agent's
answer: a claim of the wrong shape is a :class:`ClaimError` naming the field
(``status.allocation.devices.results[2].device: want a string, got number``), never a
``TypeError`` from deep inside. Device names go to the agent as ResourceSlice device names
(``device_names: resourceslice``): a name like ``0`` or a UUID, which the agent would
otherwise take for an index or a UUID and answer under another name, is refused by the agent
before it holds anything.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.device_names import parse_device_name

#: The agent's longest request name (a DNS label); a longer ``<request>/<subrequest>`` is not
#: sent as the name (the plugin keeps the request names itself).
MAX_AGENT_REQUEST_NAME = 63
#: The most allocation results a ResourceClaim has (resource.k8s.io's
#: ``AllocationResultsMaxSize``, 1.34 to 1.37): more is counted and refused before any is
#: mapped.
MAX_RESULTS = 32
#: A namespace is a DNS-1123 label; a claim's name a DNS-1123 subdomain (each dot-separated
#: part a label); a UID kubelet sends is the server's (a UUID), never a path.
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_NAMESPACE = re.compile(rf"{_LABEL}\Z")
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
#: The project's own config API (NVIDIA's is ``resource.nvidia.com/v1beta1``).
CONFIG_API_VERSION = "resource.nodeagent.dev/v1beta1"
GPU_CONFIG, MIG_CONFIG = "GpuConfig", "MigDeviceConfig"
#: The fields each part of a config may have (NVIDIA's names); anything else is refused.
_CONFIG_FIELDS = {"apiVersion", "kind", "sharing"}
_SHARING_FIELDS = {GPU_CONFIG: {"strategy", "timeSlicingConfig", "mpsConfig"},
                   MIG_CONFIG: {"strategy", "mpsConfig"}}
_NESTED_FIELDS = {
    "timeSlicingConfig": {"interval"},
    "mpsConfig": {"defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                  "defaultPerDevicePinnedMemoryLimit"},
}


class ClaimError(Exception):
    """One claim cannot be prepared or unprepared; ``reason`` is a short stable label (the
    metrics' ``reason``), the message says what kubelet shows in the pod's events."""

    def __init__(self, reason: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True)
class KubeletClaim:
    """A claim as kubelet names it in a prepare or unprepare call."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"[:400]


def check_uid(claim: KubeletClaim) -> None:
    """:class:`ClaimError` unless the claim's UID is a plain token (it goes into the agent's
    URL paths)."""
    if not (isinstance(claim.uid, str) and _UID.match(claim.uid)):
        raise ClaimError("bad-claim-name", f"claim {claim}: its uid {claim.uid!r:.80} from "
                                           "kubelet is not letters, digits, '.', '_' and '-'")


def check_names(claim: KubeletClaim) -> None:
    """:class:`ClaimError` unless the claim's namespace is a DNS-1123 label, its name a
    DNS-1123 subdomain (253 characters at most) and its UID a plain token: they go into URL
    paths of the API server and the agent, where a ``/`` or ``..`` would name another
    object."""
    for field, value, pattern, what in (
            ("namespace", claim.namespace, _NAMESPACE, "a DNS-1123 label"),
            ("name", claim.name, _NAME, "a DNS-1123 subdomain"),
            ("uid", claim.uid, _UID, "letters, digits, '.', '_' and '-'")):
        if not (isinstance(value, str) and pattern.match(value)
                and (field != "name" or len(value) <= 253)):
            raise ClaimError("bad-claim-name", f"claim {claim}: its {field} {value!r:.80} from "
                                               f"kubelet is not {what}")


@dataclass(frozen=True)
class Allocated:
    """One device of this driver and pool in the claim's allocation, with every request of
    the claim it serves."""

    device: str
    pool: str
    requests: tuple[str, ...]
    admin_access: bool
    share_id: str | None = None
    """The allocation's ``shareID``: this is one share of a shareable device."""
    memory: str | None = None
    """The share's ``consumedCapacity.memory`` (a quantity, as the server wrote it)."""
    sharing: Mapping[str, Any] | None = None
    """The ``sharing`` of the config that applies to it (:func:`with_configs`)."""


@dataclass(frozen=True)
class KubeletDevice:
    """The plugin's record of one device the agent prepared for a claim, as kubelet's answer
    names it (its requests, pool, device and CDI names; not the agent's own
    ``agent.claims.checkpoint.PreparedDevice``)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


def _json_kind(value: Any) -> str:
    """The JSON name of ``value``'s type, as an error message shows it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _wrong(claim: KubeletClaim, reason: str, where: str, want: str, value: Any) -> ClaimError:
    return ClaimError(reason, f"claim {claim}: {where}: want {want}, got {_json_kind(value)}")


def _object(claim: KubeletClaim, where: str, value: Any,
            reason: str = "bad-allocation") -> Mapping[str, Any]:
    """``value`` as an object; absent (null) is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _wrong(claim, reason, where, "an object", value)
    return value


def _array(claim: KubeletClaim, where: str, value: Any,
           reason: str = "bad-allocation") -> Sequence[Any]:
    """``value`` as an array; absent (null) is an empty one."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _wrong(claim, reason, where, "an array", value)
    return value


def _string(claim: KubeletClaim, where: str, value: Any,
            reason: str = "bad-allocation") -> str | None:
    """``value`` as a string, or None when absent."""
    if value is None or isinstance(value, str):
        return value
    raise _wrong(claim, reason, where, "a string", value)


def _name(claim: KubeletClaim, where: str, value: Any, reason: str) -> str:
    """``value`` as a string that is not empty (an entry of a list of names)."""
    if not isinstance(value, str) or not value:
        raise _wrong(claim, reason, where, "a name (a non-empty string)", value)
    return value


def _allocation(claim: KubeletClaim, obj: Any) -> Mapping[str, Any]:
    """The claim's ``status.allocation``, after its UID is checked; :class:`ClaimError` when
    ``obj`` is another claim of the same name, not allocated, or not the shape of one."""
    if not isinstance(obj, Mapping):
        raise _wrong(claim, "bad-claim", "the API server's ResourceClaim", "an object", obj)
    meta = _object(claim, "metadata", obj.get("metadata"), "bad-claim")
    if meta.get("uid") != claim.uid:
        raise ClaimError("uid-mismatch",
                         f"claim {claim}: the API server's {claim.namespace}/{claim.name} has "
                         f"UID {meta.get('uid')!r} (deleted and created again?)")
    allocation = _object(claim, "status", obj.get("status"), "bad-claim").get("allocation")
    if allocation is None or allocation == {}:
        raise ClaimError("not-allocated", f"claim {claim}: not allocated", retryable=True)
    return _object(claim, "status.allocation", allocation)


def allocation_results(claim: KubeletClaim, obj: Any) -> list[Mapping[str, Any]]:
    """The allocation results of the ResourceClaim ``obj``, each an object; :class:`ClaimError`
    when it is another claim of the same name, not allocated, over the API's limit or of the
    wrong shape (naming the field)."""
    where = "status.allocation.devices"
    devices = _object(claim, where, _allocation(claim, obj).get("devices"))
    results = _array(claim, f"{where}.results", devices.get("results"))
    if len(results) > MAX_RESULTS:
        raise ClaimError("bad-allocation", f"claim {claim}: {where}.results has {len(results)} "
                                           f"entries, over the API's limit of {MAX_RESULTS}")
    for i, result in enumerate(results):
        if not isinstance(result, Mapping):
            raise _wrong(claim, "bad-allocation", f"{where}.results[{i}]", "an object", result)
    return list(results)


def our_devices(claim: KubeletClaim, obj: Mapping[str, Any], *, driver: str,
                pool: str) -> list[Allocated]:
    """The devices of the ResourceClaim ``obj`` that this node's agent prepares, in allocation
    order; a result naming the same device twice (two requests sharing it) is one device
    serving both, unless they are shares (a ``shareID`` each). :class:`ClaimError` when the
    object is another claim of the same name (deleted and recreated), is not allocated, holds
    nothing of ours, or a part of it read here has the wrong shape (naming the field)."""
    where = "status.allocation.devices"
    results = allocation_results(claim, obj)
    found: dict[tuple[str, str | None], Allocated] = {}
    for i, result in enumerate(results):
        at = f"{where}.results[{i}]"
        if result.get("driver") != driver or result.get("pool") != pool:
            continue
        name = _string(claim, f"{at}.device", result.get("device"))
        request = _string(claim, f"{at}.request", result.get("request"))
        if not name or not request:
            raise ClaimError("bad-allocation",
                             f"claim {claim}: {at}: an allocation result of {driver} names no "
                             "device or request")
        admin = result.get("adminAccess")
        if admin is not None and not isinstance(admin, bool):
            raise _wrong(claim, "bad-allocation", f"{at}.adminAccess", "a boolean", admin)
        share_id = _string(claim, f"{at}.shareID", result.get("shareID")) or None
        consumed = _object(claim, f"{at}.consumedCapacity", result.get("consumedCapacity"))
        memory = consumed.get("memory")
        if memory is not None and (isinstance(memory, bool) or
                                   not isinstance(memory, str | int)):
            raise _wrong(claim, "bad-allocation", f"{at}.consumedCapacity.memory",
                         "a quantity (a string like '10Gi')", memory)
        key = (name, share_id)
        known = found.get(key)
        if known is None:
            found[key] = Allocated(name, pool, (request,), bool(admin), share_id=share_id,
                                   memory=str(memory) if memory is not None else None)
        elif request not in known.requests:
            # Exclusive as soon as one of its requests is.
            found[key] = replace(known, requests=(*known.requests, request),
                                 admin_access=known.admin_access and bool(admin))
    if not found:
        drivers = sorted({f"{r.get('driver')}/{r.get('pool')}" for r in results})
        raise ClaimError("no-devices",
                         f"claim {claim}: no device of driver {driver} in pool {pool} is "
                         f"allocated (allocated: {', '.join(drivers) or 'nothing'})")
    return list(found.values())


def _fields(claim: KubeletClaim, where: str, value: Any, allowed: Collection[str],
            kind: str) -> Mapping[str, Any]:
    """``value`` as an object with only ``allowed`` fields (strict decode)."""
    if not isinstance(value, Mapping):
        raise ClaimError("bad-config", f"claim {claim}: {where}: a {kind} wants an object "
                                       f"here, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ClaimError("bad-config", f"claim {claim}: {where}: unknown field "
                                       f"{unknown[0]!r} in a {kind} (known: "
                                       f"{', '.join(sorted(allowed))})")
    return value


def decode_config(claim: KubeletClaim, where: str, parameters: Any) -> tuple[str, Any]:
    """(kind, its ``sharing`` or None) of one opaque config of this driver; :class:`ClaimError`
    naming ``where`` and the field for anything but a strict ``GpuConfig`` or
    ``MigDeviceConfig`` of :data:`CONFIG_API_VERSION`."""
    if not isinstance(parameters, Mapping):
        raise ClaimError("bad-config", f"claim {claim}: {where}: parameters must be an object "
                                       f"with apiVersion {CONFIG_API_VERSION}")
    version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if version != CONFIG_API_VERSION or kind not in _SHARING_FIELDS:
        raise ClaimError("bad-config", f"claim {claim}: {where}: apiVersion {version!r} kind "
                                       f"{kind!r} is not a config of this driver (want "
                                       f"{CONFIG_API_VERSION} {GPU_CONFIG} or {MIG_CONFIG})")
    _fields(claim, where, parameters, _CONFIG_FIELDS, kind)
    sharing = parameters.get("sharing")
    if sharing is None:
        return kind, None
    _fields(claim, f"{where}.sharing", sharing, _SHARING_FIELDS[kind], kind)
    for name, allowed in _NESTED_FIELDS.items():
        if sharing.get(name) is not None:
            nested = _fields(claim, f"{where}.sharing.{name}", sharing[name], allowed, kind)
            limits = nested.get("defaultPerDevicePinnedMemoryLimit")
            if limits is not None and not isinstance(limits, Mapping):
                raise ClaimError("bad-config", f"claim {claim}: {where}.sharing.{name}."
                                               "defaultPerDevicePinnedMemoryLimit: a map of "
                                               "device (UUID or index) to quantity")
    return kind, dict(sharing)


def _applies(requests: Sequence[str], device: Allocated) -> bool:
    return any(r in requests or r.partition("/")[0] in requests for r in device.requests)


def with_configs(claim: KubeletClaim, obj: Mapping[str, Any], devices: Sequence[Allocated],
                 *, driver: str) -> list[Allocated]:
    """``devices`` with the ``sharing`` of the last of this driver's opaque configs that
    applies to each (the module docstring says which); :class:`ClaimError` for a config of
    this driver that is not ours or applies to a device of the other kind."""
    at = "status.allocation.devices"
    allocated = _object(claim, at, _allocation(claim, obj).get("devices"))
    entries = _array(claim, f"{at}.config", allocated.get("config"))
    decoded: list[tuple[int, str, tuple[str, ...], str, Any]] = []
    for i, raw in enumerate(entries):
        field = f"{at}.config[{i}]"
        entry = _object(claim, field, raw, "bad-config")
        opaque = _object(claim, f"{field}.opaque", entry.get("opaque"), "bad-config")
        if opaque.get("driver") != driver:
            continue
        source = _string(claim, f"{field}.source", entry.get("source"), "bad-config")
        where = f"config[{i}] ({source or 'FromClaim'})"
        kind, sharing = decode_config(claim, f"{where} parameters", opaque.get("parameters"))
        named = _array(claim, f"{field}.requests", entry.get("requests"), "bad-config")
        requests = tuple(_name(claim, f"{field}.requests[{j}]", r, "bad-config")
                         for j, r in enumerate(named))
        # The class's configs come first, then the claim's: the claim's win.
        decoded.append((0 if source == "FromClass" else 1, where, requests, kind, sharing))
    decoded.sort(key=lambda d: d[0])
    out = []
    for device in devices:
        parsed = parse_device_name(device.device)
        mine = MIG_CONFIG if parsed is not None and parsed.profile is not None else GPU_CONFIG
        chosen = None
        for _, where, requests, kind, sharing in decoded:
            if requests and not _applies(requests, device):
                continue
            if kind != mine:
                if requests:
                    raise ClaimError("bad-config", f"claim {claim}: {where}: cannot apply a "
                                                   f"{kind} to {device.device} (request "
                                                   f"{', '.join(device.requests)}), which "
                                                   f"takes a {mine}")
                continue
            chosen = sharing
        out.append(replace(device, sharing=chosen) if chosen is not None else device)
    return out


def agent_body(claim: KubeletClaim, obj: Mapping[str, Any], devices: Sequence[Allocated],
               issued_at_ns: int, on_demand: Collection[str] = ()) -> dict[str, Any]:
    """The ``PUT /v1/claims/{uid}`` body: each device by its ResourceSlice name (and the
    agent told so, ``device_names``), as an existing device or (named in ``on_demand``: a
    partitionable MIG device) a slice to make, request names kept, ``admin_access`` for
    monitoring access; the claim's namespace, name, resourceVersion and only pod; and when
    kubelet's call arrived (``issued_at_ns``, CLOCK_BOOTTIME). :class:`ClaimError` naming a
    field of ``metadata`` or ``status.reservedFor`` of the wrong shape."""
    entries: list[dict[str, Any]] = []
    for device in devices:
        entry: dict[str, Any] = {"kind": "slice" if device.device in on_demand else "gpu",
                                 "device": device.device}
        if len(device.requests[0]) <= MAX_AGENT_REQUEST_NAME:
            entry["name"] = device.requests[0]
        if device.admin_access:
            entry["admin_access"] = True
        if device.memory is not None:
            entry["capacity"] = {"memory": device.memory}
        if device.share_id is not None:
            entry["share_id"] = device.share_id
        if device.sharing is not None:
            entry["sharing"] = dict(device.sharing)
        entries.append(entry)
    return {"devices": entries, "metadata": _metadata(claim, obj),
            "issued_at_ns": issued_at_ns, "device_names": "resourceslice"}


def domain_body(claim: KubeletClaim, obj: Mapping[str, Any], domain: str, request: str,
                issued_at_ns: int) -> dict[str, Any]:
    """The ``PUT /v1/claims/{uid}`` body of a compute-domain claim on this node: the node's
    IMEX channel for ``domain`` (the claim's UID), under the domain's request name."""
    entry: dict[str, Any] = {"kind": "imex-channel", "domain": domain}
    if request and len(request) <= MAX_AGENT_REQUEST_NAME:
        entry["name"] = request
    return {"devices": [entry], "metadata": _metadata(claim, obj),
            "issued_at_ns": issued_at_ns}


def _metadata(claim: KubeletClaim, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The claim's namespace, name, resourceVersion and only pod, as the agent records them."""
    meta = _object(claim, "metadata", obj.get("metadata"), "bad-claim")
    metadata = {}
    for key, field in (("namespace", "namespace"), ("name", "name"),
                       ("resource_version", "resourceVersion")):
        if value := _string(claim, f"metadata.{field}", meta.get(field), "bad-claim"):
            metadata[key] = value
    status = _object(claim, "status", obj.get("status"), "bad-claim")
    pods = []
    for i, raw in enumerate(_array(claim, "status.reservedFor", status.get("reservedFor"),
                                   "bad-claim")):
        ref = _object(claim, f"status.reservedFor[{i}]", raw, "bad-claim")
        name = _string(claim, f"status.reservedFor[{i}].name", ref.get("name"), "bad-claim")
        if ref.get("resource") == "pods" and name:
            pods.append(name)
    if len(pods) == 1:  # a shared claim has many consumers: none is "the" pod
        metadata["pod"] = pods[0]
    return metadata


def kubelet_devices(claim: KubeletClaim, devices: Sequence[Allocated],
                    answer: Mapping[str, Any]) -> list[KubeletDevice]:
    """Kubelet's devices for the agent's ``answer`` to :func:`agent_body`: each allocated
    device with its requests, the CDI names the agent wrote for it and, for a share, the
    share ID the agent answers (``share.share_id`` of its device)."""
    cdi: dict[tuple[str, str | None], list[str]] = {}
    for i, raw in enumerate(_array(claim, "the agent's answer: devices",
                                   answer.get("devices"), "agent-answer")):
        at = f"the agent's answer: devices[{i}]"
        prepared = _object(claim, at, raw, "agent-answer")
        share = _object(claim, f"{at}.share", prepared.get("share"), "agent-answer")
        share_id = _string(claim, f"{at}.share.share_id", share.get("share_id"),
                           "agent-answer")
        name = _string(claim, f"{at}.device_name", prepared.get("device_name"), "agent-answer")
        listed = _array(claim, f"{at}.cdi_devices", prepared.get("cdi_devices"), "agent-answer")
        cdi.setdefault((name or "", share_id or None), []).extend(
            _name(claim, f"{at}.cdi_devices[{j}]", n, "agent-answer")
            for j, n in enumerate(listed))
    out = []
    for device in devices:
        names = cdi.get((device.device, device.share_id))
        share_id = device.share_id
        if not names:
            # One answer for the device, with a share ID on one side only: a share of all of
            # a GPU the agent prepares as the whole GPU, or a share ID the agent assigned.
            answered = [key for key in cdi if key[0] == device.device]
            if len(answered) == 1 and None in (answered[0][1], device.share_id):
                names, share_id = cdi[answered[0]], answered[0][1] or device.share_id
        if not names:
            which = device.device + (f" (share {device.share_id})" if device.share_id else "")
            raise ClaimError("agent-answer", f"claim {claim}: the agent's answer has no CDI "
                                             f"device for {which}")
        out.append(KubeletDevice(device.requests, device.pool, device.device, tuple(names),
                                  share_id=share_id))
    return out


def channel_cdi(claim: KubeletClaim, answer: Mapping[str, Any]) -> tuple[str, ...]:
    """The CDI names of the agent's answer to :func:`domain_body` (its channel device's)."""
    names: list[str] = []
    for i, raw in enumerate(_array(claim, "the agent's answer: devices",
                                   answer.get("devices"), "agent-answer")):
        at = f"the agent's answer: devices[{i}]"
        prepared = _object(claim, at, raw, "agent-answer")
        listed = _array(claim, f"{at}.cdi_devices", prepared.get("cdi_devices"), "agent-answer")
        names.extend(_name(claim, f"{at}.cdi_devices[{j}]", n, "agent-answer")
                     for j, n in enumerate(listed))
    if not names:
        raise ClaimError("agent-answer", f"claim {claim}: the agent's answer has no CDI device "
                                         "for the IMEX channel")
    return tuple(dict.fromkeys(names))
