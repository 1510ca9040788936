"""The node's taints as one set, and what changed between two of them (pure): the agent's
events (``gpu.taint_added``, ``gpu.taint_removed``) and the gauge
``gpu_agent_gpu_taint_added_timestamp_seconds`` follow these changes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.health.taints import Fault, Taint, device_taints

#: What makes a taint the same one: (GPU, GPU instance, key, value, effect, time added).
TaintId = tuple[str, int | None, str, str | None, str, float]


@dataclass(frozen=True)
class PlacedTaint:
    """A taint where it sits: a GPU (by UUID and index), GPU-wide (``gpu_instance`` None) or
    on one MIG GPU instance."""

    gpu: str
    index: int
    gpu_instance: int | None
    taint: Taint

    @property
    def identity(self) -> TaintId:
        """What makes it the same taint (its human reason may be reworded)."""
        t = self.taint
        return (self.gpu, self.gpu_instance, t.key, t.value, t.effect, t.time_added)


def node_taints(gpus: Iterable[tuple[str, int, tuple[Fault, ...]]], *, driver: str,
                no_execute: bool) -> dict[TaintId, PlacedTaint]:
    """Every taint of the node by identity, from each GPU's (UUID, index, faults): the
    GPU-wide ones, then each MIG instance's own (those of faults scoped to it)."""
    found: dict[TaintId, PlacedTaint] = {}
    for uuid, index, faults in gpus:
        placed = [PlacedTaint(uuid, index, None, t)
                  for t in device_taints(faults, driver=driver, no_execute=no_execute)]
        for gi, ci in sorted({(f.gi_id, f.ci_id) for f in faults if f.gi_id is not None},
                             key=lambda k: (k[0], -1 if k[1] is None else k[1])):
            own = tuple(f for f in faults if f.gi_id == gi and f.ci_id == ci)
            assert gi is not None
            placed += [PlacedTaint(uuid, index, gi, t)
                       for t in device_taints(own, driver=driver, no_execute=no_execute,
                                              instance=(gi, ci))]
        for p in placed:
            found.setdefault(p.identity, p)
    return found


def changes(before: dict[TaintId, PlacedTaint], after: dict[TaintId, PlacedTaint],
            ) -> tuple[list[PlacedTaint], list[PlacedTaint]]:
    """(taints added, taints removed) from ``before`` to ``after``, each in a stable order."""
    added = [after[k] for k in sorted(after.keys() - before.keys(), key=_order)]
    removed = [before[k] for k in sorted(before.keys() - after.keys(), key=_order)]
    return added, removed


def _order(identity: TaintId) -> tuple[object, ...]:
    gpu, gi, key, value, effect, since = identity
    return (gpu, -1 if gi is None else gi, key, value or "", effect, since)
