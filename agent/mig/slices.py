"""On-demand slices as one-instance transitions: journaled like a geometry change before the
first NVML mutation, so a crash while a slice is made or destroyed is recovered at start-up by
the same logic (finish if the hardware shows the target, else roll back to the recorded
geometry). A slice touches one instance only, so the work itself is the three or four NVML
calls it needs, not a plan's walk per step; a failure undoes exactly that instance. Each
function runs on the GPU's NVML mutation thread, inside the ledger's mutation lock."""

from __future__ import annotations

import uuid

from agent.errors import NotFound
from agent.gpu import mig
from agent.gpu.types import Placement
from agent.mig.executor import GpuMutator, RestoreFailed, retrying
from agent.mig.geometry import Geometry, Instance, Plan
from agent.mig.journal import TransitionJournal, new_entry


def _journal(mutator: GpuMutator, journal: TransitionJournal, current: Geometry,
             plan: Plan) -> None:
    """The entry start-up recovery resolves if the agent dies before :func:`_close`. The
    instances the plan keeps are untouched, so no CI profiles are needed to restore them."""
    journal.write(new_entry(transition_id=f"slice-{uuid.uuid4().hex[:8]}", gpu=mutator.gpu,
                            old=current, old_ci_profiles={}, plan=plan, on_demand=True))


def _destroy(mutator: GpuMutator, gi_id: int) -> None:
    handle = mutator.session.gpu_handle(mutator.gpu)
    mig.destroy_compute_instances(mutator.session, handle, mutator.gpu, gi_id)
    mig.destroy_gpu_instance(mutator.session, handle, mutator.gpu, gi_id)


def create_slice(mutator: GpuMutator, journal: TransitionJournal, current: Geometry,
                 profile: str, *, profile_id: int,
                 placement: Placement) -> tuple[int, int, str]:
    """Make ``profile`` at ``placement`` on a GPU whose fresh walk is ``current`` (GI, then
    its largest CI); its GI id, CI id and MIG UUID. A failure destroys what was made; if that
    fails too, :class:`RestoreFailed` leaves the journal entry open for start-up."""
    session, gpu = mutator.session, mutator.gpu
    made = Instance(profile, placement)
    _journal(mutator, journal, current, Plan(
        keep=current.instances, destroy=(), create=(made,), mig_enabled_before=True,
        mig_enabled_after=True))
    handle = session.gpu_handle(gpu)
    gi_id: int | None = None
    try:
        gi_id = mig.create_gpu_instance(session, handle, gpu, profile_id, placement)
        ci = mig.create_compute_instance(session, handle, gpu, gi_id)
        device = mig.mig_device_uuid(session, handle, gpu, gi_id, ci.id)
        if device is None:
            raise NotFound(f"MIG device of the {made} slice not enumerated on {gpu}")
    except BaseException as err:
        if gi_id is not None:
            try:
                for attempt in retrying(f"undo {made}", gpu):
                    with attempt:
                        _destroy(mutator, gi_id)
            except Exception as failure:
                raise RestoreFailed(f"{failure} (after: {err})") from err
        journal.close(gpu)
        raise
    journal.close(gpu)
    return gi_id, ci.id, device


def destroy_slice(mutator: GpuMutator, journal: TransitionJournal, profile: str, *,
                  profile_id: int, placement: Placement) -> bool:
    """Destroy the slice if it exists (matched by profile and placement, never by a GI id
    alone, which the driver may have reused); False when it is already gone."""
    session, gpu = mutator.session, mutator.gpu
    if not mutator.mig_enabled():
        return False
    handle = session.gpu_handle(gpu)
    instances = mig.read_instances(session, handle, gpu, mutator.profiles)
    gone = next((gi for gi in instances
                 if gi.profile_id == profile_id and gi.placement == placement), None)
    if gone is None:
        return False
    current = mutator.layout(instances)
    victim = Instance(profile, placement, gone.id)
    _journal(mutator, journal, current, Plan(
        keep=tuple(i for i in current.instances if i.placement != placement),
        destroy=(victim,), create=(), mig_enabled_before=True, mig_enabled_after=True))
    if gone.compute_instances:
        mig.destroy_compute_instances(session, handle, gpu, gone.id)
    mig.destroy_gpu_instance(session, handle, gpu, gone.id)
    journal.close(gpu)
    return True
