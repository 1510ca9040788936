"""One plugin of the cluster does a cluster-wide job (``domain_explainer.py``): the holder of
a ``coordination.k8s.io`` Lease, as Kubernetes's own controllers elect their leader.

Every plugin reads the Lease every ``retry_s``; the holder renews it (an update carrying the
resourceVersion it read, so two takers cannot both win). A Lease nobody renewed for
``duration_s`` of this plugin's own clock (not the holder's timestamps: node clocks differ) is
taken over. A holder that cannot renew for ``duration_s`` stops its work before anyone may
take over, so two plugins never work at once for longer than a call takes. One read per
plugin per ``retry_s`` and one write per ``retry_s`` in all: the cost does not grow with the
number of domains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from agent.kubeplugin.kube import KubeConflict, KubeError, KubeNotFound

log = logging.getLogger("agent.kubeplugin.lease")

Json = dict[str, Any]
DURATION_S = 60.0
RETRY_S = DURATION_S / 4


class LeaseApi(Protocol):
    """What election needs of the API server (:class:`agent.kubeplugin.kube.KubeClient`)."""

    async def get_lease(self, namespace: str, name: str) -> Json: ...

    async def create_lease(self, namespace: str, body: Json) -> Json: ...

    async def update_lease(self, namespace: str, body: Json) -> Json: ...


@dataclass
class _Seen:
    """The Lease as last read: its resourceVersion, and when (this plugin's clock) it was
    first seen at that version."""

    version: str
    since: float


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    """Runs ``work`` while this plugin holds the Lease ``namespace/name``."""

    def __init__(self, kube: LeaseApi, *, namespace: str, name: str, identity: str,
                 duration_s: float = DURATION_S, retry_s: float = RETRY_S) -> None:
        self._kube = kube
        self.namespace, self.name, self.identity = namespace, name, identity
        self._duration_s = duration_s
        self._retry_s = retry_s
        self._seen: _Seen | None = None
        #: When this plugin last renewed (or took) the Lease; None: not the holder.
        self._renewed: float | None = None

    @property
    def leading(self) -> bool:
        return self._renewed is not None

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Try for the Lease every ``retry_s``; run ``work`` (a task) while holding it and
        cancel it once the Lease is lost or cannot be renewed for ``duration_s``."""
        loop = asyncio.get_running_loop()
        task: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    await self._try(loop.time())
                except KubeError as err:
                    log.warning("reading or renewing the leader lease failed",
                                extra={"lease": self.name, "error": str(err)})
                if self._renewed is not None and \
                        loop.time() - self._renewed >= self._duration_s:
                    self._lost("it could not be renewed")
                if self.leading and task is None:
                    log.info("leader lease held", extra={"lease": self.name})
                    task = asyncio.create_task(work(), name=f"leading-{self.name}")
                elif not self.leading and task is not None:
                    await _cancel(task)
                    task = None
                await asyncio.sleep(self._retry_s)
        finally:
            if task is not None:
                await _cancel(task)

    def _lost(self, why: str) -> None:
        if self._renewed is not None:
            log.warning("leader lease lost", extra={"lease": self.name, "why": why})
        self._renewed = None

    async def _try(self, now: float) -> None:
        try:
            lease = await self._kube.get_lease(self.namespace, self.name)
        except KubeNotFound:
            await self._create(now)
            return
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        version = str(meta.get("resourceVersion", ""))
        if self._seen is None or self._seen.version != version:
            self._seen = _Seen(version, now)
        holder = spec.get("holderIdentity")
        if holder != self.identity:
            self._lost(f"held by {holder}")
            if holder and now - self._seen.since < self._duration_s:
                return  # renewed by its holder within the duration, as far as we can see
        body = dict(lease)
        body["spec"] = {**spec, "holderIdentity": self.identity, "renewTime": _now(),
                        "leaseDurationSeconds": int(self._duration_s)}
        if holder != self.identity:
            body["spec"]["acquireTime"] = body["spec"]["renewTime"]
            body["spec"]["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        try:
            await self._kube.update_lease(self.namespace, body)
        except KubeConflict:
            self._lost("another plugin wrote it first")
            return
        self._renewed = now

    async def _create(self, now: float) -> None:
        stamp = _now()
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "acquireTime": stamp,
                         "renewTime": stamp, "leaseDurationSeconds": int(self._duration_s),
                         "leaseTransitions": 0}}
        try:
            await self._kube.create_lease(self.namespace, body)
        except KubeConflict:
            return  # another plugin created it: read it next round
        self._renewed = now


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
