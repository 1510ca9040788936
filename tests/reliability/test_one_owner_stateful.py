"""One owner for each GPU (issue 12), as a hypothesis state machine over a real agent process:
random interleavings of whole-GPU, MIG-device (by every name) and slice claims, unprepares,
geometry changes under both drain policies, NVML faults and SIGKILL restarts (requests sent
from the moment the listener binds) on GPU 0, with simulated NVML latency. After every step:
one holder per device, every acknowledged claim's device still there, every transition ends
in the old or new layout plus what claims hold, nothing acknowledged before ready.

CI runs a bounded version; the long run is ``python -m tests.reliability.one_owner``.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.reliability.one_owner import (
    CLAIM_KINDS,
    FAULT_ERRORS,
    MUTATING,
    NAME_FORMS,
    POLICIES,
    RESTART_MODES,
    SLICE_PROFILES,
    TARGETS,
    UNPREPARE_KINDS,
    Layout,
    Rig,
    matching_base,
)

PICK = st.floats(0, 1, exclude_max=True)
GEOMETRY = st.integers(0, len(TARGETS) - 1)
SEED = st.integers(0, 2**30)


class OneOwner(RuleBasedStateMachine):
    """GPU 0 of one agent per example; the rig keeps the model and checks the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.workdir = tempfile.TemporaryDirectory(prefix="one-owner-")
        self.rig = Rig(Path(self.workdir.name))

    def teardown(self) -> None:
        self.rig.close()
        self.workdir.cleanup()

    @rule(form=st.sampled_from(NAME_FORMS))
    def claim_whole_gpu(self, form: str) -> None:
        self.rig.claim_whole(form)

    @rule(pick=PICK, form=st.sampled_from(NAME_FORMS))
    def claim_mig_device(self, pick: float, form: str) -> None:
        self.rig.claim_mig(pick, form)

    @rule(profile=st.sampled_from(SLICE_PROFILES))
    def claim_slice(self, profile: str) -> None:
        self.rig.claim_slice(profile)

    @rule(pick=PICK)
    def repeat_claim(self, pick: float) -> None:
        self.rig.repeat_claim(pick)

    @rule(kind=st.sampled_from(UNPREPARE_KINDS), pick=PICK)
    def unprepare(self, kind: str, pick: float) -> None:
        self.rig.unprepare(kind, pick)

    @rule(geometry=GEOMETRY, policy=st.sampled_from(POLICIES),
          timeout_s=st.sampled_from((0.0, 0.2, 0.5)))
    def change_geometry(self, geometry: int, policy: str, timeout_s: float) -> None:
        self.rig.change_geometry(geometry, policy, timeout_s)

    @rule(geometry=GEOMETRY, policy=st.sampled_from(POLICIES),
          timeout_s=st.sampled_from((0.2, 0.5)),
          claims=st.lists(st.tuples(st.sampled_from(CLAIM_KINDS), SEED), min_size=1, max_size=3),
          delay_s=st.floats(0, 0.08), unblock=st.none() | PICK,
          fault=st.none() | st.tuples(st.sampled_from(MUTATING[:2]), st.integers(0, 2)))
    def change_geometry_while_claiming(self, *, geometry: int, policy: str, timeout_s: float,
                                       claims: list[tuple[str, int]], delay_s: float,
                                       unblock: float | None,
                                       fault: tuple[str, int] | None) -> None:
        self.rig.concurrently(geometry, policy, timeout_s, claims, delay_s, unblock=unblock,
                              fault=fault)

    @rule(function=st.sampled_from(MUTATING), error=st.sampled_from(FAULT_ERRORS),
          skip=st.integers(0, 3))
    def inject_nvml_fault(self, function: str, error: str, skip: int) -> None:
        self.rig.inject_fault(function, error, skip)

    @rule(mode=st.sampled_from(RESTART_MODES), geometry=GEOMETRY, delay_s=st.floats(0, 0.1),
          seed=SEED)
    def kill_and_restart(self, mode: str, geometry: int, delay_s: float, seed: int) -> None:
        self.rig.restart(mode, geometry, delay_s, seed)

    @invariant()
    def one_owner(self) -> None:
        found = self.rig.check()
        self.rig.cycle += 1
        assert not found, "\n".join([*map(str, found), "steps:", *self.rig.log[-25:]])


def test_one_owner_for_each_gpu_through_random_interleavings() -> None:
    """No device has two holders, no acknowledged claim loses its device, every transition
    ends in the old or new layout plus held instances, and nothing is acknowledged before
    ready, whatever the order of claims, geometry changes, faults and restarts."""
    run_state_machine_as_test(OneOwner, settings=settings(
        max_examples=5, stateful_step_count=30, deadline=None, database=None,
        phases=(Phase.explicit, Phase.generate),  # shrinking restarts agents for minutes
        suppress_health_check=list(HealthCheck)))


SLICE: Counter[tuple[str, int, int]] = Counter({("1g.10gb", 6, 1): 1})
OLD = Layout.of(True, [("3g.40gb", 0, 4)])
NEW = Layout.of(True, [("7g.80gb", 0, 8)])
NONE: Counter[tuple[str, int, int]] = Counter()


@pytest.mark.parametrize(("actual", "required", "optional", "matches"), [
    (OLD, NONE, NONE, OLD),
    (NEW, NONE, NONE, NEW),
    (Layout.of(True, [("3g.40gb", 0, 4), ("1g.10gb", 6, 1)]), SLICE, NONE, OLD),
    # A held slice destroyed; an instance no claim explains; MIG switched off; half of each.
    (OLD, SLICE, NONE, None),
    (Layout.of(True, [("3g.40gb", 0, 4), ("1g.10gb", 6, 1)]), NONE, NONE, None),
    (Layout.of(False, []), NONE, NONE, None),
    (Layout.of(True, [("3g.40gb", 0, 4), ("7g.80gb", 0, 8)]), NONE, NONE, None),
    # A slice whose unprepare did not finish may be there or gone, but only once.
    (Layout.of(True, [("3g.40gb", 0, 4), ("1g.10gb", 6, 1)]), NONE, SLICE, OLD),
    (OLD, NONE, SLICE, OLD),
    (Layout.of(True, [("3g.40gb", 0, 4), ("1g.10gb", 6, 1), ("1g.10gb", 6, 1)]), NONE, SLICE,
     None),
])
def test_the_layout_check_accepts_only_old_or_new_plus_held(
        actual: Layout, required: Counter[tuple[str, int, int]],
        optional: Counter[tuple[str, int, int]], matches: Layout | None) -> None:
    """The geometry check bites: only the old or new layout plus held slices passes."""
    assert matching_base(actual, [OLD, NEW], required, optional) == matches
