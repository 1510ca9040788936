"""MIG geometry as values: the profile catalog of a GPU, its instances, a desired state and a
plan. Everything here is pure: values in, values out, no NVML and no I/O.

A GPU that can do MIG has ``memory_slices`` (8) memory slices; a GPU instance occupies a run of
them (its :class:`~agent.gpu.types.Placement`), and only the runs NVML lists for its profile
(``reference/mig.md`` §1.2). Two instances may not share a slice, a profile has a maximum
instance count, and at most one instance on a GPU may carry the media extensions (``+me``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agent.errors import GeometryNotPlaceable, InvalidRequest
from agent.gpu.types import Placement

# --- words -------------------------------------------------------------------------------


def join_words(items: Sequence[object], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    words = [str(i) for i in items]
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} {last} {words[-1]}"


def _slices_word(n: int) -> str:
    return f"{n} memory slice" if n == 1 else f"{n} memory slices"


# --- catalog -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileSpec:
    """A GPU-instance profile of one GPU model, as NVML reports it.

    ``id`` is the device profile id (19, 20, 15, 14, 9, 5, 0) that create and placement calls
    take; ``slices`` the compute slices (the ``g`` of ``3g.40gb``); ``placements`` the runs of
    memory slices an instance may occupy (``nvmlDeviceGetGpuInstancePossiblePlacements``).
    """

    name: str
    id: int
    slices: int
    memory_mib: int
    multiprocessors: int
    max_instances: int
    placements: tuple[Placement, ...]
    media_extensions: bool = False

    @property
    def memory_slices(self) -> int:
        """Memory slices one instance occupies (a 3g takes 4 of 8, a 7g all 8)."""
        return max((p.size for p in self.placements), default=0)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(sorted({p.start for p in self.placements}))

    @property
    def size_key(self) -> tuple[int, int, int, str]:
        """Orders profiles by size: compute slices, then memory slices, then memory; the name
        only makes the order total. Sort descending for "largest first"."""
        return (self.slices, self.memory_slices, self.memory_mib, self.name)

    def allows(self, placement: Placement) -> bool:
        return placement in self.placements

    def placement_problem(self, placement: Placement) -> str | None:
        """Why ``placement`` is not a legal placement of this profile, or None if it is."""
        if self.allows(placement):
            return None
        if not self.placements:
            return f"{self.name} has no placement on this GPU"
        if placement.start not in self.starts:
            return (f"{self.name} may start only at {join_words(self.starts, 'or')} "
                    f"(asked {placement.start})")
        sizes = sorted({p.size for p in self.placements if p.start == placement.start})
        return (f"{self.name} at {placement.start} occupies "
                f"{join_words([_slices_word(s) for s in sizes], 'or')} "
                f"(asked {placement.start}:{placement.size})")


@dataclass(frozen=True)
class Catalog:
    """The MIG profiles one GPU offers, and how many memory slices it has."""

    profiles: tuple[ProfileSpec, ...]
    memory_slices: int = 8
    _by_name: Mapping[str, ProfileSpec] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict)
    _hash: int = field(init=False, repr=False, compare=False, hash=False, default=0)

    def __post_init__(self) -> None:
        by_name: dict[str, ProfileSpec] = {}
        ids: set[int] = set()
        for spec in self.profiles:
            if spec.name in by_name:
                raise ValueError(f"MIG profile {spec.name!r} listed twice in the catalog")
            if spec.id in ids:
                raise ValueError(f"MIG profile id {spec.id} listed twice in the catalog")
            for p in spec.placements:
                if p.start < 0 or p.size <= 0 or p.end > self.memory_slices:
                    raise ValueError(f"placement {p.start}:{p.size} of {spec.name} is outside "
                                     f"the {self.memory_slices} memory slices")
            by_name[spec.name] = spec
            ids.add(spec.id)
        object.__setattr__(self, "_by_name", MappingProxyType(by_name))
        # Computed once: the planner memoises on the catalog.
        object.__setattr__(self, "_hash", hash((self.profiles, self.memory_slices)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)

    def profile(self, name: str) -> ProfileSpec:
        """The profile called ``name``; :class:`InvalidRequest` naming the known ones otherwise."""
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self.names)
            raise InvalidRequest(
                f"unknown MIG profile {name!r}; this GPU offers {known}",
                errors=[{"field": "profile", "reason": f"must be one of: {known}"}],
            ) from None

    def knows(self, name: str) -> bool:
        return name in self._by_name

    def by_id(self, profile_id: int) -> ProfileSpec | None:
        """The profile with device profile id ``profile_id`` (19 for 1g), or None."""
        return next((p for p in self.profiles if p.id == profile_id), None)

    def largest_first(self) -> tuple[ProfileSpec, ...]:
        return tuple(sorted(self.profiles, key=lambda p: p.size_key, reverse=True))


# --- instances and geometry --------------------------------------------------------------


def _placement_to_dict(p: Placement) -> dict[str, int]:
    return {"start": p.start, "size": p.size}


def _placement_from_dict(data: Any) -> Placement:
    start, size = data["start"], data["size"]
    if not isinstance(start, int) or not isinstance(size, int) or isinstance(start, bool) \
            or isinstance(size, bool):
        raise ValueError(f"placement needs integer start and size, got {data!r}")
    return Placement(start=start, size=size)


def _mask(p: Placement) -> int:
    return ((1 << p.size) - 1) << p.start


@dataclass(frozen=True)
class Instance:
    """A GPU instance: its profile and placement. ``gi_id`` is None for one that does not
    exist yet; ``held`` marks one a prepared claim or a running process uses (the planner
    keeps those above everything)."""

    profile: str
    placement: Placement
    gi_id: int | None = None
    held: bool = False

    @property
    def key(self) -> tuple[str, Placement]:
        """What makes two instances the same layout: profile and placement."""
        return (self.profile, self.placement)

    @property
    def sort_key(self) -> tuple[int, str, int, int, bool]:
        return (self.placement.start, self.profile, self.placement.size,
                -1 if self.gi_id is None else self.gi_id, self.held)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Instance):
            return NotImplemented
        return self.sort_key < other.sort_key

    def __str__(self) -> str:
        return f"{self.profile}@{self.placement.start}:{self.placement.size}"

    def describe(self) -> str:
        """``3g.40gb at 0:4``, for messages."""
        return f"{self.profile} at {self.placement.start}:{self.placement.size}"

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "placement": _placement_to_dict(self.placement),
                "gi_id": self.gi_id, "held": self.held}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Instance:
        """Reads :meth:`to_dict` output; unknown keys are ignored, a malformed value is a
        :class:`ValueError`."""
        try:
            profile = data["profile"]
            placement = _placement_from_dict(data["placement"])
            gi_id = data.get("gi_id")
            held = data.get("held", False)
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a MIG instance: {data!r}") from err
        if not isinstance(profile, str) or not isinstance(held, bool) or not (
                gi_id is None or (isinstance(gi_id, int) and not isinstance(gi_id, bool))):
            raise ValueError(f"not a MIG instance: {data!r}")
        return cls(profile=profile, placement=placement, gi_id=gi_id, held=held)


def layout_problem(catalog: Catalog, instances: Sequence[tuple[str, Placement]], *,
                   explicit: bool = False) -> str | None:
    """Why ``instances`` (profile, placement pairs, in the caller's order) cannot all exist on
    one GPU together, or None if they can. An unknown profile is :class:`InvalidRequest`.

    ``explicit`` words an overlap as the caller's request ("explicit 3g.40gb at 0:4 overlaps
    2g.20gb at 2:2")."""
    specs = [catalog.profile(name) for name, _ in instances]
    for spec, (_, placement) in zip(specs, instances, strict=True):
        problem = spec.placement_problem(placement)
        if problem:
            return problem
    me = Counter(s.name for s in specs if s.media_extensions)
    if sum(me.values()) > 1:
        return media_extensions_problem(me)
    counts = Counter(s.name for s in specs)
    for spec in catalog.profiles:
        if counts[spec.name] > spec.max_instances:
            return count_problem(spec, counts[spec.name])
    prefix = "explicit " if explicit else ""
    for j, (name_j, p_j) in enumerate(instances):
        for name_i, p_i in instances[:j]:
            if p_j.overlaps(p_i):
                return f"{prefix}{name_j} at {p_j.start}:{p_j.size} overlaps " \
                       f"{name_i} at {p_i.start}:{p_i.size}"
    return None


def media_extensions_problem(counts: Mapping[str, int]) -> str:
    """The message for more than one ``+me`` instance (``counts``: +me profile -> count)."""
    asked = {name: n for name, n in counts.items() if n > 0}
    if len(asked) == 1:
        ((name, n),) = asked.items()
        return f"{name} at most once per GPU (asked {n})"
    listed = join_words([f"{n} x {name}" for name, n in sorted(asked.items())])
    return f"at most one +me instance per GPU (asked {listed})"


def count_problem(spec: ProfileSpec, asked: int) -> str:
    fit = "fits" if spec.max_instances == 1 else "fit"
    return f"{asked} x {spec.name} asked; at most {spec.max_instances} {fit} on one GPU"


def max_disjoint(placements: Iterable[Placement]) -> int:
    """How many of ``placements`` can be used at once (interval scheduling, earliest end)."""
    n, end = 0, -1
    for p in sorted(placements, key=lambda p: (p.end, p.start)):
        if p.start >= end:
            n, end = n + 1, p.end
    return n


@dataclass(frozen=True)
class Geometry:
    """A GPU's MIG state: the mode and its GPU instances, kept sorted by (start, profile)."""

    mig_enabled: bool
    instances: tuple[Instance, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", tuple(sorted(self.instances)))

    def used_slices(self) -> int:
        """The memory slices in use as a bitmask (bit ``s`` is slice ``s``)."""
        mask = 0
        for i in self.instances:
            mask |= _mask(i.placement)
        return mask

    def counts(self) -> dict[str, int]:
        """Profile -> number of instances (the multiset of profiles)."""
        return dict(sorted(Counter(i.profile for i in self.instances).items()))

    def layout(self) -> tuple[tuple[str, Placement], ...]:
        return tuple(i.key for i in self.instances)

    def same_layout(self, other: Geometry) -> bool:
        """Same mode, profiles and placements; GI ids and ``held`` do not count."""
        return self.mig_enabled == other.mig_enabled and self.layout() == other.layout()

    def problem(self, catalog: Catalog) -> str | None:
        """Why this geometry cannot exist on a GPU of ``catalog``, or None."""
        if not self.mig_enabled and self.instances:
            n = len(self.instances)
            listed = "1 GPU instance is" if n == 1 else f"{n} GPU instances are"
            return f"MIG is disabled but {listed} listed"
        return layout_problem(catalog, self.layout())

    def validate(self, catalog: Catalog) -> None:
        """:class:`GeometryNotPlaceable` unless the placements are legal for their profiles,
        disjoint, within the profiles' instance counts and with at most one ``+me``."""
        problem = self.problem(catalog)
        if problem:
            raise GeometryNotPlaceable(problem)

    def is_valid(self, catalog: Catalog) -> bool:
        try:
            return self.problem(catalog) is None
        except InvalidRequest:
            return False

    def free_placements(self, spec: ProfileSpec) -> tuple[Placement, ...]:
        """The placements of ``spec`` that no instance here overlaps."""
        used = self.used_slices()
        return tuple(p for p in spec.placements if not used & _mask(p))

    def remaining_capacity(self, catalog: Catalog) -> dict[str, int]:
        """Per profile, how many more instances of it alone could be created now (NVML's
        ``GetGpuInstanceRemainingCapacity``); 0 everywhere while MIG is disabled."""
        return remaining_capacity(catalog, self.used_slices(), self.counts(),
                                  enabled=self.mig_enabled)

    def to_dict(self) -> dict[str, Any]:
        return {"mig_enabled": self.mig_enabled,
                "instances": [i.to_dict() for i in self.instances]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Geometry:
        """Reads :meth:`to_dict` output; unknown keys are ignored, a malformed value is a
        :class:`ValueError`."""
        try:
            enabled = data["mig_enabled"]
            instances = tuple(Instance.from_dict(i) for i in data.get("instances", ()))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a MIG geometry: {data!r}") from err
        if not isinstance(enabled, bool):
            raise ValueError(f"mig_enabled must be true or false, got {enabled!r}")
        return cls(mig_enabled=enabled, instances=instances)


def remaining_capacity(catalog: Catalog, used: int, counts: Mapping[str, int], *,
                       enabled: bool = True) -> dict[str, int]:
    """Per profile, how many more instances fit in the slices free in ``used`` (a bitmask),
    given ``counts`` instances exist already (max instances, one ``+me`` per GPU)."""
    me_used = sum(n for name, n in counts.items()
                  if catalog.knows(name) and catalog.profile(name).media_extensions)
    out: dict[str, int] = {}
    for spec in catalog.profiles:
        if not enabled or (spec.media_extensions and me_used):
            out[spec.name] = 0
            continue
        free = max_disjoint(p for p in spec.placements if not used & _mask(p))
        cap = spec.max_instances - counts.get(spec.name, 0)
        if spec.media_extensions:
            cap = min(cap, 1)
        out[spec.name] = max(0, min(free, cap))
    return out


# --- desired state -----------------------------------------------------------------------


@dataclass(frozen=True)
class DesiredProfiles:
    """MIG enabled with this multiset of profiles (``{"1g.10gb": 2, "3g.40gb": 1}``), placed
    by the planner. A count of 0 is allowed (mig-parted configs write them); ``{}`` means MIG
    enabled with no instances."""

    counts: Mapping[str, int]

    def __post_init__(self) -> None:
        errors = []
        given: list[tuple[object, object]] = list(self.counts.items())  # unchecked input
        for name, n in given:
            if not isinstance(name, str):
                errors.append({"field": "profiles", "reason": f"profile {name!r} is not a name"})
            elif not isinstance(n, int) or isinstance(n, bool) or n < 0:
                errors.append({"field": f"profiles.{name}",
                               "reason": f"count must be a whole number ≥ 0, got {n!r}"})
        if errors:
            raise InvalidRequest("; ".join(e["reason"] for e in errors), errors=errors)
        object.__setattr__(self, "counts", MappingProxyType(dict(sorted(self.counts.items()))))

    def __hash__(self) -> int:
        return hash(tuple(self.counts.items()))

    @classmethod
    def of(cls, names: Iterable[str]) -> DesiredProfiles:
        """From a list of names, one per instance (``["1g.10gb", "1g.10gb", "3g.40gb"]``)."""
        return cls(Counter(names))

    def multiset(self) -> dict[str, int]:
        """The counts without zeros."""
        return {name: n for name, n in self.counts.items() if n}

    def __str__(self) -> str:
        parts = [f"{n}x{name}" for name, n in self.multiset().items()]
        return " + ".join(parts) if parts else "no instances"


@dataclass(frozen=True)
class DesiredInstances:
    """MIG enabled with exactly these instances at these placements (the caller's order is
    kept, so messages name them as asked)."""

    instances: tuple[tuple[str, Placement], ...]

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(name for name, _ in self.instances).items()))


@dataclass(frozen=True)
class DesiredDisabled:
    """MIG disabled: no instances."""


Desired = DesiredProfiles | DesiredInstances | DesiredDisabled


# --- plan --------------------------------------------------------------------------------


def _instances_from(data: Any, what: str) -> tuple[Instance, ...]:
    if data is None:
        return ()
    if not isinstance(data, list | tuple):
        raise ValueError(f"plan {what} must be a list, got {data!r}")
    return tuple(Instance.from_dict(i) for i in data)


@dataclass(frozen=True)
class Plan:
    """What a transition does: instances kept as they are, destroyed, created (each at an
    explicit placement, in creation order: largest first), and the MIG mode before/after."""

    keep: tuple[Instance, ...]
    destroy: tuple[Instance, ...]
    create: tuple[Instance, ...]
    mig_enabled_before: bool
    mig_enabled_after: bool

    @property
    def mode_change(self) -> bool:
        return self.mig_enabled_before != self.mig_enabled_after

    @property
    def empty(self) -> bool:
        """Nothing to do: no instance destroyed or created and no mode change."""
        return not self.destroy and not self.create and not self.mode_change

    def target(self) -> Geometry:
        """The geometry after the plan: kept plus created instances."""
        return Geometry(mig_enabled=self.mig_enabled_after, instances=self.keep + self.create)

    def summary(self) -> str:
        """One line: ``keep 2, destroy 1 (3g.40gb@4:4), create 2 (1g.10gb@4:1, 1g.10gb@5:1)``."""
        parts = []
        if self.mode_change:
            parts.append("enable MIG" if self.mig_enabled_after else "disable MIG")
        parts.append(f"keep {len(self.keep)}")
        for verb, items in (("destroy", self.destroy), ("create", self.create)):
            listed = f" ({', '.join(str(i) for i in items)})" if items else ""
            parts.append(f"{verb} {len(items)}{listed}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"mig_enabled_before": self.mig_enabled_before,
                "mig_enabled_after": self.mig_enabled_after,
                "keep": [i.to_dict() for i in self.keep],
                "destroy": [i.to_dict() for i in self.destroy],
                "create": [i.to_dict() for i in self.create]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Reads :meth:`to_dict` output, orders kept; unknown keys are ignored, a malformed
        value is a :class:`ValueError`."""
        try:
            before, after = data["mig_enabled_before"], data["mig_enabled_after"]
            keep = _instances_from(data.get("keep"), "keep")
            destroy = _instances_from(data.get("destroy"), "destroy")
            create = _instances_from(data.get("create"), "create")
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a MIG plan: {data!r}") from err
        if not isinstance(before, bool) or not isinstance(after, bool):
            raise ValueError(f"plan MIG modes must be true or false: {before!r}, {after!r}")
        return cls(keep=keep, destroy=destroy, create=create,
                   mig_enabled_before=before, mig_enabled_after=after)
