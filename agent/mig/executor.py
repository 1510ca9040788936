"""Applying a plan to one GPU through the hardware layer: the mutation steps, their order,
retries of transient NVML errors, verification against a fresh walk, and the rollback to an
exact previous geometry. Every function here runs on the GPU's own NVML mutation thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tenacity import Retrying, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_exponential_jitter

from agent.errors import NvmlError
from agent.gpu import mig
from agent.gpu.session import NvmlSession
from agent.gpu.types import GiProfile, GpuInstanceState, Placement
from agent.mig.catalog import catalog_of, geometry_of
from agent.mig.geometry import DesiredInstances, Geometry, Instance, Plan
from agent.mig.planner import plan as make_plan

log = logging.getLogger("agent.mig.executor")

# Errors that clear up by themselves: IN_USE from a handle DCGM or a just-exited process still
# holds (DCGM #95, #276), timeouts. Anything else is permanent and rolls back at once.
TRANSIENT = frozenset({"NVML_ERROR_IN_USE", "NVML_ERROR_TIMEOUT"})

StepKind = Literal["destroy_ci", "destroy_gi", "set_mode", "create_gi", "create_ci"]


@dataclass(frozen=True)
class Step:
    """One NVML mutation of a transition; ``name`` is what the journal and API show."""

    kind: StepKind
    instance: Instance | None = None
    enable: bool | None = None

    @property
    def name(self) -> str:
        if self.kind == "set_mode":
            return "enable MIG" if self.enable else "disable MIG"
        assert self.instance is not None  # every other kind names an instance
        return f"{self.kind} {self.instance}"


def steps_of(plan: Plan) -> tuple[Step, ...]:
    """The plan as mutations, in NVML's required order: CIs destroyed, then their GIs, then
    the mode change, then each new GI created at its placement followed by its CI."""
    steps: list[Step] = [Step("destroy_ci", i) for i in plan.destroy]
    steps += [Step("destroy_gi", i) for i in plan.destroy]
    if plan.mode_change:
        steps.append(Step("set_mode", enable=plan.mig_enabled_after))
    for instance in plan.create:
        steps += [Step("create_gi", instance), Step("create_ci", instance)]
    return tuple(steps)


def _transient(err: BaseException) -> bool:
    return isinstance(err, NvmlError) and err.name in TRANSIENT


def retrying(step: str, gpu: str) -> Retrying:
    """Retries of transient NVML errors (bounded, jittered) for one named step."""
    return _retrying(step, gpu)


def _retrying(step: str, gpu: str) -> Retrying:
    def before_sleep(state: Any) -> None:
        err = state.outcome.exception() if state.outcome else None
        log.warning("transient nvml error, retrying",
                    extra={"gpu": gpu, "step": step, "attempt": state.attempt_number,
                           "error": str(err)})

    return Retrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(4),
                    wait=wait_exponential_jitter(multiplier=0.05, max=1.0), reraise=True,
                    before_sleep=before_sleep)


class GpuMutator:
    """The NVML side of a transition on one GPU (a fresh handle and walk for every call; cached
    handles go stale after any change)."""

    def __init__(self, session: NvmlSession, gpu_uuid: str, profiles: Sequence[GiProfile]) -> None:
        self.session = session
        self.gpu = gpu_uuid
        self.profiles = tuple(profiles)
        self._by_name = {p.name: p for p in profiles}

    def _handle(self) -> Any:
        return self.session.gpu_handle(self.gpu)

    def instances(self) -> tuple[GpuInstanceState, ...]:
        """GPU instances with their CIs, from a fresh per-profile walk."""
        handle = self._handle()
        if not mig.mig_enabled(self.session, handle, self.gpu):
            return ()
        return mig.read_instances(self.session, handle, self.gpu, self.profiles)

    def mig_enabled(self) -> bool:
        return mig.mig_enabled(self.session, self._handle(), self.gpu)

    def geometry(self, held_gi_ids: Sequence[int] = ()) -> Geometry:
        return geometry_of(catalog_of(self.profiles), mig_enabled=self.mig_enabled(),
                           instances=self.instances(), held_gi_ids=held_gi_ids)

    def layout(self, instances: Sequence[GpuInstanceState]) -> Geometry:
        """The geometry of instances just walked, MIG on (no NVML call)."""
        return geometry_of(catalog_of(self.profiles), mig_enabled=True, instances=instances)

    def ci_profiles(self) -> dict[str, list[int]]:
        """CI profile ids of every current GI, keyed ``profile@start:size``: what a rollback
        needs to re-create exactly what was there."""
        names = {p.id: p.name for p in self.profiles}
        return {f"{names.get(gi.profile_id, gi.profile_id)}@{gi.placement.start}:"
                f"{gi.placement.size}": [ci.profile_id for ci in gi.compute_instances]
                for gi in self.instances()}

    def instance_at(self, instance: Instance) -> GpuInstanceState | None:
        """The GPU instance of ``instance``'s profile at its placement, with its CIs, from a
        walk of that profile only; None when it is not there."""
        spec = self._by_name.get(instance.profile)
        if spec is None:
            return None
        return mig.instance_at(self.session, self._handle(), self.gpu, spec.id,
                               instance.placement)

    def run(self, step: Step, *, ci_profiles: Mapping[str, list[int]] | None = None) -> str:
        """Apply one step, retrying transient errors; return a short result for the record.
        Steps are idempotent against the hardware (a repeat after a crash finds the work
        done), which is what makes journal replay safe."""
        for attempt in _retrying(step.name, self.gpu):
            with attempt:
                return self._run_once(step, ci_profiles or {})
        raise AssertionError("unreachable: tenacity reraises")

    def _run_once(self, step: Step, ci_profiles: Mapping[str, list[int]]) -> str:
        handle = self._handle()
        if step.kind == "set_mode":
            assert step.enable is not None
            mode, status = mig.set_mig_mode(self.session, handle, self.gpu, step.enable)
            return f"current={'on' if mode.current else 'off'} " \
                   f"pending={'on' if mode.pending else 'off'} activation={status}"
        assert step.instance is not None
        gi = self.instance_at(step.instance)
        if step.kind == "destroy_ci":
            if gi is None or not gi.compute_instances:
                return "no compute instance"
            mig.destroy_compute_instances(self.session, handle, self.gpu, gi.id)
            return f"gi {gi.id}"
        if step.kind == "destroy_gi":
            if gi is None:
                return "already gone"
            mig.destroy_gpu_instance(self.session, handle, self.gpu, gi.id)
            return f"gi {gi.id}"
        if step.kind == "create_gi":
            if gi is not None:
                return f"gi {gi.id} exists"
            spec = self._by_name[step.instance.profile]
            gi_id = mig.create_gpu_instance(self.session, handle, self.gpu, spec.id,
                                            step.instance.placement)
            return f"gi {gi_id}"
        if gi is None:
            raise mig.gi_not_found(self.gpu)
        if gi.compute_instances:
            return f"ci {gi.compute_instances[0].id} exists"
        # A rollback re-creates the CIs the GI had; a new GI gets the one with the most SMs.
        wanted: list[int | None] = list(ci_profiles.get(str(step.instance), ())) or [None]
        made = [mig.create_compute_instance(self.session, handle, self.gpu, gi.id, profile)
                for profile in wanted]
        return f"gi {gi.id} ci {', '.join(f'{c.id} (profile {c.profile_id})' for c in made)}"

    def verify(self, target: Geometry) -> str | None:
        """Why the hardware differs from ``target`` (None when it matches), from a fresh walk."""
        enabled = self.mig_enabled()
        if enabled != target.mig_enabled:
            return f"MIG mode is {'on' if enabled else 'off'}, expected " \
                   f"{'on' if target.mig_enabled else 'off'}"
        instances = self.instances()  # one walk serves both checks
        actual = geometry_of(catalog_of(self.profiles), mig_enabled=enabled,
                             instances=instances)
        bare = [gi for gi in instances if not gi.compute_instances]
        if bare:
            return f"{len(bare)} GPU instance(s) without a compute instance (gi " \
                   f"{', '.join(str(g.id) for g in bare)})"
        if not actual.same_layout(target):
            return f"instances are [{', '.join(str(i) for i in actual.instances)}], expected " \
                   f"[{', '.join(str(i) for i in target.instances)}]"
        return None

    def verify_changes(self, plan: Plan) -> str | None:
        """Why what ``plan`` creates or destroys is not as it says (None when it is), from
        walks of those profiles only: a slice's plan keeps every other instance as it is,
        under the GPU's lock, so one walk of the whole GPU per slice is not needed."""
        enabled = self.mig_enabled()
        if enabled != plan.mig_enabled_after:
            return f"MIG mode is {'on' if enabled else 'off'}, expected " \
                   f"{'on' if plan.mig_enabled_after else 'off'}"
        if not enabled:
            return None
        for made in plan.create:
            gi = self.instance_at(made)
            if gi is None or not gi.compute_instances:
                return f"{made} is {'not there' if gi is None else 'without a compute instance'}"
        for gone in plan.destroy:
            if self.instance_at(gone) is not None:
                return f"{gone} is still there"
        return None

    def restore(self, old: Geometry, ci_profiles: Mapping[str, list[int]],
                on_step: Callable[[Step, str], None] | None = None) -> None:
        """Bring the GPU back to ``old`` exactly (placements and CI profiles), from whatever
        state it is in now: destroy what is not in ``old`` (GIs without CIs included), then
        re-create what is missing; a MIG mode change left pending is withdrawn."""
        catalog = catalog_of(self.profiles)
        current = self.geometry()
        if not old.mig_enabled:
            back = Plan(keep=(), destroy=current.instances, create=(),
                        mig_enabled_before=current.mig_enabled, mig_enabled_after=False)
        else:
            back = make_plan(catalog, current, DesiredInstances(tuple(
                (i.profile, i.placement) for i in old.instances)))
        steps = steps_of(back)
        if not back.mode_change and \
                mig.mig_mode(self.session, self._handle(), self.gpu).pending != old.mig_enabled:
            # A change that stayed pending (processes on a Hopper GPU) would take effect at
            # the next reset: asking for the old mode again withdraws it.
            steps = (*steps, Step("set_mode", enable=old.mig_enabled))
        for step in steps:
            result = self.run(step, ci_profiles=ci_profiles)
            if on_step is not None:
                on_step(step, result)
        for gi in self.instances():  # a GI whose CI never got made: give it its old CI
            if not gi.compute_instances:
                name = next((p.name for p in self.profiles if p.id == gi.profile_id), "")
                self.run(Step("create_ci", Instance(name, Placement(gi.placement.start,
                                                                   gi.placement.size))),
                         ci_profiles=ci_profiles)
        problem = self.verify(old)
        if problem is not None:
            raise RestoreFailed(problem)


class RestoreFailed(Exception):
    """The GPU could not be brought back to its previous geometry."""
