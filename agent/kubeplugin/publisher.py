"""Keeps the API server's ResourceSlices of this node equal to the agent's.

Three loops share one "check the server" flag:
- the agent follower long-polls ``GET /v1/resourceslices`` with the last ETag (``wait_s`` 30),
  so a geometry, health or drain change reaches the server within the 2 s goal; when the
  agent answers nothing for ``agent_lost_after_s`` (a restart plus recovery take less) the
  desired pool becomes empty, so the scheduler stops placing pods on devices nobody can
  prepare, and it is published again when the agent answers;
- the server watcher watches the node's slices (field selector on driver and node) and raises
  the flag on any change the publisher did not make itself: kubelet deletes every slice of
  its node when it starts, the garbage collector deletes them with a recreated Node;
- the reconciler lists the node's slices, plans with :func:`resource_slice_plan.plan`, applies the
  plan and compares what each write sent with what the server answered: a server whose
  feature gate is off silently drops the fields it guards (counters, taints, capacity), which
  :meth:`ResourceSlicePublisher.health` and a metric and a log event report. Three features
  fail closed from then on: without counters the devices that consume them are withdrawn;
  without consumable capacity (``allowMultipleAllocations``, request policies) every GPU is
  published whole; without taints every device with a blocking taint (``NoSchedule``,
  ``NoExecute``) is withdrawn and informational ones (``None``) are left out
  (``slice_features_withdrawn{feature}``).

Taints are known before the first write, not after: a server that drops them would show a
faulty GPU as healthy until the next write. The reconciler first creates a slice with one
taint as a dry run (``dryRun=All``: validated, admitted, answered, not stored) and reads the
answer; the written-versus-answered comparison stays as the safety net (a write that loses
its taints withdraws them at once), and a write refused (422) for its taints is written again
without them: a 1.34 server with ``DRADeviceTaints`` refuses effect ``None``, so informational
taints go first, then, refused again, every taint as above. What is learnt holds for the
process's life.

API server failures are retried with capped exponential backoff and jitter (tenacity); a
conflict re-lists and re-plans at once.

The agent's compute-domain slot (an item with ``spec.nodeSelector``, not ``nodeName``) is not
this pool's: it is handed to ``on_slot`` (``domain_slots.py``), and withdrawn there with the
pool when the agent is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception
from tenacity.wait import wait_base, wait_exponential, wait_random

from agent.kubeplugin import reasons
from agent.kubeplugin.device_health import DeviceHealthView
from agent.kubeplugin.kube import (
    KubeConflict,
    KubeError,
    KubeExpired,
    KubeForbidden,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
    ResourceSliceApi,
    WatchEvent,
)
from agent.kubeplugin.resource_slice_plan import (
    COUNTER_FIELDS,
    InvalidDesired,
    ResourceSlicePlan,
    TaintedPool,
    TaintSupport,
    Written,
    digest,
    dropped_fields,
    dropped_taints,
    for_taint_support,
    is_slot,
    plan,
    probe_answer,
    share_fields,
    taint_probe,
    taint_refusal,
    without_counters,
    without_shares,
)

log = logging.getLogger("agent.kubeplugin.publisher")

Json = dict[str, Any]
T = TypeVar("T")
NAMESPACE = "gpu_agent_plugin"
#: Kubernetes versions whose slice rules the agent knows; others are clamped into the range.
OLDEST, NEWEST = (1, 34), (1, 37)
REPUBLISH_CAUSES = ("deleted", "modified", "agent_returned")
#: The agent is local (a Unix socket): retrying it often is cheap, and once it is back the
#: pool should be too.
AGENT_RETRY_MAX_S = 2.0
CONFLICT_WAIT_S = 0.05
ERROR_KINDS = ("agent", "unavailable", "conflict", "forbidden", "invalid", "not_found",
               "other")
#: The values of ``slice_features_withdrawn{feature}``.
FEATURES = ("counters", "shares", "taints", "informational_taints")
#: Taint support from least to most; it is only ever lowered (UNKNOWN is below all: any
#: answer replaces it).
TAINT_SUPPORT_RANK = {TaintSupport.UNKNOWN: -1, TaintSupport.NONE: 0,
                      TaintSupport.BLOCKING_ONLY: 1, TaintSupport.KEPT: 2}


class ResourceSlicesAnswerLike(Protocol):
    """The agent client's answer (``agent_client.ResourceSlicesAnswer``): items None on 304."""

    @property
    def etag(self) -> str | None: ...

    @property
    def items(self) -> list[dict[str, Any]] | None: ...


