"""Saying why a compute-domain claim stays unallocated: kube-scheduler's reason is only
"cannot allocate all claims", so the one plugin holding the explainer Lease (``lease.py``)
looks, every ``interval_s``, at the claims no one allocated and the slots each clique offers,
and gives a claim larger than every clique a Warning Event naming the largest clique
(``kubectl describe resourceclaim`` shows it; the pod's own events show the scheduler's).

One writer in the cluster, a few reads a round whatever the number of nodes, and an Event
only when a claim's reason is new (a new leader says each once more). The pods get no Event
of their own: that would need every node's plugin to read every pod of the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from agent.kubeplugin.domain_fit import domain_size, slots_by_clique, unfit_reason
from agent.kubeplugin.kube import KubeError

log = logging.getLogger("agent.kubeplugin.domain_explainer")

Json = dict[str, Any]
INTERVAL_S = 30.0
REASON = "ComputeDomainUnfit"
#: The Lease the explaining plugin holds (in the plugin's namespace).
LEASE = "gpu-node-agent-domain-explainer"


class ExplainerApi(Protocol):
    """What explaining needs of the API server (:class:`agent.kubeplugin.kube.KubeClient`)."""

    async def list_driver_slices(self, driver: str) -> list[Json]: ...

    async def list_resource_claims(self) -> list[Json]: ...

    async def create_event(self, namespace: str, body: Json) -> Json: ...


def claim_event(claim: Mapping[str, Any], message: str, *, node: str) -> Json:
    """The Warning Event on ``claim`` saying ``message`` (pure)."""
    meta = claim.get("metadata") or {}
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "namespace": meta.get("namespace"), "name": meta.get("name"),
                           "uid": meta.get("uid")},
        "type": "Warning", "reason": REASON, "message": message,
        "source": {"component": "gpu-node-agent-kubelet-plugin", "host": node},
        "reportingComponent": "gpu-node-agent-kubelet-plugin", "reportingInstance": node,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}


class DomainExplainer:
    def __init__(self, kube: ExplainerApi, *, driver: str, node_name: str,
                 registry: CollectorRegistry, interval_s: float = INTERVAL_S) -> None:
        self._kube = kube
        self._driver = driver
        self._node = node_name
        self._interval_s = interval_s
        #: What each claim (by UID) was last told.
        self._said: dict[str, str] = {}
        self.events = Counter("gpu_agent_plugin_domain_unfit_events",
                              "Warning Events written on compute-domain claims no clique can "
                              "hold", registry=registry)

    async def run(self) -> None:
        """A round every ``interval_s`` (while this plugin leads)."""
        self._said.clear()  # a new term: say each reason once more
        while True:
            try:
                await self.round()
            except KubeError as err:
                log.warning("explaining pending compute domains failed",
                            extra={"error": str(err)})
            await asyncio.sleep(self._interval_s)

    async def round(self) -> None:
        """Read the slots and the unallocated domain claims; tell each unfit claim why."""
        slots = slots_by_clique(await self._kube.list_driver_slices(self._driver),
                                self._driver)
        present = set()
        for claim in await self._kube.list_resource_claims():
            meta = claim.get("metadata") or {}
            uid = str(meta.get("uid", ""))
            size = domain_size(claim, self._driver)
            reason = unfit_reason(size, slots) if size is not None else None
            if reason is None:
                continue
            present.add(uid)
            if self._said.get(uid) == reason:
                continue
            await self._kube.create_event(str(meta.get("namespace")),
                                          claim_event(claim, reason, node=self._node))
            self._said[uid] = reason
            self.events.inc()
            log.info("compute-domain claim cannot be placed", extra={
                "claim": f"{meta.get('namespace')}/{meta.get('name')}", "reason": reason})
        for uid in set(self._said) - present:
            del self._said[uid]
