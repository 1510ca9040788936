"""Why a compute-domain claim cannot be allocated (pure): the scheduler only says "cannot
allocate all claims", so the plugin that explains pending domains (``domain_explainer.py``)
compares the claim's size with the slots each NVLink clique offers and names the clique.

A domain claim asks for ``count`` devices of DeviceClass ``compute-domain.<driver>``, all
with the same ``fabricClique``; each fabric-complete node offers one slot, in a slice of pool
``<node>/compute-domain`` whose ``nodeSelector`` names its clique's Node label value. So a
claim larger than the slots of every clique is never allocated, whatever else changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from agent.device_names import SLOT_DEVICE, SLOT_POOL_SUFFIX, clique_label

Json = Mapping[str, Any]


def domain_class(driver: str) -> str:
    """The DeviceClass a domain claim asks for (``compute-domain.<driver>``)."""
    return f"compute-domain.{driver}"


def domain_size(claim: Json, driver: str) -> int | None:
    """How many slots a ResourceClaim asks for, or None: not a domain claim (no request of the
    domain class), already allocated, or one asking in a way that has no fixed size
    (``allocationMode: All``)."""
    if (claim.get("status") or {}).get("allocation"):
        return None
    wanted = domain_class(driver)
    size = 0
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exactly = request.get("exactly") if isinstance(request, Mapping) else None
        if not isinstance(exactly, Mapping) or exactly.get("deviceClassName") != wanted:
            continue
        if exactly.get("allocationMode", "ExactCount") != "ExactCount":
            return None
        count = exactly.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return None
        size += count
    return size or None


def _slot_clique(slice_: Json, driver: str) -> str | None:
    """The clique (its Node label value) a slot slice is offered to, or None for any other
    slice."""
    spec = slice_.get("spec") or {}
    pool = (spec.get("pool") or {}).get("name")
    devices = spec.get("devices") or ()
    if spec.get("driver") != driver or not isinstance(pool, str) \
            or not pool.endswith(SLOT_POOL_SUFFIX) \
            or not any(isinstance(d, Mapping) and d.get("name") == SLOT_DEVICE for d in devices):
        return None
    for term in (spec.get("nodeSelector") or {}).get("nodeSelectorTerms") or ():
        for expression in term.get("matchExpressions") or ():
            values = list(expression.get("values") or [])
            if expression.get("key") == clique_label(driver) and len(values) == 1:
                return str(values[0])
    return None


def slots_by_clique(slices: Iterable[Json], driver: str) -> Counter[str]:
    """How many slots each clique offers now, from the driver's ResourceSlices."""
    found: Counter[str] = Counter()
    for slice_ in slices:
        clique = _slot_clique(slice_, driver)
        if clique is not None:
            found[clique] += 1
    return found


def unfit_reason(size: int, slots: Mapping[str, int]) -> str | None:
    """Why a domain of ``size`` nodes cannot be placed on any clique, or None when one clique
    offers enough slots (then the claim waits for something else: busy nodes, quota)."""
    nodes = f"{size} node{'s' if size != 1 else ''}"
    if not slots:
        return (f"asks for a compute domain of {nodes}, but no node offers a "
                "compute-domain slot (no node has all its GPUs registered in one NVLink "
                "clique)")
    largest, offered = max(slots.items(), key=lambda item: (item[1], item[0]))
    if size <= offered:
        return None
    others = len(slots) - 1
    elsewhere = f"; {sum(slots.values()) - offered} more in {others} other " \
                f"clique{'s' if others != 1 else ''}" if others else ""
    return (f"asks for a compute domain of {nodes} in one NVLink clique, but the "
            f"largest clique, {largest}, has {offered} node{'s' if offered != 1 else ''} "
            f"offering a slot{elsewhere}: a domain cannot span cliques")