class ResourceSliceSource(Protocol):
    """What the publisher needs from the agent client (``AgentClient``); any exception it
    raises counts as the agent not answering."""

    async def resource_slices(self, kubernetes: str, etag: str | None,
                              wait_s: float) -> ResourceSlicesAnswerLike: ...


@dataclass(frozen=True)
class PublisherHealth:
    """``in_sync``: the server holds the agent's pool as written; else ``reason`` says why.
    ``withheld``: what the taint fallback leaves out of it on a server without taints
    (reported, not a failure: the node works, minus its faulty devices)."""

    in_sync: bool
    reason: str | None
    dropped_fields: tuple[str, ...] = ()
    withheld: str | None = None


@dataclass(frozen=True)
class Backoff:
    """Retry delays after a failure: exponential from ``initial_s`` to ``max_s``, jittered."""

    initial_s: float = 0.2
    max_s: float = 10.0

    def waits(self) -> wait_base:
        return (wait_exponential(multiplier=self.initial_s, max=self.max_s)
                + wait_random(0, self.initial_s))


def kubernetes_version(version: tuple[int, int]) -> str:
    """The ``kubernetes=`` value for the agent: the server's version within 1.34-1.37."""
    clamped = min(max(version, OLDEST), NEWEST)
    return f"{clamped[0]}.{clamped[1]}"


class PublisherMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, text: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, text, labels, namespace=NAMESPACE, registry=registry)

        self.publishes = counter("slice_publishes",
                                 "Syncs that created or updated ResourceSlices")
        self.republishes = counter(
            "slice_republishes", "Syncs that restored slices someone else deleted or changed "
            "(kubelet deletes a node's slices when it starts), or the pool after the agent "
            "came back", ["cause"])
        self.pool_deletions = counter(
            "slice_pool_deletions", "Times the pool was deleted because the agent stayed "
            "unreachable longer than --agent-lost-after")
        self.errors = counter("slice_publisher_errors", "Failed calls of the publisher",
                              ["kind"])
        self.dropped = Gauge("slice_dropped_fields", "Fields the API server dropped from "
                             "the slices written last (a feature gate is off)",
                             namespace=NAMESPACE, registry=registry)
        self.withdrawn = Gauge(
            "slice_features_withdrawn", "1 when a feature's devices or fields are no longer "
            "published because the API server drops or refuses its fields (counters: "
            "partitionable devices withdrawn; shares: GPUs published whole, not shareable; "
            "taints: devices with a blocking taint withdrawn, informational taints left out; "
            "informational_taints: taints of effect None left out)", ["feature"],
            namespace=NAMESPACE, registry=registry)
        self.tainted_withdrawn = Gauge(
            "slice_tainted_devices_withdrawn", "Devices with a blocking taint left out of "
            "the slices because the API server keeps no taints (the fallback)",
            namespace=NAMESPACE, registry=registry)
        self.last_sync = Gauge("slice_last_sync_timestamp_seconds", "Unix time the server "
                               "last held the agent's slices", namespace=NAMESPACE,
                               registry=registry)
        for cause in REPUBLISH_CAUSES:
            self.republishes.labels(cause)
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for feature in FEATURES:
            self.withdrawn.labels(feature).set(0)


