"""NodePrepareResources and NodeUnprepareResources, independent of the gRPC version.

Every claim of a call runs as a task of its own, at once: there is no node-wide lock here
(the agent orders the calls of one claim UID and locks per GPU), so claims on different GPUs
never wait for each other. Each task is shielded from kubelet's deadline: when kubelet stops
waiting (45 s) the agent call still finishes, and kubelet's retry, which the agent answers
idempotently, finds the result. Errors are per claim; one bad claim never fails the call.

A prepare is all or nothing across kubelet, the plugin and the agent: when the plugin will
answer a claim with an error after the agent may have prepared it (an answer it cannot map
or read, a 5xx, no answer in time, a connection lost after the request went out), it first
unprepares the claim in the agent, stamped with the prepare's own ``issued_at_ns``, and
answers once the agent confirmed it. Only an agent that cannot be reached for the undo (gone
mid-call, restarting) is not waited for, since kubelet's deadline would pass first: the
answer says so and the undo is retried in the background for up to :data:`UNDO_WINDOW_S`.
The stamp makes the undo safe at any moment: a later prepare of the claim that succeeded is
newer, so the agent ignores the undo, and a prepare still queued in the agent is refused as a
late retry. Refusals (4xx) need no undo: the agent holds nothing for a prepare it refused.

A prepare that succeeded, and an unprepare, are handed to the claim status writer
(:mod:`agent.kubeplugin.claim_status`), which writes the claim's ``status.devices`` in the
background: its writes never delay or fail a claim call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.device_names import SLOT_DEVICE
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.claim_reads import READ_TIMEOUT_S, ClaimReads, ClaimReadTimeout
from agent.kubeplugin.claim_status import ClaimStatusWriter, prepared_claim
from agent.kubeplugin.claims import (
    Allocated,
    ClaimError,
    KubeletClaim,
    KubeletDevice,
    agent_body,
    channel_cdi,
    check_names,
    check_uid,
    domain_body,
    kubelet_devices,
    our_devices,
    with_configs,
)
from agent.kubeplugin.domain_members import DomainClaim, domain_claim
from agent.kubeplugin.domains import DomainMembership
from agent.kubeplugin.errors import (
    AgentCallError,
    AgentNotReady,
    AgentRefused,
    AgentUnreachable,
    TokenFileError,
)
from agent.kubeplugin.kinds import DeviceKinds, is_mig_name
from agent.kubeplugin.kube import KubeError, KubeTooLarge
from agent.kubeplugin.metrics import PluginMetrics
from agent.kubeplugin.protocols import ClaimReader

log = logging.getLogger("agent.kubeplugin.dra")
T = TypeVar("T")

#: How long the undo of a failed prepare is retried in the background while the agent is
#: unreachable or not ready (a restart takes seconds); kubelet's retry of the claim, failing
#: the same way, undoes it again.
UNDO_WINDOW_S = 120.0
_UNDO_FIRST_DELAY_S, _UNDO_MAX_DELAY_S = 0.1, 5.0
#: Failures to connect: the request never reached the agent, which then holds nothing.
_NOT_SENT = (FileNotFoundError, ConnectionRefusedError, PermissionError, NotADirectoryError)


def arrival_ns() -> int:
    """Now on CLOCK_BOOTTIME, the clock of the agent's ``issued_at_ns`` ordering stamps: it
    keeps counting through suspend and never steps, so stamps of one boot always order."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class PrepareResult:
    """One claim's answer: its devices, or the error kubelet reports."""

    devices: tuple[KubeletDevice, ...] = ()
    error: str | None = None


