"""Publishes this node's compute-domain slot (``agent/dra/domain_slot.py``) and the Node label
its slice selects on.

The agent renders the slot as the last item of ``GET /v1/resourceslices``: a slice with
``spec.nodeSelector`` (no ``nodeName``), pool ``<node>/compute-domain``. The ResourceSlice
publisher follows the agent, keeps the GPUs' pool and hands the slot here (:meth:`want`); its
list and watch select on ``spec.nodeName``, which this slice has not, so it is reconciled here
by name:

- wanted: label the Node ``<driver>/fabric-clique=<value>`` first (the value the slice's node
  selector names), then create the slice, or update it (with its resourceVersion) when its
  content differs; the owner reference to the Node (``controller: true``) as for the GPUs'
  slices, so the garbage collector removes it with the Node; each write's generation is one
  above the server's;
- not wanted (the fabric is no longer usable, or the agent is lost): delete the slice (UID
  and resourceVersion preconditions) first, then remove the label, so no pod is placed on the
  clique by this node's slot while it is being withdrawn.

Level-triggered: :func:`decide` (pure) compares what is wanted with the Node and the slice as
read; a watch of the slice by name wakes the loop when anyone else changes or deletes it (it
is recreated), and every new watch lists first, which doubles as a resync. API server
failures are retried with the publisher's backoff; a conflict reads again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from agent.device_names import clique_label, slot_slice_name
from agent.kubeplugin import reasons
from agent.kubeplugin.kube import (
    SLICES_PATH,
    KubeConflict,
    KubeError,
    KubeExpired,
    KubeNotFound,
    WatchEvent,
)
from agent.kubeplugin.publisher import CONFLICT_WAIT_S, Backoff
from agent.kubeplugin.resource_slice_plan import owner_reference

log = logging.getLogger("agent.kubeplugin.domain_slots")

Json = dict[str, Any]


class SlotKube(Protocol):
    """What the slot needs from the API server (:class:`~agent.kubeplugin.kube.KubeClient`)."""

    async def get_node(self, name: str) -> Json: ...

    async def list_named(self, collection: str, name: str) -> tuple[str, Json | None]: ...

    def watch_named(self, collection: str, name: str,
                    resource_version: str) -> AsyncIterator[WatchEvent]: ...

    async def create_resource_slice(self, body: Json, *, dry_run: bool = False) -> Json: ...

    async def update_resource_slice(self, body: Json) -> Json: ...

    async def delete_resource_slice(self, name: str, *, uid: str,
                                    resource_version: str) -> None: ...

    async def patch_node_metadata(self, name: str, *,
                                  labels: Mapping[str, str | None] | None = None,
                                  annotations: Mapping[str, str | None] | None = None
                                  ) -> Json: ...


def selected_value(slot: Mapping[str, Any], label: str) -> str | None:
    """The value of ``label`` the slot's node selector asks for (the agent's one truth of the
    label value), or None when it names none."""
    for term in slot.get("spec", {}).get("nodeSelector", {}).get("nodeSelectorTerms") or []:
        for expression in term.get("matchExpressions") or []:
            values = expression.get("values") or []
            if expression.get("key") == label and expression.get("operator") == "In" \
                    and len(values) == 1:
                return str(values[0])
    return None


@dataclass(frozen=True)
class SetLabel:
    value: str | None
    """None removes it."""


@dataclass(frozen=True)
class Write:
    body: Json
    create: bool


@dataclass(frozen=True)
class Delete:
    uid: str
    resource_version: str


Step = SetLabel | Write | Delete


def _holds(actual: Any, wanted: Any) -> bool:
    """Whether ``actual`` carries every field of ``wanted`` with its value (what the server
    adds, defaults, is not a difference)."""
    if isinstance(wanted, Mapping):
        return isinstance(actual, Mapping) and all(_holds(actual.get(k), v)
                                                   for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(
            _holds(a, w) for a, w in zip(actual, wanted, strict=True))
    return bool(actual == wanted)


def desired_body(slot: Mapping[str, Any], *, node_name: str, node_uid: str,
                 existing: Mapping[str, Any] | None) -> Json:
    """The slice to write: the agent's, owned by the Node, one generation above the
    server's (1 for a new one), with the server's resourceVersion for an update."""
    metadata: Json = {"name": slot["metadata"]["name"],
                      "ownerReferences": [owner_reference(node_name, node_uid)]}
    generation = 1
    if existing is not None:
        metadata["resourceVersion"] = existing["metadata"].get("resourceVersion", "")
        old = existing.get("spec", {}).get("pool", {}).get("generation", 0)
        generation = (old if isinstance(old, int) else 0) + 1
    spec = dict(slot["spec"])
    spec["pool"] = {**spec["pool"], "generation": generation}
    return {"apiVersion": slot.get("apiVersion", "resource.k8s.io/v1"),
            "kind": "ResourceSlice", "metadata": metadata, "spec": spec}


def in_sync(slot: Mapping[str, Any], existing: Mapping[str, Any], *, node_name: str,
            node_uid: str) -> bool:
    """Whether the server's slice is the slot as wanted (generation aside)."""
    spec = {k: v for k, v in slot["spec"].items() if k != "pool"}
    pool = {k: v for k, v in slot["spec"]["pool"].items() if k != "generation"}
    owners = existing.get("metadata", {}).get("ownerReferences") or []
    return (_holds(existing.get("spec"), {**spec, "pool": pool})
            and set(existing.get("spec", {})) <= {*slot["spec"]}
            and any(o.get("kind") == "Node" and o.get("uid") == node_uid
                    and o.get("name") == node_name and o.get("controller") for o in owners))


