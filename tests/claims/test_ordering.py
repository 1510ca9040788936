"""Ordering stamps against a simple model (Hypothesis): whatever interleaving of stamped and
unstamped prepares and unprepares of one claim UID arrives, the service answers as the
model of docs/claims.md says, and the claim's stamp is the newest prepare it answered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.claims.requests import DeviceRequest
from agent.errors import ClaimUnprepared, NotFound
from tests import stamps
from tests.service_node import ServiceNode, open_services

DEVICE = [DeviceRequest(request="gpu", kind="gpu", device="0")]


@dataclass
class Tombstone:
    stamp: int | None


@dataclass
class Model:
    """What docs/claims.md says, for one UID inside the tombstone window."""

    prepared: bool = False
    stamp: int | None = None
    durable: Tombstone | None = None  # left by unpreparing a prepared claim
    memory: Tombstone | None = None  # left by unpreparing an unknown one
    answers: list[str] = field(default_factory=list)

    def prepare(self, stamp: int | None) -> str:
        if self.prepared:
            if stamp is not None and (self.stamp is None or stamp > self.stamp):
                self.stamp = stamp
            return "ok"
        found = [t for t in (self.durable, self.memory) if t is not None]
        stamps = [t.stamp for t in found]
        if found and (stamp is None or None in stamps
                      or stamp <= max(s for s in stamps if s is not None)):
            return "refused"
        self.prepared, self.stamp, self.durable, self.memory = True, stamp, None, None
        return "ok"

    def unprepare(self, stamp: int | None) -> str:
        if self.prepared:
            if stamp is not None and self.stamp is not None and stamp < self.stamp:
                return "ok"  # late: nothing changes
            self.prepared, self.stamp = False, None
            self.durable = Tombstone(stamp)
            return "ok"
        old = self.memory.stamp if self.memory is not None else None
        self.memory = Tombstone(None if stamp is None else max(stamp, old or stamp))
        return "ok"


@pytest.fixture(scope="module")
def runner_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[asyncio.Runner, ServiceNode]]:
    # One node for every example (each uses its own UID): a node per example would spend
    # the test's time starting nodes.
    runner = asyncio.Runner()
    directory: Path = tmp_path_factory.mktemp("ordering")
    node = runner.run(open_services(directory))
    yield runner, node
    runner.run(node.close())
    runner.close()


OPS = st.lists(st.tuples(st.sampled_from(["P", "U"]),
                         st.one_of(st.none(), st.integers(0, 12), st.integers(0, 12))),
               min_size=1, max_size=10)
COUNTER = iter(range(10**6))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_interleaving_answers_as_the_model(
        runner_node: tuple[asyncio.Runner, ServiceNode],
        ops: list[tuple[str, int | None]]) -> None:
    """Each prepare is accepted or refused (claim-unprepared), each unprepare takes effect
    or is ignored, exactly as the model does; the claim's stamp and existence match it."""
    runner, node = runner_node
    uid = f"u{next(COUNTER)}"
    model = Model()

    async def run() -> None:
        for number, (op, raw) in enumerate(ops):
            stamp = None if raw is None else stamps.stamp(raw)
            if op == "P":
                try:
                    await node.claims.prepare(uid, DEVICE, {}, issued_at_ns=stamp)
                    answer = "ok"
                except ClaimUnprepared:
                    answer = "refused"
                assert answer == model.prepare(stamp), (number, ops)
            else:
                await node.claims.unprepare(uid, issued_at_ns=stamp)
                model.unprepare(stamp)
            try:
                record = node.claims.claim(uid)
            except NotFound:
                assert not model.prepared, (number, ops)
            else:
                assert model.prepared, (number, ops)
                assert record.issued_at_ns == model.stamp, (number, ops)
        await node.claims.unprepare(uid)  # unstamped: always unprepares; GPU 0 free again

    runner.run(run())
