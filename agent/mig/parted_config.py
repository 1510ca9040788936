"""mig-parted ``version: v1`` configs as values: parse and validate one, select what each GPU
of a node gets under a label, export the current layout as one, and build the standard configs
mig-parted's ``generate-config`` emits for a GPU model (``reference/mig.md`` §3).

Pure: no NVML and no I/O besides parsing text. Every problem with a config is an
:class:`~agent.errors.InvalidRequest` whose ``errors`` name the field by its path in the config
(``mig-configs.all-balanced[0].mig-devices``) and the reason.

The format::

    version: v1
    mig-configs:
      <label>:
        - device-filter: "0x233010DE"      # optional: string or list, 0xDDDDVVVV[:0xSSSSVVVV]
          devices: all                      # "all" or a list of GPU indices
          mig-enabled: true
          mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from agent.errors import InvalidRequest
from agent.mig.geometry import (
    Catalog,
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    join_words,
)
from agent.mig.parted_yaml import load_yaml, shown

VERSION = "v1"

# --- profile names and device filters ------------------------------------------------------

_ATTRIBUTES = ("me", "me.all", "gfx")
_NUM = r"[1-9][0-9]*"
_PROFILE = re.compile(
    rf"(?:(?P<c>{_NUM})c\.)?(?P<g>{_NUM})g\.(?P<gb>{_NUM})gb"
    r"(?:\+(?P<attrs>[a-z.]+(?:,[a-z.]+)*)|-(?P<neg>[a-z.]+))?")
_PROFILE_FORMAT = "[<C>c.]<G>g.<GB>gb[+attr[,attr]] or [<C>c.]<G>g.<GB>gb-attr"
_FILTER = re.compile(r"0[xX](?P<id>[0-9a-fA-F]{8})(?::0[xX](?P<sub>[0-9a-fA-F]{8}))?")


def profile_name_problem(name: str) -> str | None:
    """Why ``name`` is not a mig-parted profile string, or None if it is one."""
    m = _PROFILE.fullmatch(name)
    if not m:
        return f"{shown(name)} is not a MIG profile ({_PROFILE_FORMAT})"
    attrs = m["attrs"].split(",") if m["attrs"] else [m["neg"]] if m["neg"] else []
    unknown = [a for a in attrs if a not in _ATTRIBUTES]
    if unknown:
        return (f"{shown(name)} has unknown attribute {shown(unknown[0])} "
                f"(known: {join_words(_ATTRIBUTES, 'and')})")
    if len(set(attrs)) != len(attrs):
        return f"{shown(name)} repeats an attribute"
    return None


def normalize_profile(name: str) -> str:
    """The catalog spelling of a valid profile string: ``7c.7g.80gb`` is ``7g.80gb`` (a compute
    instance as large as its GPU instance is the plain profile, as in mig-parted)."""
    m = _PROFILE.fullmatch(name)
    if m and m["c"] is not None and m["c"] == m["g"]:
        return name[len(m["c"]) + 2:]
    return name


def config_label(profile: str) -> str:
    """The label ``generate-config`` gives the all-``profile`` config: ``+`` becomes ``.``
    (``all-1g.10gb.me``)."""
    return "all-" + profile.replace("+", ".")


@dataclass(frozen=True)
class DeviceFilter:
    """One ``device-filter`` item: the packed PCI device id (device id in the high 16 bits,
    vendor in the low, as NVML's ``pciDeviceId``), and the packed subsystem id when given."""

    device_id: int
    subsystem_id: int | None = None

    @classmethod
    def parse(cls, text: str) -> DeviceFilter:
        m = _FILTER.fullmatch(text)
        if not m:
            raise ValueError(f"{shown(text)} is not a PCI id "
                             "(0xDDDDVVVV or 0xDDDDVVVV:0xSSSSVVVV)")
        return cls(int(m["id"], 16), int(m["sub"], 16) if m["sub"] else None)

    def matches(self, gpu: GpuIdentity) -> bool:
        """Exact match of the device id, and of the subsystem id if the filter names one."""
        return self.device_id == gpu.pci_device_id and (
            self.subsystem_id is None or self.subsystem_id == gpu.pci_subsystem_id)

    def __str__(self) -> str:
        sub = "" if self.subsystem_id is None else f":0x{self.subsystem_id:08X}"
        return f"0x{self.device_id:08X}{sub}"


@dataclass(frozen=True)
class GpuIdentity:
    """What a config entry matches a GPU on: its index and PCI ids as NVML reports them
    (``pci_device_id`` 0x233010DE is an H100 SXM: device 0x2330, vendor 0x10DE), and whether
    it can do MIG at all (an L40S cannot), which decides whether a selected GPU is skipped."""

    index: int
    pci_device_id: int
    pci_subsystem_id: int
    mig_capable: bool = True


# --- the config model ----------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class MigConfigEntry(BaseModel):
    """One entry of a label: which GPUs (``devices`` and ``device-filter``) get which state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: Literal["all"] | tuple[int, ...]
    device_filter: str | tuple[str, ...] | None = Field(default=None, alias="device-filter")
    mig_enabled: bool = Field(alias="mig-enabled")
    mig_devices: dict[str, int] | None = Field(
        default=None, alias="mig-devices", validate_default=True)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v == "all":
                return v
            raise ValueError(f'must be "all" or a list of GPU indices, got {shown(v)}')
        if _is_int(v):
            raise ValueError(f"must be a list of GPU indices such as [{v}] or \"all\"; "
                             "a bare number is not accepted")
        if not isinstance(v, list | tuple):
            raise ValueError(f'must be "all" or a list of GPU indices, got {shown(v)}')
        problems = [f"{shown(i)} is not a GPU index (a whole number ≥ 0)"
                    for i in v if not _is_int(i) or i < 0]
        twice = sorted({i for i in v if _is_int(i) and v.count(i) > 1})
        if twice:
            problems.append(f"GPU {join_words(twice)} listed more than once")
        if problems:
            raise ValueError("; ".join(problems))
        return tuple(v)

    @field_validator("device_filter", mode="before")
    @classmethod
    def _device_filter(cls, v: Any) -> Any:
        if v is None:
            return None
        items = v if isinstance(v, list | tuple) else [v]
        if not isinstance(v, str | int | list | tuple) or isinstance(v, bool):
            raise ValueError(f"must be a PCI id or a list of them, got {shown(v)}")
        if not items:
            raise ValueError("must name at least one PCI id (leave it out to match every GPU)")
        problems = []
        for item in items:
            if _is_int(item) and 0 <= item < 1 << 32:  # YAML reads an unquoted 0x... as a number
                problems.append(f"{item} is a number; quote the PCI id: \"0x{item:08X}\"")
                continue
            if not isinstance(item, str):
                problems.append(f"{shown(item)} is not a PCI id string such as \"0x233010DE\"")
                continue
            try:
                DeviceFilter.parse(item)
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        return v if isinstance(v, str) else tuple(items)

    @field_validator("mig_enabled", mode="before")
    @classmethod
    def _mig_enabled(cls, v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false, got {shown(v)}")
        return v

    @field_validator("mig_devices", mode="before")
    @classmethod
    def _mig_devices_format(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, Mapping):
            raise ValueError(f"must be a mapping of MIG profile to count, got {shown(v)}")
        problems = []
        for name, n in v.items():
            if not isinstance(name, str):
                problems.append(f"{shown(name)} is not a MIG profile ({_PROFILE_FORMAT})")
                continue
            problem = profile_name_problem(name)
            if problem:
                problems.append(problem)
            if not _is_int(n) or n < 0:
                problems.append(f"count of {name} must be a whole number ≥ 0, got {shown(n)}")
        if not problems and v and not any(v.values()):
            problems.append("all counts are 0; write {} for MIG enabled with no devices")
        if problems:
            raise ValueError("; ".join(problems))
        return dict(v)

    @field_validator("mig_devices")
    @classmethod
    def _mig_devices_mode(cls, v: dict[str, int] | None,
                          info: ValidationInfo) -> dict[str, int] | None:
        enabled = info.data.get("mig_enabled")
        if enabled is True and v is None:
            raise ValueError("required when mig-enabled is true ({} for no devices)")
        if enabled is False and v:
            raise ValueError("must be empty or absent when mig-enabled is false")
        return v

    @property
    def filters(self) -> tuple[DeviceFilter, ...]:
        """The parsed ``device-filter``; empty when there is none (every GPU passes)."""
        if self.device_filter is None:
            return ()
        items = (self.device_filter,) if isinstance(self.device_filter, str) \
            else self.device_filter
        return tuple(DeviceFilter.parse(i) for i in items)

    def matches(self, gpu: GpuIdentity) -> bool:
        """Whether ``gpu`` is one of this entry's GPUs: its index is in ``devices`` and its
        PCI ids pass the ``device-filter``."""
        if self.devices != "all" and gpu.index not in self.devices:
            return False
        filters = self.filters
        return not filters or any(f.matches(gpu) for f in filters)

    def desired(self) -> Desired:
        """The state this entry asks for; profile names in catalog spelling."""
        if not self.mig_enabled:
            return DesiredDisabled()
        counts: Counter[str] = Counter()
        for name, n in (self.mig_devices or {}).items():
            counts[normalize_profile(name)] += n
        return DesiredProfiles(dict(counts))


Entries = Annotated[list[MigConfigEntry], Field(min_length=1)]


class MigConfigFile(BaseModel):
    """A mig-parted ``version: v1`` config: labels, each a non-empty list of entries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal["v1"]
    mig_configs: Annotated[dict[str, Entries], Field(min_length=1)] = Field(alias="mig-configs")

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v != VERSION:
            raise ValueError(f'unsupported version {shown(v)}; only "{VERSION}" is known')
        return v

    @field_validator("mig_configs", mode="before")
    @classmethod
    def _labels(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            bad = [k for k in v if not isinstance(k, str) or not k]
            if bad:
                raise ValueError(f"label {shown(bad[0])} is not a non-empty string")
        return v

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.mig_configs)

    def to_dict(self) -> dict[str, Any]:
        """The config as mig-parted writes it (dashed keys, absent fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- parsing -------------------------------------------------------------------------------


# Field name -> the key the config spells it with (pydantic names a defaulted field by name).
_ALIASES = {"mig_configs": "mig-configs", "device_filter": "device-filter",
            "mig_enabled": "mig-enabled", "mig_devices": "mig-devices"}


def _path(loc: tuple[int | str, ...], *, known: bool = True) -> str:
    """``mig-configs.all-balanced[0].mig-devices`` from a pydantic error location (``known``:
    the last part is one of the model's fields, not an unknown key as the config spells it)."""
    out = ""
    for depth, part in enumerate(loc):
        if part == "[key]":
            continue
        if isinstance(part, int) and depth == 2:  # the entry's index in its label
            out += f"[{part}]"
        else:
            name = _ALIASES.get(str(part), part) if known and depth in (0, 3) else part
            out += ("." if out else "") + str(name)
    return out or "config"


# pydantic's error types for a key the model does not have.
_UNKNOWN = ("extra_forbidden", "invalid_key")
_ENTRY_FIELDS = "devices, device-filter, mig-enabled and mig-devices"


def _reason(error: Any) -> str:
    kind, loc = error["type"], error["loc"]
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "missing":
        return "required"
    if kind in _UNKNOWN:
        allowed = "version and mig-configs" if len(loc) == 1 else _ENTRY_FIELDS
        return f"unknown field; allowed: {allowed}"
    if kind == "too_short":
        return "needs at least one label" if len(loc) == 1 else "needs at least one entry"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping, got {shown(error['input'])}"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list of entries, got {shown(error['input'])}"
    return str(error["msg"])


def parse_config(source: Mapping[str, Any] | str) -> MigConfigFile:
    """A mig-parted v1 config from a JSON object or YAML (or JSON) text.

    :class:`InvalidRequest` for text that is not YAML (with the line), a document that is not a
    mapping, and every rule of the format, each error naming its field path and the reason.
    """
    data: Any = load_yaml(source) if isinstance(source, str) else source
    if not isinstance(data, Mapping):
        reason = "is empty" if data is None else f"must be a mapping, got {type(data).__name__}"
        raise InvalidRequest(f"mig-parted config {reason}",
                             errors=[{"field": "config", "reason": reason}])
    try:
        return MigConfigFile.model_validate(dict(data))
    except ValidationError as err:
        errors = [{"field": _path(e["loc"], known=e["type"] not in _UNKNOWN),
                   "reason": _reason(e)} for e in err.errors()]
        listed = "; ".join(f"{e['field']}: {e['reason']}" for e in errors)
        raise InvalidRequest(f"invalid mig-parted config: {listed}", errors=errors) from None


# --- selection -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """What a label asks of a node, as mig-parted reads it.

    ``desired``: GPU index -> the state the label gives a MIG-capable GPU, in index order
    (GPUs no entry matches are absent: left alone). ``skipped``: GPU index -> why a GPU
    without MIG that the label selects is left alone. ``missing``: indices the label lists
    that the node lacks (ignored)."""

    desired: dict[int, Desired]
    skipped: dict[int, str]
    missing: tuple[int, ...]


#: mig-parted's own words (its ``apply/mode.go``) for an explicit MIG-on of a GPU without MIG.
NOT_MIG_CAPABLE = "cannot set MIG mode on non MIG-capable GPU"


def selection(config: MigConfigFile, label: str, gpus: Sequence[GpuIdentity]) -> Selection:
    """What ``label`` asks of the node with ``gpus``, following mig-parted's rules.

    Each entry gives its state to every GPU whose index is in ``devices`` and whose PCI ids pass
    ``device-filter``. A GPU without MIG is skipped when its entry selects it through
    ``devices: all`` (a cluster-wide label such as the GPU Operator's ``all-disabled`` or
    ``all-balanced`` must work on every node) or a ``device-filter``, or says
    ``mig-enabled: false``; listed by index alone with ``mig-enabled: true`` it is refused.
    An index the node lacks is ignored and reported in ``missing``.

    :class:`InvalidRequest` for an unknown label, a GPU two entries match, and that refusal.
    """
    entries = config.mig_configs.get(label)
    if entries is None:
        labels = [shown(name) for name in config.labels[:10]]
        more = len(config.labels) - len(labels)
        known = join_words(labels) + (f" and {more} more" if more else "")
        raise InvalidRequest(f"unknown MIG config {label!r}; the config has {known}",
                             errors=[{"field": "label", "reason": f"must be one of: {known}"}])
    by_index = {g.index: g for g in gpus}
    if len(by_index) != len(gpus):
        raise ValueError(f"GPU indices repeat in {gpus!r}")
    errors: list[dict[str, Any]] = []
    missing: set[int] = set()
    chosen: dict[int, int] = {}  # GPU index -> the entry that selects it
    for n, entry in enumerate(entries):
        where = f"mig-configs.{label}[{n}]"
        if entry.devices != "all":
            missing.update(i for i in entry.devices if i not in by_index)
        for gpu in sorted(gpus, key=lambda g: g.index):
            if not entry.matches(gpu):
                continue
            if gpu.index in chosen:
                errors.append({"field": where,
                               "reason": f"GPU {gpu.index} is also selected by "
                                         f"mig-configs.{label}[{chosen[gpu.index]}]"})
                continue
            chosen[gpu.index] = n
    desired: dict[int, Desired] = {}
    skipped: dict[int, str] = {}
    for index in sorted(chosen):
        n = chosen[index]
        entry = entries[n]
        if by_index[index].mig_capable:
            desired[index] = entry.desired()
        elif entry.devices == "all":
            skipped[index] = "no MIG; skipped under devices: all"
        elif entry.device_filter is not None:
            skipped[index] = "no MIG; skipped under a device-filter"
        elif not entry.mig_enabled:
            skipped[index] = "no MIG; skipped as mig-enabled is false"
        else:
            errors.append({"field": f"mig-configs.{label}[{n}].devices", "gpu": index,
                           "reason": f"GPU {index} has no MIG: {NOT_MIG_CAPABLE} (a GPU "
                                     "without MIG is skipped only under devices: all, a "
                                     "device-filter or mig-enabled: false)"})
    if errors:
        listed = "; ".join(f"{e['field']}: {e['reason']}" for e in errors)
        raise InvalidRequest(f"MIG config {label!r} cannot be applied here: {listed}",
                             errors=errors)
    return Selection(desired, skipped, tuple(sorted(missing)))


def select(config: MigConfigFile, label: str,
           gpus: Sequence[GpuIdentity]) -> dict[int, Desired]:
    """GPU index -> the desired state ``label`` gives each MIG-capable GPU it selects (the
    ``desired`` part of :func:`selection`, whose rules and errors it shares)."""
    return selection(config, label, gpus).desired


def _names(desired: Desired) -> list[str]:
    if isinstance(desired, DesiredProfiles):
        return list(desired.counts)
    if isinstance(desired, DesiredInstances):
        return list(dict.fromkeys(name for name, _ in desired.instances))
    return []


def check_profiles(selection: Mapping[int, Desired], catalogs: Mapping[int, Catalog]) -> None:
    """:class:`InvalidRequest` unless every profile ``selection`` asks of a GPU is one its
    catalog offers (a GPU without a catalog, or with an empty one, cannot do MIG: only MIG
    disabled fits it). Each error names the GPU, the profile and the profiles the GPU
    offers."""
    errors: list[dict[str, Any]] = []
    for index, desired in sorted(selection.items()):
        catalog = catalogs.get(index)
        if catalog is None or not catalog.profiles:
            # No catalog, or an empty one (what NVML lists for a GPU without MIG): only MIG
            # disabled fits, and there is no list of profiles to offer instead.
            if not isinstance(desired, DesiredDisabled):
                errors.append({"field": "mig-devices", "gpu": index,
                               "reason": f"GPU {index} cannot do MIG"})
            continue
        for name in _names(desired):
            if catalog.knows(name):
                continue
            known = join_words(catalog.names)
            reason = f"GPU {index} offers no MIG profile {shown(name)}; it offers {known}"
            m = _PROFILE.fullmatch(name)
            if m and m["c"] is not None:
                reason += " (compute-instance sub-profiles are not supported)"
            errors.append({"field": "mig-devices", "gpu": index, "profile": name,
                           "known": list(catalog.names), "reason": reason})
    if errors:
        listed = "; ".join(e["reason"] for e in errors)
        raise InvalidRequest(f"unknown MIG profiles: {listed}", errors=errors)