def _agent_error(claim: KubeletClaim, err: AgentCallError) -> ClaimError:
    """The per-claim error for a failed agent call; a not-ready agent is named as such (kubelet
    retries), never as unreachable."""
    if isinstance(err, AgentNotReady):
        what = "the GPU agent is not ready yet" if err.kind == "not-ready" else \
            f"the GPU agent cannot prepare it yet ({err.kind})"
        return ClaimError("agent-not-ready", f"claim {claim}: {what}: {err.detail}; retry in "
                                             f"{err.retry_after_s:g} s", retryable=True)
    if isinstance(err, AgentRefused) and err.status < 400:
        return ClaimError("agent-answer", f"claim {claim}: the GPU agent's answer (HTTP "
                                          f"{err.status}) is not a claim object")
    if isinstance(err, AgentRefused):
        return ClaimError("agent-refused", f"claim {claim}: the GPU agent refused it "
                                           f"(HTTP {err.status} {err.kind}): {err.detail}")
    if isinstance(err, TokenFileError):
        return ClaimError("token", f"claim {claim}: {err}")
    if isinstance(err, AgentUnreachable):
        return ClaimError("agent-unreachable",
                          f"claim {claim}: GPU agent unreachable: {err.reason}", retryable=True)
    return ClaimError("agent", f"claim {claim}: {err}")


def _may_hold(err: AgentCallError) -> bool:
    """Whether the agent may hold a claim whose prepare call failed with ``err``: it answered
    200 with a body that is not a claim, failed inside (5xx, 503 excepted: not ready refuses
    before anything is held), or gave no answer to a request that may have reached it. A 4xx
    is a refusal (nothing held), and a token or a connection that failed is a call never made."""
    if isinstance(err, AgentRefused):
        return err.status < 400 or err.status >= 500
    if isinstance(err, AgentUnreachable):
        return not isinstance(err.__cause__, _NOT_SENT)
    return False


def _described(err: AgentCallError) -> str:
    """``err`` in words, with the status and problem type of a refusal."""
    if isinstance(err, AgentRefused):
        return f"HTTP {err.status} {err.kind}: {err.detail}"
    return str(err)


def _read_error(claim: KubeletClaim, err: Exception) -> ClaimError:
    if isinstance(err, KubeTooLarge):
        return ClaimError("claim-too-large", f"claim {claim}: the API server's answer is over "
                                             f"the plugin's limit of {err.limit} bytes for "
                                             "a ResourceClaim (not read further)")
    if isinstance(err, ClaimReadTimeout):
        return ClaimError("api-server-timeout", f"claim {claim}: reading it: {err}",
                          retryable=True)
    if isinstance(err, LookupError) or getattr(err, "status", None) == 404:
        return ClaimError("claim-not-found",
                          f"claim {claim}: not found on the API server", retryable=True)
    return ClaimError("api-server", f"claim {claim}: reading it from the API server failed: "
                                    f"{type(err).__name__}: {err}", retryable=True)