def decide(slot: Mapping[str, Any] | None, *, node: Mapping[str, Any],
           existing: Mapping[str, Any] | None, driver: str) -> list[Step]:
    """The writes that bring the server to ``slot`` (None: no slot), in order: the label
    before a slice is published, the slice deleted before its label goes."""
    label = clique_label(driver)
    now = (node.get("metadata", {}).get("labels") or {}).get(label)
    metadata = node.get("metadata", {})
    name, uid = str(metadata.get("name", "")), str(metadata.get("uid", ""))
    steps: list[Step] = []
    if slot is None or slot.get("metadata", {}).get("name") != slot_slice_name(name):
        # No slot, or one this node cannot own (its name is the node's): withdrawn.
        if existing is not None:
            steps.append(Delete(uid=str(existing["metadata"].get("uid", "")),
                                resource_version=str(existing["metadata"].get(
                                    "resourceVersion", ""))))
        if now is not None:
            steps.append(SetLabel(None))
        return steps
    value = selected_value(slot, label)
    if value is not None and now != value:
        steps.append(SetLabel(value))
    if existing is None or not in_sync(slot, existing, node_name=name, node_uid=uid):
        steps.append(Write(desired_body(slot, node_name=name, node_uid=uid, existing=existing),
                           create=existing is None))
    return steps


def _retried(err: BaseException) -> bool:
    return isinstance(err, KubeError) and not isinstance(err, KubeExpired)


class DomainSlots:
    """Keeps the server's compute-domain slot of this node as the agent wants it (:meth:`run`
    until cancelled)."""

    def __init__(self, kube: SlotKube, *, node_name: str, driver: str,
                 backoff: Backoff | None = None) -> None:
        self._kube = kube
        self.node_name = node_name
        self.driver = driver
        self._backoff = backoff or Backoff()
        self._waits = self._backoff.waits()
        self._dirty = asyncio.Event()
        self._known = False  # nothing heard from the agent yet: leave the server alone
        self._slot: Json | None = None
        self.name = slot_slice_name(node_name)
        self._written: str | None = None  # resourceVersion of the last write
        self.problem: str | None = None

    def want(self, slot: Mapping[str, Any] | None) -> None:
        """The agent's slot now (None: none, e.g. the fabric is not usable or the agent is
        lost); called on the event loop by the publisher."""
        wanted = dict(slot) if slot is not None else None
        if self._known and wanted == self._slot:
            return
        self._known, self._slot = True, wanted
        self._dirty.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch())
            tasks.create_task(self._reconcile_forever())

    async def _reconcile_forever(self) -> None:
        while True:
            await self._dirty.wait()
            await self._retrying(self._sync)

    async def _sync(self) -> None:
        self._dirty.clear()
        if not self._known:
            return
        node = await self._kube.get_node(self.node_name)
        _, existing = await self._kube.list_named(SLICES_PATH, self.name)
        steps = decide(self._slot, node=node, existing=existing, driver=self.driver)
        for step in steps:
            if isinstance(step, SetLabel):
                await self._kube.patch_node_metadata(
                    self.node_name, labels={clique_label(self.driver): step.value})
            elif isinstance(step, Write):
                answer = await (self._kube.create_resource_slice(step.body) if step.create
                                else self._kube.update_resource_slice(step.body))
                self._written = str(answer.get("metadata", {}).get("resourceVersion", ""))
            else:
                with contextlib.suppress(KubeNotFound):  # already gone: what was wanted
                    await self._kube.delete_resource_slice(
                        self.name, uid=step.uid, resource_version=step.resource_version)
                self._written = None
        if steps:
            log.info("compute-domain slot reconciled", extra={
                "slot": self.name, "wanted": self._slot is not None,
                "steps": ",".join(type(s).__name__ for s in steps)})
        self.problem = None

    async def _watch(self) -> None:
        """Wake the reconcile when someone else changes or deletes the slot's slice."""
        async def list_and_watch() -> None:
            name = self.name
            version, _ = await self._kube.list_named(SLICES_PATH, name)
            self._dirty.set()
            async for event in self._kube.watch_named(SLICES_PATH, name, version):
                if event.type == "BOOKMARK":
                    continue
                if event.type != "DELETED" and event.resource_version == self._written:
                    continue  # this process's own write
                log.info("compute-domain slot changed on the server",
                         extra={"event": event.type, "slice": name})
                self._dirty.set()

        while True:
            with contextlib.suppress(KubeExpired):
                await self._retrying(list_and_watch)

    async def _retrying(self, call: Any) -> None:
        async for attempt in AsyncRetrying(retry=retry_if_exception(_retried),
                                           wait=self._wait_for, before_sleep=self._note,
                                           reraise=True):
            with attempt:
                await call()
                return

    def _wait_for(self, state: RetryCallState) -> float:
        err = state.outcome.exception() if state.outcome else None
        if isinstance(err, KubeConflict):
            return CONFLICT_WAIT_S
        return float(self._waits(state))

    def _note(self, state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        if err is None:
            return
        self.problem = reasons.SLOT_NOT_WRITTEN.says(f"{type(err).__name__}: {err}")
        log.warning("api server call failed", extra={
            "call": "compute-domain slot", "error": str(err), "attempt": state.attempt_number})