def _retried(err: BaseException) -> bool:
    """API server failures are retried; an expired watch goes back to list again."""
    return isinstance(err, KubeError) and not isinstance(err, KubeExpired)


def error_kind(err: BaseException) -> str:
    for cls, kind in ((KubeUnavailable, "unavailable"), (KubeConflict, "conflict"),
                      (KubeForbidden, "forbidden"), (KubeInvalid, "invalid"),
                      (KubeNotFound, "not_found")):
        if isinstance(err, cls):
            return kind
    return "other"


class ResourceSlicePublisher:
    """Publishes the agent's ResourceSlices for this node until cancelled (:meth:`run`)."""

    def __init__(self, agent: ResourceSliceSource, kube: ResourceSliceApi, *, node_name: str,
                 driver: str,
                 agent_lost_after_s: float = 60.0, registry: CollectorRegistry,
                 agent_wait_s: float = 30.0, backoff: Backoff | None = None,
                 on_slot: Callable[[Json | None], None] | None = None) -> None:
        self._agent = agent
        #: Where the agent's compute-domain slot goes (``domain_slots.py``): never this
        #: pool's, whose list and watch select on ``spec.nodeName``.
        self._on_slot = on_slot
        self._kube = kube
        self.node_name = node_name
        self.driver = driver
        self._lost_after = agent_lost_after_s
        self._wait_s = agent_wait_s
        self._backoff = backoff or Backoff()
        self._waits = self._backoff.waits()
        self.metrics = PublisherMetrics(registry)
        self.kubernetes: str | None = None
        self._dirty = asyncio.Event()
        self._desired: list[Json] | None = None
        self._agent_lost = False
        self._agent_returned = False
        self._agent_problem: str | None = None
        self._server_problem: str | None = None
        self._synced = False
        self._node_uid: str | None = None
        self._written: dict[str, Written] = {}
        self._dropped: tuple[str, ...] = ()
        #: The server dropped counters once: devices that consume them stay withdrawn until
        #: the plugin restarts (a server does not turn a feature gate on while it runs).
        self._counters_dropped = False
        #: The server dropped consumable capacity once: GPUs are published whole, as above.
        self._shares_dropped: tuple[str, ...] = ()
        #: What the server does with device taints: probed (dry run) before the first write,
        #: lowered when a write shows less; never raised while the plugin runs.
        self._taints = TaintSupport.UNKNOWN
        self._taints_found = ""
        #: What the last sync left out of the agent's pool for the server's taint support.
        self._tainted = TaintedPool(())
        #: Each device's health as the agent last rendered it (claim status, health stream).
        self.device_health = DeviceHealthView()

    def health(self) -> PublisherHealth:
        found = []
        if self._agent_lost:
            found.append(f"{reasons.POOL_DELETED} {self._lost_after:g}s: pool deleted "
                           f"({self._agent_problem})")
        elif self._agent_problem:
            found.append(self._agent_problem)
        if self._server_problem:
            found.append(self._server_problem)
        if self._desired is None and not self._agent_lost:
            found.append(reasons.NO_SLICES_YET.says())
        elif not self._synced and not self._server_problem:
            found.append(reasons.NOT_PUBLISHED_YET.says())
        if self._dropped:
            found.append(f"{reasons.FIELDS_DROPPED} (a feature gate off?): "
                           + ", ".join(self._dropped)
                           + ("; devices that consume counters are withdrawn"
                              if self._counters_dropped else "")
                           + ("; GPUs are published whole, not shareable (shares need "
                              "DRAConsumableCapacity)" if self._shares_dropped else ""))
        withheld = self._taint_reasons()
        return PublisherHealth(in_sync=not found, reason="; ".join(found) or None,
                               dropped_fields=self._dropped,
                               withheld="; ".join(withheld) or None)

    def _taint_reasons(self) -> list[str]:
        """Why the server's slices differ from the agent's for taints: only while the
        fallback leaves something out (a server without taints and nothing tainted is in
        sync; the metric says it anyway)."""
        hidden = self._tainted
        if not hidden.withdrawn and not hidden.stripped:
            return []
        server = {
            TaintSupport.UNKNOWN: reasons.TAINTS_UNKNOWN.text,
            TaintSupport.BLOCKING_ONLY: f"{reasons.TAINTS_BLOCKING_ONLY} (effect None; "
                                        f"{self._taints_found})",
        }.get(self._taints,
              f"{reasons.TAINTS_NONE} (DRADeviceTaints off?; {self._taints_found})")
        left_out = []
        if hidden.withdrawn:
            left_out.append("devices with a blocking taint withdrawn: " + ", ".join(
                f"{device} ({taints})" for device, taints in hidden.withdrawn))
        if hidden.stripped:
            left_out.append(f"informational taints left out: {hidden.stripped}")
        return [f"{server}: {'; '.join(left_out)}"]

    async def run(self) -> None:
        """Publish until cancelled."""
        version = await self._retrying(reasons.CALL_SERVER_VERSION.text,
                                       self._kube.server_version)
        self.kubernetes = kubernetes_version(version)
        if self.kubernetes != f"{version[0]}.{version[1]}":
            log.warning("api server version outside the supported range",
                        extra={"server": f"{version[0]}.{version[1]}",
                               "rendered_for": self.kubernetes})
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._follow_agent(self.kubernetes))
            tasks.create_task(self._watch_server())
            tasks.create_task(self._reconcile_forever())

    # --- the agent ---

    async def _follow_agent(self, kubernetes: str) -> None:
        etag: str | None = None
        failing_since: float | None = None
        delay = self._backoff.initial_s
        while True:
            try:
                # A hung agent is a lost agent too: no answer past the long-poll's own limit.
                async with asyncio.timeout(self._wait_s + 10):
                    answer = await self._agent.resource_slices(kubernetes, etag, self._wait_s)
            except Exception as err:  # whatever the client raises: the agent did not answer
                # The next ask is unconditional: an agent back with the same content would
                # otherwise hold it for wait_s before saying so.
                etag = None
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                self._agent_problem = reasons.AGENT_NOT_ANSWERING.says(
                    f"{type(err).__name__}: {err}")
                self.metrics.errors.labels("agent").inc()
                left = failing_since + self._lost_after - now
                if not self._agent_lost and left <= 0:
                    self._agent_lost = True
                    log.warning("agent lost: deleting the pool",
                                extra={"after_s": round(now - failing_since, 1),
                                       "problem": self._agent_problem})
                    self._dirty.set()
                    if self._on_slot is not None:
                        self._on_slot(None)  # a slot nobody can prepare for: withdrawn
                    await self.device_health.update(None)
                await asyncio.sleep(delay if self._agent_lost else min(delay, max(left, 0.0)))
                delay = min(delay * 2, self._backoff.max_s, AGENT_RETRY_MAX_S)
                continue
            failing_since, delay, self._agent_problem = None, self._backoff.initial_s, None
            if self._agent_lost:
                self._agent_lost, self._agent_returned = False, True
                log.info("agent answers again: republishing the pool")
                self._dirty.set()
            if answer.items is not None:
                slots = [item for item in answer.items if is_slot(item)]
                etag = answer.etag
                self._desired = [item for item in answer.items if not is_slot(item)]
                if self._on_slot is not None:
                    self._on_slot(slots[0] if slots else None)
                self._dirty.set()
                await self.device_health.update(self._desired)

    # --- the server ---

    async def _watch_server(self) -> None:
        async def list_and_watch() -> None:
            """List (whatever happened while not watching is looked at), then watch until
            the server ends the watch; the next round lists again, which doubles as a
            periodic resync."""
            listing = await self._kube.list_resource_slices(driver=self.driver,
                                                            node=self.node_name)
            self._dirty.set()
            async for event in self._kube.watch_resource_slices(
                    driver=self.driver, node=self.node_name,
                    resource_version=listing.resource_version):
                if event.type != "BOOKMARK" and not self._made_here(event):
                    name = str(event.object.get("metadata", {}).get("name", ""))
                    log.info("resourceslice changed on the server",
                             extra={"event": event.type, "slice": name})
                    if name in self._written:
                        # Someone else changed or deleted what was published (kubelet's
                        # wipe at its start): not in sync until the next sync restores it.
                        self._synced = False
                    self._dirty.set()

        while True:
            with contextlib.suppress(KubeExpired):  # too old to resume: list again
                await self._retrying(reasons.CALL_WATCH.text, list_and_watch)

    def _made_here(self, event: WatchEvent) -> bool:
        """Whether the event reports this publisher's own create or update. Deletions are
        always looked at: the reconcile that follows finds nothing to do when they were
        the publisher's own, and a stale record cannot hide someone else's."""
        if event.type == "DELETED":
            return False
        mine = self._written.get(str(event.object.get("metadata", {}).get("name", "")))
        return mine is not None and mine.resource_version == event.resource_version

    # --- reconciling ---

    async def _reconcile_forever(self) -> None:
        # Before the first write: a server that drops taints would otherwise show a faulty
        # GPU as healthy until the next write noticed.
        await self._retrying(reasons.CALL_TAINT_PROBE.text, self._probe_taints)
        while True:
            await self._dirty.wait()
            await self._retrying(reasons.CALL_PUBLISH.text, self._sync)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` until it returns, retried with backoff on API server errors (an expired
        watch goes back to the caller)."""
        async for attempt in AsyncRetrying(
                retry=retry_if_exception(_retried),
                wait=self._wait_for, before_sleep=self._note_failure(what), reraise=True):
            with attempt:
                result = await call()
                self._server_problem = None
                return result
        raise AssertionError("unreachable: tenacity retries forever here")

    def _wait_for(self, state: RetryCallState) -> float:
        err = state.outcome.exception() if state.outcome else None
        if isinstance(err, KubeConflict):
            return CONFLICT_WAIT_S  # someone wrote since the list: read again soon
        wait = self._waits(state)
        if isinstance(err, KubeUnavailable) and err.retry_after_s is not None:
            wait = max(wait, min(err.retry_after_s, self._backoff.max_s))
        return float(wait)

    def _note_failure(self, what: str) -> Callable[[RetryCallState], None]:
        def note(state: RetryCallState) -> None:
            err = state.outcome.exception() if state.outcome else None
            if err is None:
                return
            kind = error_kind(err)
            self.metrics.errors.labels(kind).inc()
            if kind != "conflict":
                self._server_problem = f"{what}: {type(err).__name__}: {err}"
            log.warning("api server call failed", extra={
                "call": what, "kind": kind, "error": str(err),
                "attempt": state.attempt_number})
        return note

    async def _probe_taints(self) -> None:
        """Ask the server, with a dry-run create of a tainted slice, whether it keeps taints;
        a refusal of its content means it does not."""
        probe = taint_probe(node_name=self.node_name, driver=self.driver)
        try:
            answer = await self._kube.create_resource_slice(probe, dry_run=True)
        except KubeInvalid as err:
            self.metrics.errors.labels("invalid").inc()
            self._lower_taints(TaintSupport.NONE, f"a tainted slice refused: {err}")
            return
        self._lower_taints(probe_answer(probe, answer), "found by a dry-run create")

    def _lower_taints(self, support: TaintSupport, found: str) -> None:
        """Record what the server does with taints (only ever less than known), say so once,
        and have the pool written for it."""
        if self._taints is not TaintSupport.UNKNOWN and \
                TAINT_SUPPORT_RANK[support] >= TAINT_SUPPORT_RANK[self._taints]:
            return
        self._taints, self._taints_found = support, found
        self._dirty.set()
        self.metrics.withdrawn.labels("taints").set(1 if support is TaintSupport.NONE else 0)
        self.metrics.withdrawn.labels("informational_taints").set(
            0 if support is TaintSupport.KEPT else 1)
        extra = {"taints": support.value, "found": found, "kubernetes": self.kubernetes}
        if support is TaintSupport.KEPT:
            log.info("api server keeps device taints", extra=extra)
        elif support is TaintSupport.BLOCKING_ONLY:
            log.warning("api server refuses informational device taints: they are left out",
                        extra=extra)
        else:
            # Fail closed: a device that must keep claims off is not published at all.
            log.error("api server keeps no device taints: devices with a blocking taint "
                      "withdrawn, informational taints left out (enable DRADeviceTaints on "
                      "the API server and the scheduler)", extra=extra)

    async def _sync(self) -> None:
        """One reconcile: list, plan, apply; raises on the first failed call."""
        self._dirty.clear()
        if self._desired is None and not self._agent_lost:
            return  # nothing known yet: leave what the server has (a plugin restart)
        desired: Sequence[Mapping[str, Any]] = [] if self._agent_lost else (self._desired or [])
        if self._counters_dropped:
            desired = without_counters(desired)
        if self._shares_dropped:
            desired = without_shares(desired)
        self._tainted = for_taint_support(desired, self._taints)
        self.metrics.tainted_withdrawn.set(len(self._tainted.withdrawn))
        desired = self._tainted.items
        listing = await self._kube.list_resource_slices(driver=self.driver,
                                                        node=self.node_name)
        if desired and self._node_uid is None:
            self._node_uid = await self._read_node_uid()
        try:
            actions = self._plan(desired, listing.items)
            if actions.writes:
                # A wipe may come from the garbage collector after the Node was recreated:
                # owning slices by the old UID would see them deleted again.
                uid = await self._read_node_uid()
                if uid != self._node_uid:
                    self._node_uid = uid
                    actions = self._plan(desired, listing.items)
        except InvalidDesired as err:
            self._server_problem = reasons.AGENT_SLICES_UNUSABLE.says(str(err))
            log.error("agent slices unusable", extra={"error": str(err)})
            return
        cause = self._cause(actions)
        try:
            await self._apply(actions)
        except KubeInvalid as err:
            lower = taint_refusal(self._taints, [*actions.updates, *actions.creates], str(err))
            if lower is None or TAINT_SUPPORT_RANK[lower] >= TAINT_SUPPORT_RANK[self._taints]:
                raise  # not about taints (or nothing left to drop): retried, and reported
            # Refused for its taints: written again at once without what was refused.
            self.metrics.errors.labels("invalid").inc()
            self._lower_taints(lower, f"a write refused: {err}")
            return
        if actions.writes:
            self.metrics.publishes.inc()
            log.info("resourceslices published", extra={
                "generation": actions.generation, "slices_created": len(actions.creates),
                "slices_updated": len(actions.updates), "slices_deleted": len(actions.deletes),
                "cause": cause or "agent",
                "tainted_devices_withdrawn": len(self._tainted.withdrawn)})
            if cause is not None:
                self.metrics.republishes.labels(cause).inc()
        if self._agent_lost and actions.deletes:
            self.metrics.pool_deletions.inc()
            log.warning("pool deleted: the agent is unreachable",
                        extra={"deleted": len(actions.deletes)})
        if not self._agent_lost:
            self._agent_returned = False
        self._synced = True
        self.metrics.last_sync.set(time.time())

    def _plan(self, desired: Sequence[Mapping[str, Any]],
              existing: Sequence[Mapping[str, Any]]) -> ResourceSlicePlan:
        return plan(desired, existing, node_name=self.node_name, node_uid=self._node_uid or "",
                    driver=self.driver, written=self._written)

    async def _read_node_uid(self) -> str:
        node = await self._kube.get_node(self.node_name)
        return str(node["metadata"]["uid"])

    def _cause(self, actions: ResourceSlicePlan) -> str | None:
        """Why a plan restores slices the publisher had already written, if it does."""
        if not actions.writes:
            return None
        if self._agent_returned:
            return "agent_returned"
        if any(body["metadata"]["name"] in self._written for body in actions.creates):
            return "deleted"
        in_sync = set(actions.in_sync)
        if any((mine := self._written.get(body["metadata"]["name"])) is not None
               and mine.resource_version != body["metadata"].get("resourceVersion")
               and mine.digest == digest(body) and body["metadata"]["name"] not in in_sync
               for body in actions.updates):
            return "modified"
        return None

    async def _apply(self, actions: ResourceSlicePlan) -> None:
        for gone in actions.deletes:
            with contextlib.suppress(KubeNotFound):  # already gone: what was wanted
                await self._kube.delete_resource_slice(
                    gone.name, uid=gone.uid, resource_version=gone.resource_version)
            self._written.pop(gone.name, None)
        dropped: set[str] = set()
        for body, write in ([(b, self._kube.update_resource_slice) for b in actions.updates]
                            + [(b, self._kube.create_resource_slice) for b in actions.creates]):
            answer = await write(body)
            self._remember(body, answer, actions.generation)
            dropped.update(dropped_fields(body, answer))
        if actions.writes:
            self._report_dropped(tuple(sorted(dropped)))
        elif not self._written:
            self._report_dropped(())  # nothing of ours on the server: nothing dropped

    def _remember(self, body: Json, answer: Mapping[str, Any], generation: int) -> None:
        name = str(body["metadata"]["name"])
        version = str(answer.get("metadata", {}).get("resourceVersion", ""))
        self._written[name] = Written(resource_version=version, digest=digest(body),
                                      generation=generation)

    def _report_dropped(self, dropped: tuple[str, ...]) -> None:
        taints = dropped_taints(dropped)
        if taints:
            # The probe said otherwise (another API server behind the same address?): this
            # write showed a tainted device untainted, so withdraw it now.
            self._lower_taints(TaintSupport.NONE, "a write dropped them")
            dropped = tuple(f for f in dropped if f not in taints)
        if not self._counters_dropped and any(f in dropped for f in COUNTER_FIELDS):
            # Fail closed: placements without counters would let the scheduler book two
            # overlapping MIG devices, so withdraw them now (the next sync writes the pool
            # without them) and keep reporting why.
            self._counters_dropped = True
            self._dirty.set()
            log.error("api server keeps no counters: partitionable devices withdrawn "
                      "(enable DRAPartitionableDevices or run without --dynamic-mig)",
                      extra={"fields": ",".join(dropped), "kubernetes": self.kubernetes})
        shares = share_fields(dropped)
        if shares and not self._shares_dropped:
            # Fail closed the same way: a shareable GPU the server keeps as exclusive would
            # take each claim whole while the agent counts memory shares; publish it whole.
            self._shares_dropped = shares
            self.metrics.withdrawn.labels("shares").set(1)
            self._dirty.set()
            log.error("api server keeps no consumable capacity: GPUs published whole, not "
                      "shareable (enable DRAConsumableCapacity or run without --gpu-shares)",
                      extra={"fields": ",".join(shares), "kubernetes": self.kubernetes})
        if self._counters_dropped:
            self.metrics.withdrawn.labels("counters").set(1)
            dropped = tuple(sorted(set(dropped) | {f for f in COUNTER_FIELDS
                                                   if f in self._dropped or f in dropped}))
        if self._shares_dropped:
            dropped = tuple(sorted(set(dropped) | set(self._shares_dropped)))
        if dropped != self._dropped:
            if dropped:
                log.warning("api server dropped resourceslice fields", extra={
                    "fields": ",".join(dropped), "kubernetes": self.kubernetes,
                    "hint": "a feature gate guarding them is off on the API server"})
            else:
                log.info("api server keeps every resourceslice field again")
        self._dropped = dropped
        self.metrics.dropped.set(len(dropped))
