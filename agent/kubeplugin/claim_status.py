"""ResourceClaim device status (KEP-4817): what the plugin writes into ``status.devices[]`` of
the claims it prepared, and the writer that keeps it current.

For each allocation result of this driver and this node's pool that a prepare succeeded for,
one entry keyed as the API server keys it (driver, pool, device, shareID; the same list-map
keys in 1.34 and 1.37), with
- a ``Ready`` condition (True, reason ``Prepared``) while the claim is prepared here;
- a ``Healthy`` condition that follows the device's taints as the agent publishes them (read
  only from :class:`~agent.kubeplugin.device_health.DeviceHealthView`): True with no taint or
  only informational (``None``) ones, False (reason ``Tainted``) with a blocking one, Unknown
  while the agent does not answer or does not publish the device; the taints are the message;
- ``data``: what a user needs to find the device: UUID (and the parent GPU's for MIG), MIG
  profile, instance IDs and placement, the sharing in force, the MPS pipe directory and
  limits, the share's memory and ``shareID``, the CDI device names.

Written with server-side apply under the driver's name as field manager, so the entries are
this driver's alone, and an apply with none of them removes them (unprepare). A condition's
``lastTransitionTime`` moves only when its status changes.

The writer never holds up kubelet: :meth:`ClaimStatusWriter.prepared` and
:meth:`~ClaimStatusWriter.unprepared` only record what the claim's status should be and
return; a few workers apply it (:data:`WRITES_AT_ONCE`, one write per claim at a time, the
latest wanted status wins) and retry a failed write with capped backoff, counted. A task
follows the health view and re-applies only the claims whose status changed with it. At start
the claims the agent holds are read back (the agent's checkpoint is the truth; the claim from
the API server gives the exact keys and the conditions' times), so a restarted plugin keeps
following them.

A server that does not keep ``status.devices`` (1.34 with ``DRAResourceClaimDeviceStatus``
off) answers the apply without the entries: logged once, counted
(``claim_status_unsupported``), reported by ``/readyz`` without failing it (prepares work
without status), and no further status is written until the plugin restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.kubeplugin import reasons
from agent.kubeplugin.claims import Allocated, ClaimError, KubeletClaim, our_devices
from agent.kubeplugin.device_health import DeviceHealthView, DeviceState
from agent.kubeplugin.kube import (
    KubeConflict,
    KubeError,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
)

log = logging.getLogger("agent.kubeplugin.claim_status")

Json = dict[str, Any]
READY, HEALTHY = "Ready", "Healthy"
#: The API's limit on one entry's ``data`` (``AllocatedDeviceStatusDataMaxLength``).
MAX_DATA_BYTES = 10 * 1024
#: Status writes in flight at once (and the connections of the writer's own client).
WRITES_AT_ONCE = 4
#: Retry delays of a failed write: exponential from the first to the cap, jittered.
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 30.0
RESULTS = ("written", "removed", "retried", "refused", "gone")

#: (device, shareID): an entry's key within one claim of this driver and pool.
Key = tuple[str, str | None]


class ClaimStatusApi(Protocol):
    """The API server calls of the writer (``KubeClient``)."""

    async def apply_claim_status(self, namespace: str, name: str, body: Json, *,
                                 field_manager: str) -> Json: ...

    async def get_resource_claim(self, namespace: str, name: str) -> Json: ...


class PreparedClaims(Protocol):
    """The agent's claims (``AgentClient.claims``), read once at start."""

    async def claims(self) -> list[Json]: ...


@dataclass(frozen=True)
class StatusDevice:
    """One allocated device of a prepared claim: its entry's key and its ``data``."""

    device: str
    share_id: str | None
    data: Json = field(default_factory=dict, compare=True, hash=False)

    @property
    def key(self) -> Key:
        return (self.device, self.share_id)


@dataclass(frozen=True)
class PreparedClaim:
    """A claim prepared on this node and the entries its status gets."""

    namespace: str
    name: str
    uid: str
    devices: tuple[StatusDevice, ...]


# --- the mapping (pure) ----------------------------------------------------------------------

