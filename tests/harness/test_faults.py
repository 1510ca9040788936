"""A fault at every NVML step (hypothesis, in-process): for generated geometries and slice
claims, the k-th call of an NVML function fails with each relevant error, and the outcome is
one of the specified ones: retried and succeeded, rolled back exactly, or failed with the GPU
quarantined and an event. Never a silent mixed state, never an unhandled exception."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.api.problems import problem_of
from agent.claims.requests import DeviceRequest
from agent.errors import AgentError
from agent.mig.geometry import DesiredInstances, Geometry
from agent.mig.transition import TransitionState
from tests.mig.catalogs import H100_80GB, all_layouts
from tests.mig.test_service import MUTATIONS, Node, _open

ERRORS = ("IN_USE", "INSUFFICIENT_RESOURCES", "UNKNOWN", "GPU_IS_LOST", "TIMEOUT",
          "NO_PERMISSION")
FUNCTIONS = (*MUTATIONS, "nvmlDeviceGetMigMode", "nvmlDeviceGetGpuInstances",
             "nvmlGpuInstanceGetComputeInstances", "nvmlDeviceGetGpuInstanceById")
LAYOUTS = tuple(layout for layout in all_layouts(H100_80GB) if layout)
faults = st.tuples(st.sampled_from(FUNCTIONS), st.sampled_from(ERRORS),
                   st.integers(0, 12), st.integers(1, 6))


def _layout(geometry: Geometry) -> list[str]:
    return sorted(str(i) for i in geometry.instances)


async def _bare(node: Node) -> list[int]:
    return list(node.sim.describe()["gpus"][0]["gpu_instances_without_ci"])


async def _transition(old: tuple, new: tuple, fault: tuple[str, str, int, int]) -> None:
    function, error, skip, times = fault
    with tempfile.TemporaryDirectory() as tmp:
        node = await _open(Path(tmp))
        try:
            assert await node.change(DesiredInstances(old)) == TransitionState.SUCCEEDED
            before = _layout(await node.geometry())
            gpu = await node.gpu()
            node.sim.add_fault(function, error, gpu=gpu.uuid, skip=skip, times=times)
            try:
                state = await node.change(DesiredInstances(new))
            except AgentError as err:  # refused while planning: nothing may have changed
                assert problem_of(err).status != 500
                state = None
            node.sim.clear_faults()
            after = _layout(await node.geometry())
            if state != TransitionState.FAILED:  # only a quarantined GPU may be half-made
                assert not await _bare(node)
            if state in (None, TransitionState.ROLLED_BACK, TransitionState.ABORTED):
                assert after == before, (state, after, before)
            elif state == TransitionState.SUCCEEDED:
                assert after == sorted(f"{p}@{pl.start}:{pl.size}" for p, pl in new)
            else:
                assert state == TransitionState.FAILED, state
                assert node.mig.quarantined(gpu.uuid)
                assert any(e.kind == "mig.quarantined" for e in node.events.since(0))
            assert not list((node.state_dir / "mig" / "journal").glob("*.json"))
        finally:
            await node.services.close()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(old=st.sampled_from(LAYOUTS), new=st.sampled_from(LAYOUTS), fault=faults)
def test_a_fault_at_any_step_of_a_transition(old: tuple, new: tuple,
                                             fault: tuple[str, str, int, int]) -> None:
    asyncio.run(_transition(old, new, fault))


async def _claim(layout: tuple, profile: str, fault: tuple[str, str, int, int]) -> None:
    function, error, skip, times = fault
    with tempfile.TemporaryDirectory() as tmp:
        node = await _open(Path(tmp))
        claims = node.services.claims
        try:
            assert await node.change(DesiredInstances(layout)) == TransitionState.SUCCEEDED
            before = _layout(await node.geometry())
            gpu = await node.gpu()
            node.sim.add_fault(function, error, gpu=gpu.uuid, skip=skip, times=times)
            request = DeviceRequest(request="s", kind="slice", profile=profile, gpu="0")
            try:
                record = await claims.prepare("c", [request], {})
            except AgentError as err:
                assert problem_of(err).status != 500
                record = None
            node.sim.clear_faults()
            after = _layout(await node.geometry())
            specs = sorted(p.name for p in claims.cdi.claim_specs())
            if record is None and node.mig.quarantined(gpu.uuid):
                # NVML kept failing while the slice was undone: the GPU is quarantined (as
                # for a failed rollback) and the claim stays recorded for start-up to finish.
                assert "c" not in claims.checkpoint.data.claims or \
                    claims.checkpoint.data.claims["c"].state == "prepare_started"
                assert specs == []
                return
            if record is None and "c" in claims.checkpoint.data.claims:
                # The undo itself met the fault: the claim stays recorded as half-done, and
                # the next unprepare (or prepare, or start) finishes the job.
                assert claims.checkpoint.data.claims["c"].state == "prepare_started"
                await claims.unprepare("c")
            assert not await _bare(node)
            if record is None:
                assert after == before
                assert "c" not in claims.checkpoint.data.claims
                assert specs == []
            else:
                assert claims.checkpoint.data.claims["c"].state == "prepare_completed"
                assert len(after) == len(before) + 1
                assert len(specs) == 1
                await claims.unprepare("c")
                assert _layout(await node.geometry()) == before
        finally:
            await node.services.close()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(layout=st.sampled_from(LAYOUTS), profile=st.sampled_from(("1g.10gb", "2g.20gb")),
       fault=faults)
def test_a_fault_at_any_step_of_a_slice_prepare(layout: tuple, profile: str,
                                                fault: tuple[str, str, int, int]) -> None:
    asyncio.run(_claim(layout, profile, fault))
