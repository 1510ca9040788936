"""On-demand slices as one-instance transitions: journaled like a geometry change before the
first NVML mutation, so a crash while a slice is made or destroyed is recovered at start-up by
the same logic (finish if the hardware shows the target, else roll back to the recorded
geometry). A slice touches one instance only, so the work itself is the three or four NVML
calls it needs, not a plan's walk per step; a failure undoes exactly that instance. Each
function runs on the GPU's NVML mutation thread, inside the ledger's mutation lock.

MIG mode (``--dynamic-mig``, reference ``dra-driver.md`` 3): on Hopper and newer a MIG mode
change takes effect at once, without a GPU reset, so the first slice made for a scheduler's
allocation on a GPU with MIG off switches MIG on (journaled with the old geometry MIG off: a
crash in between is rolled back to MIG off at start-up). The agent remembers, durably, that a
slice switched it on (``<state>/mig/mig-on-for-slices/<uuid>``), and the unprepare that
destroys the GPU's last instance switches it off again: with MIG on the GPU cannot be handed
out whole, so leaving it on would take the full GPU out of the pool for good (NVIDIA's driver
does the same). A GPU whose MIG an operator switched on stays on. Ampere is never toggled
(its mode change needs a reset, which could wedge a VM's GPU)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from pathlib import Path

from agent.durable import FileKind, fsync_dir, write_durable
from agent.errors import DeviceBusy, NotFound, NvmlError
from agent.gpu import mig
from agent.gpu.types import Gpu, Placement
from agent.mig.executor import GpuMutator, RestoreFailed, retrying
from agent.mig.geometry import Geometry, Instance, Plan
from agent.mig.journal import TransitionJournal, new_entry

#: MIG-capable architectures whose MIG mode changes take effect without a GPU reset.
MODE_CHANGES_WITHOUT_RESET = frozenset({"hopper", "blackwell"})
_MARK = FileKind("gpu-agent-mig-on-for-slices", 1)
log = logging.getLogger("agent.mig")


def switches_mig_on(gpu: Gpu) -> bool:
    """Whether a slice made for a scheduler's allocation may switch this GPU's MIG on first:
    MIG-capable, Hopper or newer, MIG off with no change pending (pure)."""
    mode = gpu.mig_mode
    return (gpu.static.mig_capable and gpu.static.architecture in MODE_CHANGES_WITHOUT_RESET
            and mode is not None and not mode.current and not mode.pending)


def slice_ready(gpu: Gpu, *, allocated: bool) -> bool:
    """Whether a slice can be made on ``gpu``: MIG on, or (for a device the scheduler
    allocated from the dynamic slices, ``allocated``) MIG off where :func:`switches_mig_on`."""
    mode = gpu.mig_mode
    return (mode is not None and mode.current) or (allocated and switches_mig_on(gpu))


def _mark(journal: TransitionJournal, gpu: str) -> Path:
    return journal.directory.parent / "mig-on-for-slices" / gpu


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


def _switch_on(mutator: GpuMutator, journal: TransitionJournal) -> None:
    """MIG on, remembered first (a mark left by a crash before the switch only means the next
    last unprepare switches off a MIG a slice switched on). A GPU busy with processes keeps
    the change pending: it is withdrawn, and the prepare refused."""
    session, gpu = mutator.session, mutator.gpu
    write_durable(_mark(journal, gpu), _MARK, b"{}")
    handle = session.gpu_handle(gpu)
    mode, status = mig.set_mig_mode(session, handle, gpu, True)
    if not mode.current:
        mig.set_mig_mode(session, handle, gpu, False)
        _forget(journal, gpu)
        raise DeviceBusy(f"MIG could not be switched on for a slice on GPU {gpu} (activation "
                         f"status {status}: processes are running on it)", gpu=gpu)


def _forget(journal: TransitionJournal, gpu: str) -> None:
    path = _mark(journal, gpu)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        fsync_dir(path.parent)


def create_slice(mutator: GpuMutator, journal: TransitionJournal, current: Geometry,
                 profile: str, *, profile_id: int,
                 placement: Placement) -> tuple[int, int, str]:
    """Make ``profile`` at ``placement`` on a GPU whose fresh walk is ``current`` (GI, then
    its largest CI), switching MIG on first where ``current`` has it off (the caller checked
    :func:`slice_ready`); its GI id, CI id and MIG UUID. A failure destroys what was made and
    switches MIG off again if it switched it on; if that fails too, :class:`RestoreFailed`
    leaves the journal entry open for start-up."""
    session, gpu = mutator.session, mutator.gpu
    made = Instance(profile, placement)
    _journal(mutator, journal, current, Plan(
        keep=current.instances, destroy=(), create=(made,),
        mig_enabled_before=current.mig_enabled, mig_enabled_after=True))
    gi_id: int | None = None
    switched = False
    try:
        if not current.mig_enabled:
            _switch_on(mutator, journal)
            switched = True
        handle = session.gpu_handle(gpu)
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
        if switched:  # back to MIG off, as the journal recorded it
            try:
                mig.set_mig_mode(session, session.gpu_handle(gpu), gpu, False)
            except Exception as failure:
                raise RestoreFailed(f"MIG not switched off again: {failure} (after: {err})") \
                    from err
            _forget(journal, gpu)
        journal.close(gpu)
        raise
    journal.close(gpu)
    return gi_id, ci.id, device


def destroy_slice(mutator: GpuMutator, journal: TransitionJournal, profile: str, *,
                  profile_id: int, placement: Placement) -> bool:
    """Destroy the slice if it exists (matched by profile and placement, never by a GI id
    alone, which the driver may have reused); False when it is already gone. The GPU's last
    instance gone, MIG is switched off again where a slice switched it on."""
    session, gpu = mutator.session, mutator.gpu
    if not mutator.mig_enabled():
        _forget(journal, gpu)
        return False
    handle = session.gpu_handle(gpu)
    instances = mig.read_instances(session, handle, gpu, mutator.profiles)
    gone = next((gi for gi in instances
                 if gi.profile_id == profile_id and gi.placement == placement), None)
    if gone is None:
        return False
    current = mutator.layout(instances)
    keep = tuple(i for i in current.instances if i.placement != placement)
    switch_off = not keep and _mark(journal, gpu).is_file()
    victim = Instance(profile, placement, gone.id)
    _journal(mutator, journal, current, Plan(
        keep=keep, destroy=(victim,), create=(), mig_enabled_before=True,
        mig_enabled_after=not switch_off))
    if gone.compute_instances:
        mig.destroy_compute_instances(session, handle, gpu, gone.id)
    mig.destroy_gpu_instance(session, handle, gpu, gone.id)
    if switch_off:
        try:
            mig.set_mig_mode(session, handle, gpu, False)
            _forget(journal, gpu)
        except NvmlError as err:
            # The slice is gone, which is what the claim needed; MIG merely stays on (the
            # full GPU stays unpublished until an operator switches it off).
            log.warning("MIG not switched off after the last slice",
                        extra={"gpu": gpu, "error": err.detail})
    journal.close(gpu)
    return True