def _obj(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one (the agent's answer is read
    defensively: a missing or odd part leaves its data out, it never fails)."""
    return value if isinstance(value, Mapping) else {}


def _mib(value: Any) -> str | None:
    return f"{value}Mi" if isinstance(value, int) and not isinstance(value, bool) else None


def _pruned(value: Any) -> Any:
    """``value`` without None members and empty objects (data stays short and readable)."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in kept.items() if v != {}}
    return value


def device_data(prepared: Mapping[str, Any], mps: Mapping[str, Any] | None) -> Json:
    """The ``data`` of one entry from the agent's answer for the device (``devices[i]`` of
    ``PUT /v1/claims``) and the claim's MPS daemon (its ``mps``). Over
    :data:`MAX_DATA_BYTES` as JSON (only a hostile answer is), only the UUIDs are kept."""
    mig, sharing, share = (_obj(prepared.get(k)) for k in ("mig", "sharing", "share"))
    data = _pruned({
        "uuid": prepared.get("uuid"),
        "parentUUID": prepared.get("parent_uuid"),
        "mig": {"profile": mig.get("profile"), "gpuInstance": mig.get("gi_id"),
                "computeInstance": mig.get("ci_id"), "placement": mig.get("placement")},
        "sharing": {"strategy": sharing.get("strategy"), "interval": sharing.get("interval")},
        "mps": {"pipeDirectory": _obj(mps).get("pipe_directory"),
                "activeThreadPercentage": sharing.get("thread_percentage"),
                "pinnedDeviceMemoryLimit": _mib(sharing.get("pinned_limit_mib"))}
        if sharing.get("strategy") == "MPS" else None,
        "share": {"memory": _mib(share.get("memory_mib")), "shareID": share.get("share_id")},
        "cdiDevices": prepared.get("cdi_devices") or None,
    })
    if len(json.dumps(data)) > MAX_DATA_BYTES:
        data = _pruned({"uuid": prepared.get("uuid"), "parentUUID": prepared.get("parent_uuid")})
    return data if len(json.dumps(data)) <= MAX_DATA_BYTES else {}


def status_devices(devices: Sequence[Allocated], answer: Mapping[str, Any]) -> tuple[
        StatusDevice, ...]:
    """The entries of a prepared claim: each allocated device (keyed by the allocation's own
    device and shareID, as the server validates them) with the data of the agent's answer
    for it; a device the answer does not name gets an entry without data."""
    answered: dict[Key, Mapping[str, Any]] = {}
    for raw in answer.get("devices") or ():
        if not isinstance(raw, Mapping) or not isinstance(raw.get("device_name"), str):
            continue
        share = _obj(raw.get("share"))
        share_id = share.get("share_id") if isinstance(share.get("share_id"), str) else None
        answered.setdefault((raw["device_name"], share_id or None), raw)
    mps = _obj(answer.get("mps"))
    out = []
    for device in devices:
        prepared = answered.get((device.device, device.share_id))
        if prepared is None:  # one answer for the device, a share ID on one side only
            same = [v for k, v in answered.items() if k[0] == device.device]
            prepared = same[0] if len(same) == 1 else None
        out.append(StatusDevice(device.device, device.share_id,
                                device_data(prepared, mps) if prepared is not None else {}))
    return tuple(out)


@dataclass(frozen=True)
class Condition:
    """One condition's status, reason and message, without its time."""

    type: str
    status: str
    reason: str
    message: str


def ready_condition(node: str) -> Condition:
    return Condition(READY, "True", "Prepared", f"prepared by the GPU agent on node {node}")


def health_condition(state: DeviceState) -> Condition:
    """The ``Healthy`` condition of a device in ``state``: its taints are the message."""
    if state.health == "Unhealthy":
        return Condition(HEALTHY, "False", "Tainted", state.reason)
    if state.health == "Healthy":
        if state.taints:
            return Condition(HEALTHY, "True", "InformationalTaints", state.reason)
        return Condition(HEALTHY, "True", "NoTaints", "")
    return Condition(HEALTHY, "Unknown", "HealthUnknown",
                     "the GPU agent does not answer or does not publish this device")


def rfc3339(epoch_s: float) -> str:
    """``epoch_s`` as Kubernetes writes times: RFC 3339, UTC, whole seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def entry(driver: str, pool: str, device: StatusDevice,
          conditions: Sequence[tuple[Condition, str]]) -> Json:
    """One ``status.devices[]`` entry: ``conditions`` are (condition, lastTransitionTime)."""
    out: Json = {"driver": driver, "pool": pool, "device": device.device}
    if device.share_id is not None:
        out["shareID"] = device.share_id
    out["conditions"] = [{"type": c.type, "status": c.status, "reason": c.reason,
                          "message": c.message, "lastTransitionTime": since}
                         for c, since in conditions]
    if device.data:
        out["data"] = device.data
    return out


def apply_body(namespace: str, name: str, uid: str, entries: Sequence[Json]) -> Json:
    """The server-side apply configuration of a claim's status: exactly ``entries`` (none:
    the field manager's entries are removed). The UID makes the server refuse it (409) for
    another claim of the same name."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": list(entries)}}


