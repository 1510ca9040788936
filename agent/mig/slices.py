"""On-demand slices as one-instance transitions: the same executor steps and the same journal
as a geometry change, so a crash while a slice is made or destroyed is recovered at start-up
by the same logic (finish if the hardware shows the target, else roll back). Each function
runs on the GPU's NVML mutation thread, inside the ledger's mutation lock for the GPU."""

from __future__ import annotations

import uuid

from agent.errors import NotFound
from agent.gpu import mig
from agent.gpu.types import Placement
from agent.mig.executor import GpuMutator, RestoreFailed, retrying, steps_of
from agent.mig.geometry import Geometry, Instance, Plan
from agent.mig.journal import TransitionJournal, new_entry


def _change(mutator: GpuMutator, journal: TransitionJournal, plan: Plan, old: Geometry) -> None:
    """Journal the plan, apply it, close the journal; on any failure restore ``old`` first.
    A failed restore raises :class:`RestoreFailed` and leaves the entry open: start-up
    resolves it, and the caller quarantines the GPU meanwhile."""
    entry = new_entry(transition_id=f"slice-{uuid.uuid4().hex[:8]}", gpu=mutator.gpu, old=old,
                      old_ci_profiles=mutator.ci_profiles(), plan=plan, on_demand=True)
    journal.write(entry)
    try:
        for step in steps_of(plan):
            mutator.run(step)
    except BaseException as err:
        try:
            for attempt in retrying("restore", mutator.gpu):
                with attempt:
                    mutator.restore(old, entry.old_ci_profiles)
        except Exception as failure:
            raise RestoreFailed(f"{failure} (after: {err})") from failure
        journal.close(mutator.gpu)
        raise
    journal.close(mutator.gpu)


def create_slice(mutator: GpuMutator, journal: TransitionJournal, profile: str,
                 placement: Placement) -> tuple[int, int, str]:
    """Make ``profile`` at ``placement`` (GI, then its largest CI); its GI id, CI id and MIG
    UUID. The caller has checked the placement is free on a fresh walk."""
    current = mutator.geometry()
    made = Instance(profile, placement)
    _change(mutator, journal, Plan(keep=current.instances, destroy=(), create=(made,),
                                   mig_enabled_before=True, mig_enabled_after=True), current)
    handle = mutator.session.gpu_handle(mutator.gpu)
    for gi in mutator.instances():
        if gi.placement == placement and gi.compute_instances:
            ci = gi.compute_instances[0].id
            device = mig.mig_device_uuid(mutator.session, handle, mutator.gpu, gi.id, ci)
            if device is not None:
                return gi.id, ci, device
    raise NotFound(f"MIG device of the {made} slice not enumerated on {mutator.gpu}")


def destroy_slice(mutator: GpuMutator, journal: TransitionJournal, profile: str,
                  placement: Placement) -> bool:
    """Destroy the slice if it exists (matched by profile and placement, never by a GI id
    alone, which the driver may have reused); False when it is already gone."""
    if not mutator.mig_enabled():
        return False
    current = mutator.geometry()
    gone = [i for i in current.instances if i.key == (profile, placement)]
    if not gone:
        return False
    _change(mutator, journal, Plan(
        keep=tuple(i for i in current.instances if i not in gone), destroy=tuple(gone),
        create=(), mig_enabled_before=True, mig_enabled_after=True), current)
    return True