class DraService:
    """Prepares and unprepares claims through the agent's REST API."""

    def __init__(self, agent: AgentClient, claims: ClaimReader, *, driver: str,
                 node_name: str, metrics: PluginMetrics,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 status: ClaimStatusWriter | None = None,
                 domains: DomainMembership | None = None) -> None:
        self._agent = agent
        self._status = status
        self._domains = domains
        self._claims = ClaimReads(claims, timeout_s=read_timeout_s)
        self.driver = driver
        self.pool = node_name  # the publisher names this node's pool after the node
        self._metrics = metrics
        self._running: set[asyncio.Task[Any]] = set()
        self._kinds = DeviceKinds(agent)

    async def prepare(self, claims: Sequence[KubeletClaim],
                      issued_at_ns: int) -> dict[str, PrepareResult]:
        """Prepare every claim (by UID) in parallel; ``issued_at_ns`` is when kubelet's call
        arrived (:func:`arrival_ns`, taken before anything was awaited)."""
        unique = list({c.uid: c for c in claims}.values())
        call = object()  # the claim reads share their slots fairly among kubelet's calls
        if len(unique) == 1:  # kubelet's usual call: no gather (a task and a future) for one
            claim = unique[0]
            return {claim.uid: await self._shielded(
                "prepare", claim, self._prepare_one(claim, issued_at_ns, call))}
        results = await asyncio.gather(*(
            self._shielded("prepare", c, self._prepare_one(c, issued_at_ns, call))
            for c in unique))
        return {c.uid: r for c, r in zip(unique, results, strict=True)}

    async def unprepare(self, claims: Sequence[KubeletClaim],
                        issued_at_ns: int) -> dict[str, str | None]:
        """Unprepare every claim (by UID) in parallel: the error of each, None for success
        (an unknown claim included)."""
        unique = list({c.uid: c for c in claims}.values())
        if len(unique) == 1:
            claim = unique[0]
            return {claim.uid: await self._shielded("unprepare", claim,
                                                    self._unprepare_one(claim, issued_at_ns))}
        results = await asyncio.gather(*(
            self._shielded("unprepare", c, self._unprepare_one(c, issued_at_ns))
            for c in unique))
        return {c.uid: r for c, r in zip(unique, results, strict=True)}

    async def _shielded(self, call: str, claim: KubeletClaim, work: Awaitable[T]) -> T:
        task = asyncio.ensure_future(work)
        self._running.add(task)
        self._metrics.in_flight.inc()
        task.add_done_callback(self._done)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.warning("kubelet stopped waiting; the claim's %s continues", call,
                            extra={"claim": claim.uid, "namespace": claim.namespace,
                                   "claim_name": claim.name})
                task.add_done_callback(lambda t: self._finished_late(call, claim, t))
            raise

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        self._metrics.in_flight.dec()

    def _finished_late(self, call: str, claim: KubeletClaim, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        self._metrics.finished_late.labels(call).inc()
        result = task.result()  # the work functions never raise: errors are results
        error = result.error if isinstance(result, PrepareResult) else result
        log.info("claim's %s finished after kubelet's deadline", call,
                 extra={"claim": claim.uid, "error": error or ""})

    async def close(self) -> None:
        """Cancel the claim reads still running (after :meth:`drain`, at the stop)."""
        await self._claims.close()

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for claim calls still running (shutdown)."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)

    async def _prepare_one(self, claim: KubeletClaim, issued_at_ns: int,
                           call: object) -> PrepareResult:
        try:
            devices = await self._prepare_devices(claim, issued_at_ns, call)
        except ClaimError as err:
            self._metrics.prepare_errors.labels(err.reason).inc()
            log.warning("prepare failed", extra={"claim": claim.uid, "reason": err.reason,
                                                 "error": str(err)})
            return PrepareResult(error=str(err))
        except Exception as err:  # a bug here must still fail this claim alone
            self._metrics.prepare_errors.labels("internal").inc()
            log.exception("prepare failed", extra={"claim": claim.uid, "reason": "internal"})
            return PrepareResult(error=f"claim {claim}: internal error in the kubelet plugin: "
                                       f"{type(err).__name__}: {err}")
        finally:
            self._metrics.prepare_seconds.observe(max(arrival_ns() - issued_at_ns, 0) / 1e9)
        log.info("prepared", extra={"claim": claim.uid, "namespace": claim.namespace,
                                    "claim_name": claim.name,
                                    "devices": ",".join(d.device_name for d in devices)})
        return PrepareResult(devices=tuple(devices))

    async def _prepare_devices(self, claim: KubeletClaim, issued_at_ns: int,
                               call: object) -> list[KubeletDevice]:
        check_names(claim)
        try:
            obj = await self._claims.read(call, claim.namespace, claim.name)
        except Exception as err:  # any client failure is this claim's error
            raise _read_error(claim, err) from err
        domain = domain_claim(claim, obj, driver=self.driver)
        if domain is not None:
            return await self._prepare_domain(claim, obj, domain, issued_at_ns)
        devices = with_configs(claim, obj, our_devices(claim, obj, driver=self.driver,
                                                       pool=self.pool), driver=self.driver)
        on_demand = await self._call_agent(claim, lambda: self._kinds.on_demand(
            d.device for d in devices if is_mig_name(d.device)))
        body = agent_body(claim, obj, devices, issued_at_ns, on_demand)
        answer = await self._agent_prepare(claim, body, issued_at_ns)
        answered = await self._mapped(claim, issued_at_ns,
                                      lambda: kubelet_devices(claim, devices, answer))
        self._status_prepared(claim, devices, answer)
        return answered

    async def _prepare_domain(self, claim: KubeletClaim, obj: dict[str, Any],
                              domain: DomainClaim, issued_at_ns: int) -> list[KubeletDevice]:
        """A compute-domain claim on this node: join the domain, then the agent holds this
        node's IMEX channel for it and starts IMEX with the domain's nodes. Kubelet hears of
        one device (the first slot: a slot is a place in the domain, not this node's) with
        the channel's CDI device; the claim's device status is left alone (every member
        would write the same entry)."""
        if self._domains is None:
            raise ClaimError("domains-off", f"claim {claim}: a compute-domain claim, and this "
                                            "kubelet plugin runs without compute domains")
        try:
            await self._domains.join(claim, domain)
        except (KubeError, AgentCallError) as err:
            raise ClaimError("domain-join", f"claim {claim}: joining compute domain "
                                            f"{domain.uid}: {err}", retryable=True) from err
        body = domain_body(claim, obj, domain.uid, domain.requests[0], issued_at_ns)
        answer = await self._agent_prepare(claim, body, issued_at_ns)
        cdi = await self._mapped(claim, issued_at_ns, lambda: channel_cdi(claim, answer))
        try:
            await self._domains.ready(domain.uid)
        except KubeError as err:  # the follower announces the agent's state later
            log.warning("announcing the compute domain member ready failed",
                        extra={"claim": claim.uid, "error": str(err)})
        return [KubeletDevice(domain.requests, domain.pool, SLOT_DEVICE, cdi)]

    async def _agent_prepare(self, claim: KubeletClaim, body: dict[str, Any],
                             issued_at_ns: int) -> dict[str, Any]:
        """The agent's answer to the prepare; a failure after which it may hold the claim is
        undone there before kubelet hears of it."""
        try:
            return await self._agent.prepare(claim.uid, body)
        except AgentCallError as err:
            failure = _agent_error(claim, err)
            if _may_hold(err):
                failure = await self._undo(claim, issued_at_ns, failure)
            raise failure from err

    async def _mapped(self, claim: KubeletClaim, issued_at_ns: int,
                      mapping: Callable[[], T]) -> T:
        """``mapping()`` of the agent's answer; a failure is undone in the agent first."""
        try:
            return mapping()
        except Exception as err:  # the agent holds it: undone before kubelet hears of it
            failure = err if isinstance(err, ClaimError) else ClaimError(
                "internal", f"claim {claim}: internal error in the kubelet plugin reading the "
                            f"agent's answer: {type(err).__name__}: {err}")
            if failure is not err:
                log.exception("reading the agent's answer failed", extra={"claim": claim.uid})
            raise await self._undo(claim, issued_at_ns, failure) from err

    def _status_prepared(self, claim: KubeletClaim, devices: Sequence[Allocated],
                         answer: dict[str, Any]) -> None:
        """Hand a prepared claim to the device status writer, which writes in the background:
        nothing there can fail or delay the prepare."""
        if self._status is None:
            return
        try:
            self._status.prepared(prepared_claim(claim, devices, answer))
        except Exception:  # a bug in the mapping costs the status, never the prepare
            log.exception("claim device status not recorded", extra={"claim": claim.uid})

    async def _undo(self, claim: KubeletClaim, issued_at_ns: int,
                    failure: ClaimError) -> ClaimError:
        """Unprepare in the agent a prepare stamped ``issued_at_ns`` that failed with
        ``failure`` after the agent may have made it; the error kubelet is answered, saying
        whether the agent confirmed that it holds nothing. An agent that cannot be reached
        (gone mid-call, restarting) is not waited for: kubelet hears so at once and the undo
        is retried in the background (:meth:`_undo_later`)."""
        try:
            await self._agent.unprepare(claim.uid, issued_at_ns)
        except AgentCallError as err:
            if err.retryable:
                log.warning("undoing a failed prepare did not reach the agent; retrying",
                            extra={"claim": claim.uid, "reason": failure.reason,
                                   "error": _described(err)})
                task = asyncio.ensure_future(self._undo_later(claim, issued_at_ns, failure, err))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
                return ClaimError(failure.reason, f"{failure}; undoing it in the GPU agent did "
                                  f"not get through ({_described(err)}): retrying for up to "
                                  f"{UNDO_WINDOW_S:g} s", retryable=True)
            return self._undo_failed(claim, failure, err)
        self._undone(claim, failure)
        return ClaimError(failure.reason, f"{failure} (undone in the GPU agent: it holds "
                                          "nothing for the claim)",
                          retryable=failure.retryable)

    async def _undo_later(self, claim: KubeletClaim, issued_at_ns: int, failure: ClaimError,
                          err: AgentCallError) -> None:
        """Retry an undo the agent did not get, with backoff, for :data:`UNDO_WINDOW_S`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNDO_WINDOW_S
        delay = _UNDO_FIRST_DELAY_S
        while True:
            wait = max(delay, err.retry_after_s) if isinstance(err, AgentNotReady) else delay
            if not err.retryable or loop.time() + wait >= deadline:
                self._undo_failed(claim, failure, err)
                return
            await asyncio.sleep(wait)
            delay = min(delay * 2, _UNDO_MAX_DELAY_S)
            try:
                await self._agent.unprepare(claim.uid, issued_at_ns)
            except AgentCallError as again:
                err = again
                continue
            self._undone(claim, failure)
            return

    def _undone(self, claim: KubeletClaim, failure: ClaimError) -> None:
        self._metrics.prepares_undone.labels("undone").inc()
        log.warning("failed prepare undone in the agent", extra={
            "claim": claim.uid, "reason": failure.reason})

    def _undo_failed(self, claim: KubeletClaim, failure: ClaimError,
                     err: AgentCallError) -> ClaimError:
        self._metrics.prepares_undone.labels("failed").inc()
        log.error("undoing a failed prepare in the agent failed", extra={
            "claim": claim.uid, "reason": failure.reason, "error": _described(err)})
        return ClaimError(failure.reason, f"{failure}; undoing it in the GPU agent failed too "
                          f"({_described(err)}): the agent may hold the claim until kubelet "
                          "prepares or unprepares it again", retryable=failure.retryable)

    async def _unprepare_one(self, claim: KubeletClaim, issued_at_ns: int) -> str | None:
        try:
            check_uid(claim)
            await self._call_agent(claim, lambda: self._agent.unprepare(claim.uid,
                                                                        issued_at_ns))
            if self._domains is not None and self._domains.joined(claim.uid):
                try:
                    await self._domains.leave(claim.uid)
                except (KubeError, AgentCallError) as err:
                    raise ClaimError("domain-leave", f"claim {claim}: leaving compute domain "
                                                     f"{claim.uid}: {err}",
                                     retryable=True) from err
        except ClaimError as err:
            self._metrics.unprepare_errors.labels(err.reason).inc()
            log.warning("unprepare failed", extra={"claim": claim.uid, "reason": err.reason,
                                                   "error": str(err)})
            return str(err)
        except Exception as err:  # a bug here must still fail this claim alone
            self._metrics.unprepare_errors.labels("internal").inc()
            log.exception("unprepare failed", extra={"claim": claim.uid, "reason": "internal"})
            return f"claim {claim}: internal error in the kubelet plugin: " \
                f"{type(err).__name__}: {err}"
        finally:
            self._metrics.unprepare_seconds.observe(max(arrival_ns() - issued_at_ns, 0) / 1e9)
        if self._status is not None:
            self._status.unprepared(claim)
        log.info("unprepared", extra={"claim": claim.uid, "namespace": claim.namespace,
                                      "claim_name": claim.name})
        return None

    @staticmethod
    async def _call_agent(claim: KubeletClaim, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except AgentCallError as err:
            raise _agent_error(claim, err) from err