def _key_of(item: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    return (item.get("driver"), item.get("pool"), item.get("device"), item.get("shareID"))


def kept_entries(sent: Sequence[Json], answer: Mapping[str, Any]) -> bool:
    """Whether the server's answer to an apply holds every entry sent (by key): a server
    that does not serve ``status.devices`` drops the field and answers without it."""
    stored = (answer.get("status") or {}).get("devices") or []
    have = {_key_of(item) for item in stored if isinstance(item, Mapping)}
    return all(_key_of(item) in have for item in sent)


def stored_times(answer: Mapping[str, Any], driver: str,
                 pool: str) -> dict[tuple[Key, str], tuple[str, str]]:
    """(entry key, condition type) -> (status, lastTransitionTime) of this driver's entries
    in a claim as read: a restarted plugin keeps the times of conditions that did not
    change."""
    found: dict[tuple[Key, str], tuple[str, str]] = {}
    for item in (answer.get("status") or {}).get("devices") or []:
        if not isinstance(item, Mapping) or item.get("driver") != driver or \
                item.get("pool") != pool or not isinstance(item.get("device"), str):
            continue
        key = (item["device"], item.get("shareID") if isinstance(item.get("shareID"), str)
               else None)
        for cond in item.get("conditions") or []:
            if isinstance(cond, Mapping) and isinstance(cond.get("lastTransitionTime"), str):
                found[(key, str(cond.get("type")))] = (str(cond.get("status")),
                                                       cond["lastTransitionTime"])
    return found


# --- the writer (effects) --------------------------------------------------------------------

class ClaimStatusMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.writes = Counter(
            "gpu_agent_plugin_claim_status_writes",
            "ResourceClaim device status applies, by result (written; removed: at unprepare; "
            "retried: failed, tried again with backoff; refused: the server refused the "
            "content (422), not retried; gone: the claim no longer exists)", ["result"],
            registry=registry)
        self.pending = Gauge(
            "gpu_agent_plugin_claim_status_pending",
            "Claims whose device status is not yet as the plugin wants it (queued, in flight "
            "or waiting to retry)", registry=registry)
        self.unsupported = Gauge(
            "gpu_agent_plugin_claim_status_unsupported",
            "1 when the API server drops ResourceClaim status.devices "
            "(DRAResourceClaimDeviceStatus off): no device status is written", registry=registry)
        for result in RESULTS:
            self.writes.labels(result)


@dataclass
class _Tracked:
    """What the writer knows of one claim: its devices (None: to be removed), the times of
    its conditions, and the body last applied."""

    namespace: str
    name: str
    devices: tuple[StatusDevice, ...] | None
    times: dict[tuple[Key, str], tuple[str, str]] = field(default_factory=dict)
    written: Json | None = None
    refused: Json | None = None
    failures: int = 0
    retry: asyncio.TimerHandle | None = None


class ClaimStatusWriter:
    """Keeps the device status of the claims prepared on this node (see the module)."""

    def __init__(self, api: ClaimStatusApi, health: DeviceHealthView, *, driver: str,
                 pool: str, registry: CollectorRegistry, agent: PreparedClaims | None = None,
                 workers: int = WRITES_AT_ONCE, clock: Callable[[], float] = time.time) -> None:
        self._api = api
        self._health = health
        self._agent = agent
        self.driver = driver
        self.pool = pool
        self._workers = workers
        self._clock = clock
        self.metrics = ClaimStatusMetrics(registry)
        self._claims: dict[str, _Tracked] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._busy: set[str] = set()
        self._again: set[str] = set()
        self._unsupported: str | None = None
        self._last_error: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: While the agent's claims are read back at start: the claims unprepared meanwhile.
        self._recovering = False
        self._unprepared_lately: set[str] = set()

    # -- what dra.py tells it (never awaits) --

    def prepared(self, claim: PreparedClaim) -> None:
        """A prepare succeeded: its entries are to be written (or kept)."""
        if self._unsupported is not None:
            return  # nothing is written: nothing to remember
        self._unprepared_lately.discard(claim.uid)
        tracked = self._claims.get(claim.uid)
        if tracked is None:
            tracked = self._claims[claim.uid] = _Tracked(claim.namespace, claim.name,
                                                         claim.devices)
        else:
            tracked.devices = claim.devices
        self._touch(claim.uid)

    def unprepared(self, claim: KubeletClaim) -> None:
        """An unprepare succeeded: the claim's entries are to be removed (if any were
        written)."""
        tracked = self._claims.get(claim.uid)
        if tracked is None:
            if self._recovering:
                self._unprepared_lately.add(claim.uid)  # not to be taken back from the agent
            return
        tracked.devices = None
        self._touch(claim.uid)

    # -- readiness --

    @property
    def problem(self) -> str | None:
        """Why device status is not written (reported by ``/readyz``), or None."""
        if self._unsupported is not None:
            return self._unsupported
        waiting = sum(1 for t in self._claims.values() if t.failures)
        if waiting:
            return (f"{reasons.STATUS_PENDING} {waiting} claim(s) not written yet, retrying: "
                    f"{self._last_error}")
        return None

    # -- the loops --

    async def run(self) -> None:
        """Write until cancelled: the workers, the health follower, and the claims the
        agent held when the plugin started."""
        async with asyncio.TaskGroup() as tasks:
            for _ in range(self._workers):
                tasks.create_task(self._work())
            tasks.create_task(self._follow_health())
            if self._agent is not None:
                tasks.create_task(self._recover(self._agent))

    async def _follow_health(self) -> None:
        version = self._health.version
        while True:
            version = await self._health.wait_changed(version)
            for uid in list(self._claims):
                tracked = self._claims[uid]
                if tracked.devices is not None and self._body(uid, tracked) != tracked.written:
                    self._touch(uid)

    async def _recover(self, agent: PreparedClaims) -> None:
        """Follow the claims the agent holds prepared for this driver's pool (a restarted
        plugin): each read from the API server for its keys and its conditions' times."""
        self._recovering = True
        try:
            delay = RETRY_FIRST_S
            while True:
                try:
                    held = await agent.claims()
                    break
                except Exception as err:  # the agent restarting: try again, never give up
                    # Once, not per retry: the agent client logs its going and coming back.
                    log.log(logging.INFO if delay == RETRY_FIRST_S else logging.DEBUG,
                            "reading the agent's claims for their status failed; retrying",
                            extra={"error": f"{type(err).__name__}: {err}"})
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
            await asyncio.gather(*(self._recover_one(c) for c in held
                                   if isinstance(c, Mapping)))
        finally:
            self._recovering = False
            self._unprepared_lately.clear()

    async def _recover_one(self, record: Mapping[str, Any]) -> None:
        meta = _obj(record.get("metadata"))
        uid, namespace, name = record.get("uid"), meta.get("namespace"), meta.get("name")
        if record.get("state") != "prepare_completed" or not (
                isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str)
                and uid and namespace and name):
            return
        if uid in self._claims:
            return  # prepared again since the start: that prepare's view is newer
        claim = KubeletClaim(namespace, uid, name)
        try:
            obj = await self._api.get_resource_claim(namespace, name)
            devices = status_devices(our_devices(claim, obj, driver=self.driver,
                                                 pool=self.pool), record)
        except (KubeError, ClaimError, LookupError) as err:
            log.info("not following a held claim's status", extra={
                "claim": uid, "error": f"{type(err).__name__}: {err}"})
            return
        if uid in self._claims or uid in self._unprepared_lately or \
                self._unsupported is not None:
            return
        self._claims[uid] = _Tracked(namespace, name, devices,
                                     times=stored_times(obj, self.driver, self.pool))
        self._touch(uid)

    def _touch(self, uid: str) -> None:
        """Queue the claim's write unless its status is written as wanted."""
        if self._unsupported is not None:
            return
        tracked = self._claims.get(uid)
        if tracked is not None and tracked.retry is not None:
            tracked.retry.cancel()
            tracked.retry = None
        if uid in self._busy:
            self._again.add(uid)
        elif uid not in self._queued:
            self._queued.add(uid)
            self._queue.put_nowait(uid)
        self._count_pending()

    def _count_pending(self) -> None:
        pending = len(self._queued | self._busy) + sum(
            1 for t in self._claims.values() if t.retry is not None)
        self.metrics.pending.set(pending)
        if pending:
            self._idle.clear()
        else:
            self._idle.set()

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the writes wanted so far (the stop: an unprepare's
        removal should reach the server before the process ends)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    def _body(self, uid: str, tracked: _Tracked) -> Json:
        """The apply body of the claim now: its conditions from the current health, each
        with the time its status last changed."""
        entries = []
        now = rfc3339(self._clock())
        for device in tracked.devices or ():
            conditions = []
            for cond in (ready_condition(self.pool), health_condition(
                    self._health.state(device.device))):
                seen = tracked.times.get((device.key, cond.type))
                if seen is None or seen[0] != cond.status:
                    seen = tracked.times[(device.key, cond.type)] = (cond.status, now)
                conditions.append((cond, seen[1]))
            entries.append(entry(self.driver, self.pool, device, conditions))
        return apply_body(tracked.namespace, tracked.name, uid, entries)

    async def _work(self) -> None:
        while True:
            uid = await self._queue.get()
            self._queued.discard(uid)
            self._busy.add(uid)
            try:
                await self._write(uid)
            except Exception:  # a bug here must not stop the worker
                log.exception("writing a claim's device status failed", extra={"claim": uid})
            finally:
                self._busy.discard(uid)
                if uid in self._again:
                    self._again.discard(uid)
                    self._touch(uid)
                self._count_pending()

    async def _write(self, uid: str) -> None:
        tracked = self._claims.get(uid)
        if tracked is None or self._unsupported is not None:
            return
        body = self._body(uid, tracked)
        if body in (tracked.written, tracked.refused):
            if tracked.devices is None:
                del self._claims[uid]
            return
        removing = not body["status"]["devices"]
        try:
            answer = await self._api.apply_claim_status(tracked.namespace, tracked.name, body,
                                                        field_manager=self.driver)
        except (KubeNotFound, KubeConflict) as err:
            # Deleted, or another claim of that name (the UID did not match): nothing left
            # to write to.
            self.metrics.writes.labels("gone").inc()
            log.info("claim gone; its device status is not written", extra={
                "claim": uid, "error": str(err)})
            self._forget(uid, tracked)
            return
        except KubeInvalid as err:
            self.metrics.writes.labels("refused").inc()
            tracked.refused, tracked.failures = body, 0
            log.error("the API server refused a claim's device status", extra={
                "claim": uid, "namespace": tracked.namespace, "claim_name": tracked.name,
                "error": str(err)})
            if removing:
                self._forget(uid, tracked)
            return
        except Exception as err:  # unavailable, forbidden, cut: retried with backoff
            self._retry_later(uid, tracked, err)
            return
        tracked.failures = 0
        if removing:
            self.metrics.writes.labels("removed").inc()
            tracked.written = body
            if tracked.devices is None and uid not in self._again:
                del self._claims[uid]  # prepared again meanwhile: kept, written anew
            return
        if not kept_entries(body["status"]["devices"], answer):
            self._not_served()
            return
        tracked.written = body
        self.metrics.writes.labels("written").inc()

    def _forget(self, uid: str, tracked: _Tracked) -> None:
        if self._claims.get(uid) is tracked:
            del self._claims[uid]

    def _retry_later(self, uid: str, tracked: _Tracked, err: Exception) -> None:
        tracked.failures += 1
        self.metrics.writes.labels("retried").inc()
        self._last_error = f"{type(err).__name__}: {err}"[:300]
        delay = min(RETRY_FIRST_S * 2 ** (tracked.failures - 1), RETRY_MAX_S)
        if isinstance(err, KubeUnavailable) and err.retry_after_s:
            delay = max(delay, min(err.retry_after_s, RETRY_MAX_S))
        delay += random.uniform(0, RETRY_FIRST_S)
        log.warning("writing a claim's device status failed; retrying", extra={
            "claim": uid, "error": self._last_error, "retry_in_s": round(delay, 2),
            "failures": tracked.failures})
        tracked.retry = asyncio.get_running_loop().call_later(delay, self._retry_now, uid)

    def _retry_now(self, uid: str) -> None:
        tracked = self._claims.get(uid)
        if tracked is not None:
            tracked.retry = None
            self._touch(uid)

    def _not_served(self) -> None:
        if self._unsupported is not None:
            return  # another write in flight found it first: logged and counted once
        self._unsupported = (
            f"{reasons.STATUS_UNSUPPORTED} (DRAResourceClaimDeviceStatus off?): claim "
            "device status is not written; prepares are not affected")
        self.metrics.unsupported.set(1)
        log.warning("api server dropped resourceclaim status.devices; not writing device "
                    "status", extra={"driver": self.driver})
        for tracked in self._claims.values():
            if tracked.retry is not None:
                tracked.retry.cancel()
                tracked.retry = None
        self._claims.clear()
        self._count_pending()


def prepared_claim(claim: KubeletClaim, devices: Sequence[Allocated],
                   answer: Mapping[str, Any]) -> PreparedClaim:
    """The writer's record of a claim whose prepare the agent answered with ``answer``."""
    return PreparedClaim(claim.namespace, claim.name, claim.uid,
                         status_devices(devices, answer))

