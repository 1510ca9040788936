"""mig-parted ``version: v1`` configs written by the agent: the current layout exported (what
``nvidia-mig-parted export`` prints) and the standard configs ``generate-config`` emits for a
GPU model (``reference/mig.md`` §3). Pure; every config made here parses back
(:func:`agent.mig.parted_config.parse_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.errors import InvalidRequest
from agent.mig.geometry import Catalog, Geometry, ProfileSpec
from agent.mig.parted_config import VERSION, config_label, parse_config


def _entry(devices: str | list[int], enabled: bool,
           counts: Mapping[str, int]) -> dict[str, Any]:
    entry: dict[str, Any] = {"devices": devices, "mig-enabled": enabled}
    if enabled:
        entry["mig-devices"] = dict(counts)
    return entry


def _config(configs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"version": VERSION, "mig-configs": dict(configs)}


def export_config(layouts: Mapping[int, Geometry], label: str = "current") -> dict[str, Any]:
    """The current layout of the GPUs in ``layouts`` as a mig-parted v1 config under
    ``label`` (what ``nvidia-mig-parted export`` prints): one entry per distinct layout, in
    order of its first GPU, grouping the GPUs with equal mode and profile counts (``devices:
    all`` when every GPU in ``layouts`` shares one; pass every GPU of the node, a GPU that
    cannot do MIG as MIG disabled, for that to hold on the node).

    :class:`InvalidRequest` when there is no GPU, or a profile name is no mig-parted profile
    string."""
    if not layouts:
        raise InvalidRequest("no GPU to export", errors=[{"field": "gpus", "reason": "none"}])
    groups: dict[tuple[bool, tuple[tuple[str, int], ...]], list[int]] = {}
    for index, geometry in sorted(layouts.items()):
        counts = tuple(geometry.counts().items()) if geometry.mig_enabled else ()
        groups.setdefault((geometry.mig_enabled, counts), []).append(index)
    entries = [
        _entry("all" if len(groups) == 1 else indices, enabled, dict(counts))
        for (enabled, counts), indices in groups.items()]
    out = _config({label: entries})
    parse_config(out)
    return out


def standard_configs(catalog: Catalog) -> dict[str, Any]:
    """The config ``nvidia-mig-parted generate-config`` emits for a GPU model: ``all-disabled``,
    ``all-enabled`` (MIG on, no devices), ``all-<profile>`` for every profile at its maximum
    count (a ``+me`` one at 1; ``+`` written ``.`` in the label) and ``all-balanced`` (7 slices:
    2 x 1g + 1 x 2g + 1 x 3g; 4 slices: 2 x 1g + 1 x 2g; per size the profile without
    attributes with the highest maximum count), left out when the GPU lacks a size."""
    configs: dict[str, list[dict[str, Any]]] = {
        "all-disabled": [_entry("all", False, {})],
        "all-enabled": [_entry("all", True, {})],
    }
    for spec in sorted(catalog.profiles, key=lambda s: s.name):
        count = min(spec.max_instances, 1) if spec.media_extensions else spec.max_instances
        configs[config_label(spec.name)] = [_entry("all", True, {spec.name: count})]
    base = [s for s in catalog.profiles
            if not s.media_extensions and "+" not in s.name and "-" not in s.name]
    slots = max((s.slices for s in base), default=0)
    formula = {7: {1: 2, 2: 1, 3: 1}, 4: {1: 2, 2: 1}}.get(slots)
    if formula:
        picked: dict[int, ProfileSpec] = {}
        for spec in base:
            held = picked.get(spec.slices)
            if spec.slices in formula and (held is None
                                           or spec.max_instances > held.max_instances):
                picked[spec.slices] = spec
        if set(picked) == set(formula):
            counts = {picked[g].name: n for g, n in formula.items()}
            configs["all-balanced"] = [_entry("all", True, dict(sorted(counts.items())))]
    return _config(configs)
