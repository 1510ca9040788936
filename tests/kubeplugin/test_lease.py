"""Electing the one plugin that explains unplaceable domains (agent/kubeplugin/lease.py),
against a real kube-apiserver: one candidate of several leads and works; killed without a
word, another takes over once the Lease went unrenewed for its duration; a leader that
cannot renew stops working within that duration."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.kubeplugin.kube import KubeClient, KubeNotFound, KubeUnavailable
from agent.kubeplugin.lease import LeaderElection
from tests.k8s.harness import ApiServer
from tests.kubeplugin.publishing import eventually, kube_client

NAMESPACE = "default"
DURATION_S = 4.0


@dataclass
class Candidate:
    election: LeaderElection
    working: asyncio.Event = field(default_factory=asyncio.Event)
    run: asyncio.Task[None] | None = None

    async def work(self) -> None:
        self.working.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.working.clear()

    def start(self) -> None:
        self.run = asyncio.create_task(self.election.run(self.work))

    async def kill(self) -> None:
        assert self.run is not None
        self.run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.run


@pytest.fixture
async def client(kube_apiserver: ApiServer) -> AsyncIterator[KubeClient]:
    kube = await kube_client(kube_apiserver.kubeconfig)
    try:
        yield kube
    finally:
        await kube.close()


async def test_one_candidate_leads_and_another_takes_over_when_it_dies(
        client: KubeClient) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    candidates = [Candidate(LeaderElection(client, namespace=NAMESPACE, name=name,
                                           identity=f"node-{i}", duration_s=DURATION_S,
                                           retry_s=0.2)) for i in range(3)]
    for candidate in candidates:
        candidate.start()
    try:
        await eventually(lambda: sum(c.working.is_set() for c in candidates) == 1,
                         within_s=30)
        [leader] = [c for c in candidates if c.working.is_set()]
        lease = await client.get_lease(NAMESPACE, name)
        assert lease["spec"]["holderIdentity"] == leader.election.identity
        # The others stay followers while the leader renews (for more than a duration).
        versions = {lease["metadata"]["resourceVersion"]}

        async def renewed_twice() -> bool:
            versions.add((await client.get_lease(NAMESPACE, name))["metadata"][
                "resourceVersion"])
            return len(versions) >= 3

        await eventually(renewed_twice, within_s=30)
        assert [c.working.is_set() for c in candidates].count(True) == 1
        assert leader.working.is_set()

        await leader.kill()  # no release: the Lease just stops being renewed
        assert not leader.working.is_set()
        others = [c for c in candidates if c is not leader]
        await eventually(lambda: sum(c.working.is_set() for c in others) == 1, within_s=60)
        lease = await client.get_lease(NAMESPACE, name)
        assert lease["spec"]["holderIdentity"] != leader.election.identity
        assert lease["spec"]["leaseTransitions"] == 1
    finally:
        for candidate in candidates:
            if candidate.run is not None and not candidate.run.done():
                await candidate.kill()


@dataclass
class FlakyLeases:
    """A Lease API that answers until ``down``, then times out every call."""

    lease: dict[str, Any] | None = None
    down: bool = False

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        if self.down:
            raise KubeUnavailable("timed out")
        if self.lease is None:
            raise KubeNotFound("no lease", status=404)
        return self.lease

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
        return self.lease

    async def update_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.lease = body
        return body


async def test_a_leader_that_cannot_renew_stops_working_within_the_duration() -> None:
    api = FlakyLeases()
    candidate = Candidate(LeaderElection(api, namespace=NAMESPACE, name="x", identity="me",
                                         duration_s=0.5, retry_s=0.05))
    candidate.start()
    try:
        await eventually(candidate.working.is_set)
        api.down = True
        await eventually(lambda: not candidate.working.is_set(), within_s=10)
        assert not candidate.election.leading
        api.down = False  # the server answers again: it holds the Lease still, and leads
        await eventually(candidate.working.is_set, within_s=10)
    finally:
        await candidate.kill()
