"""This node's part in compute domains: announcing itself on its Node, waiting for the
domain to form, keeping the agent's IMEX node list equal to the members, and leaving.

Prepare of a domain claim on this node (:meth:`DomainMembership.join`, then
:meth:`DomainMembership.ready`):

1. the node labels itself with the claim's UID and annotates its IMEX address, state
   ``Joining`` (one patch of its own Node);
2. it waits, up to ``form_timeout_s``, until as many Ready nodes have announced themselves as
   the domain has slots: the IMEX daemons then start with the whole node list at once, not
   restarted once per late member (a claim failing here is retried by kubelet; the
   announcement stays, so the members still waiting count it);
3. it gives the agent the node list (``PUT /v1/domains/{uid}``); the channel prepare that
   follows waits for the local IMEX daemon's readiness;
4. once prepared, the node says ``Ready`` (a second patch).

While the claim is prepared here, a follower watches the members: a node that joins, leaves
or is lost (its Node not Ready) changes the node list, which goes to the agent (the agent
restarts IMEX only when the list changed); the agent's view of the domain (``nvidia-imex-ctl``'s
domain state) becomes this member's announced state (``Degraded`` while a peer is down), a
patch only when it changes. Unprepare of the claim takes the label and the annotation off
(:meth:`DomainMembership.leave`). Two patches to join and one to leave, whatever the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from agent.kubeplugin.claims import ClaimError, KubeletClaim
from agent.kubeplugin.domain_members import (
    DOMAIN_LABEL,
    IMEX_STATES,
    MEMBER_ANNOTATION,
    DomainClaim,
    Member,
    MemberState,
    member_annotation,
    members,
    peers,
)
from agent.kubeplugin.errors import AgentCallError
from agent.kubeplugin.kube import KubeError, KubeExpired, NodeList, WatchEvent

log = logging.getLogger("agent.kubeplugin.domains")

Json = dict[str, Any]
#: How long a prepare waits for the domain's other nodes to announce themselves.
FORM_TIMEOUT_S = 120.0
#: How often a member reads the agent's view of the domain (its announced state follows).
CHECK_INTERVAL_S = 5.0
RETRY_S = (0.2, 5.0)


class NodeApi(Protocol):
    """What membership needs of the API server (:class:`agent.kubeplugin.kube.KubeClient`)."""

    async def get_node(self, name: str) -> Json: ...

    async def list_nodes(self, label_selector: str) -> NodeList: ...

    def watch_nodes(self, label_selector: str, resource_version: str,
                    timeout_s: int = ...) -> AsyncIterator[WatchEvent]: ...

    async def patch_node_metadata(self, name: str, *,
                                  labels: Mapping[str, str | None] | None = None,
                                  annotations: Mapping[str, str | None] | None = None
                                  ) -> Json: ...


class DomainAgent(Protocol):
    """What membership needs of the agent (:class:`agent.kubeplugin.agent_client.AgentClient`)."""

    async def imex_address(self) -> str | None: ...

    async def configure_domain(self, domain: str, peers: list[str]) -> None: ...

    async def leave_domain(self, domain: str) -> None: ...

    async def domain(self, domain: str) -> dict[str, Any] | None: ...


class DomainMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.node_writes = Counter(
            "gpu_agent_plugin_domain_node_writes",
            "Patches of this node's Node object for compute-domain membership, by what "
            "(join, state, leave)", ["what"], registry=registry)
        self.peer_updates = Counter(
            "gpu_agent_plugin_domain_peer_updates",
            "Node lists given to the agent for a compute domain", registry=registry)


@dataclass
class _Domain:
    """A domain this node announced itself in."""

    uid: str
    size: int
    address: str
    members: tuple[Member, ...] = ()
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: The node list the agent was last given (None: not yet: still forming).
    pushed: tuple[str, ...] | None = None
    #: The state last announced on the Node.
    announced: MemberState = "Joining"
    follower: asyncio.Task[None] | None = None
    #: Being left (unprepared here): nothing more goes to the agent.
    leaving: bool = False


class DomainMembership:
    """This node's compute-domain membership (one domain at a time, as the agent allows)."""

    def __init__(self, kube: NodeApi, agent: DomainAgent, *, node_name: str,
                 registry: CollectorRegistry, form_timeout_s: float = FORM_TIMEOUT_S,
                 check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self._kube = kube
        self._agent = agent
        self.node_name = node_name
        self._form_timeout_s = form_timeout_s
        self._check_interval_s = check_interval_s
        self.metrics = DomainMetrics(registry)
        self._domains: dict[str, _Domain] = {}
        self._lock = asyncio.Lock()

    async def recover(self) -> None:
        """At start: a domain this node still announces (the plugin restarted while it was a
        member) is followed again, as prepared; the agent keeps its IMEX daemon meanwhile."""
        node = await self._kube.get_node(self.node_name)
        meta = node.get("metadata") or {}
        uid = (meta.get("labels") or {}).get(DOMAIN_LABEL)
        if not uid:
            return
        mine = [m for m in members([node], uid) if m.node == self.node_name]
        if not mine:
            return
        domain = _Domain(uid=uid, size=0, address=mine[0].address, announced=mine[0].state)
        if await self._agent.domain(uid) is not None:
            domain.pushed = ()  # configured before the restart: follow and keep it current
        self._domains[uid] = domain
        self._follow(domain)
        log.info("domain membership recovered", extra={"domain": uid,
                                                      "state": domain.announced})

    def joined(self, uid: str) -> bool:
        return uid in self._domains

    async def join(self, claim: KubeletClaim, wanted: DomainClaim) -> tuple[str, ...]:
        """Announce this node in ``wanted`` and wait until it has formed; the node list given
        to the agent. :class:`ClaimError` when this node is in another domain, the agent runs
        no IMEX, or the domain did not form in time (retryable)."""
        async with self._lock:
            others = [uid for uid in self._domains if uid != wanted.uid]
            if others:
                raise ClaimError("domain-busy", f"claim {claim}: this node is a member of "
                                                f"compute domain {others[0]} (one at a time)",
                                 retryable=True)
            domain = self._domains.get(wanted.uid)
            if domain is None:
                address = await self._imex_address(claim)
                domain = _Domain(uid=wanted.uid, size=wanted.size, address=address)
                await self._announce(domain, "Joining", labelled=True)
                self._domains[wanted.uid] = domain
                self._follow(domain)
            domain.size = max(domain.size, wanted.size)
        list_ = await self._formed(claim, domain)
        await self._push(domain, list_)
        return list_

    async def ready(self, uid: str) -> None:
        """The claim is prepared here: announce ``Ready`` (unless the agent already says
        otherwise, which the follower announces)."""
        domain = self._domains.get(uid)
        if domain is not None and domain.announced == "Joining":
            await self._announce(domain, "Ready")

    async def leave(self, uid: str) -> None:
        """The claim is unprepared here: stop following, have the agent forget the domain
        (a prepare that never got through may have left it configured), take the label and
        the annotation off the Node (a node that was no member is left alone)."""
        async with self._lock:
            domain = self._domains.get(uid)
            if domain is None:
                return
            # The follower first: a node list it gave the agent after the unprepare would
            # configure the domain again.
            domain.leaving = True
            if domain.follower is not None:
                domain.follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await domain.follower
                domain.follower = None
            await self._agent.leave_domain(uid)
            await self._kube.patch_node_metadata(
                self.node_name, labels={DOMAIN_LABEL: None},
                annotations={MEMBER_ANNOTATION: None})
            self.metrics.node_writes.labels("leave").inc()
            self._domains.pop(uid)
            log.info("left compute domain", extra={"domain": uid})

    async def close(self) -> None:
        """Stop the followers (the plugin stops; the membership stays on the Node)."""
        for domain in self._domains.values():
            if domain.follower is not None:
                domain.follower.cancel()
        for domain in self._domains.values():
            if domain.follower is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await domain.follower

    async def _imex_address(self, claim: KubeletClaim) -> str:
        try:
            address = await self._agent.imex_address()
        except AgentCallError as err:
            raise ClaimError("agent-refused", f"claim {claim}: reading the agent's IMEX "
                                              f"address: {err}", retryable=True) from err
        if address is None:
            raise ClaimError("imex-not-configured", f"claim {claim}: a compute domain needs "
                                                    "IMEX on this node: start the agent with "
                                                    "--imex-address")
        return address

    async def _announce(self, domain: _Domain, state: MemberState, *,
                        labelled: bool = False) -> None:
        labels: dict[str, str | None] | None = {DOMAIN_LABEL: domain.uid} if labelled else None
        await self._kube.patch_node_metadata(
            self.node_name, labels=labels,
            annotations={MEMBER_ANNOTATION: member_annotation(domain.uid, domain.address,
                                                              state)})
        self.metrics.node_writes.labels("join" if labelled else "state").inc()
        domain.announced = state
        log.info("compute domain membership announced",
                 extra={"domain": domain.uid, "state": state})

    async def _formed(self, claim: KubeletClaim, domain: _Domain) -> tuple[str, ...]:
        """The node list once as many Ready members as slots have announced themselves."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._form_timeout_s
        while True:
            found = peers(domain.members)
            if len(found) >= domain.size and self._is_member(domain):
                return found
            domain.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                joined = ", ".join(m.node for m in domain.members) or "none"
                raise ClaimError("domain-forming", f"claim {claim}: compute domain "
                                                   f"{domain.uid}: {len(found)} of "
                                                   f"{domain.size} nodes have joined after "
                                                   f"{self._form_timeout_s:g} s (joined: "
                                                   f"{joined})", retryable=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, self._check_interval_s)):
                    await domain.changed.wait()

    def _is_member(self, domain: _Domain) -> bool:
        return any(m.node == self.node_name for m in domain.members)

    async def _push(self, domain: _Domain, list_: tuple[str, ...]) -> None:
        if domain.pushed == list_:
            return
        await self._agent.configure_domain(domain.uid, list(list_))
        self.metrics.peer_updates.inc()
        domain.pushed = list_
        log.info("compute domain node list given to the agent",
                 extra={"domain": domain.uid, "peers": ",".join(list_)})

    def _follow(self, domain: _Domain) -> None:
        domain.follower = asyncio.create_task(self._follower(domain),
                                              name=f"domain-{domain.uid}")

    async def _follower(self, domain: _Domain) -> None:
        """Keep ``domain.members`` equal to the Nodes, the agent's node list equal to the
        members (once formed), and the announced state equal to the agent's view."""
        checker = asyncio.create_task(self._check_state(domain))
        try:
            await self._watch_members(domain)
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker

    async def _watch_members(self, domain: _Domain) -> None:
        selector = f"{DOMAIN_LABEL}={domain.uid}"
        delay = RETRY_S[0]
        while True:
            try:
                listed = await self._kube.list_nodes(selector)
                nodes = {str((n.get("metadata") or {}).get("name")): n for n in listed.items}
                await self._members_changed(domain, nodes)
                version = listed.resource_version
                while True:
                    async for event in self._kube.watch_nodes(selector, version):
                        version = event.resource_version or version
                        if event.type == "BOOKMARK":
                            continue
                        name = str((event.object.get("metadata") or {}).get("name"))
                        if event.type == "DELETED":
                            nodes.pop(name, None)
                        else:
                            nodes[name] = event.object
                        await self._members_changed(domain, nodes)
                    delay = RETRY_S[0]
            except asyncio.CancelledError:
                raise
            except KubeExpired:
                continue  # list again
            except (KubeError, AgentCallError) as err:
                log.warning("following compute domain members failed; retrying",
                            extra={"domain": domain.uid, "error": str(err)})
            except Exception:
                log.exception("following compute domain members failed; retrying",
                              extra={"domain": domain.uid})
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_S[1])

    async def _members_changed(self, domain: _Domain, nodes: Mapping[str, Json]) -> None:
        domain.members = members(nodes.values(), domain.uid)
        domain.changed.set()
        if domain.pushed is not None and not domain.leaving:
            await self._push(domain, peers(domain.members))

    async def _check_state(self, domain: _Domain) -> None:
        """The agent's domain state becomes the announced one, written when it changes."""
        while True:
            await asyncio.sleep(self._check_interval_s)
            if domain.announced == "Joining":
                continue
            try:
                view = await self._agent.domain(domain.uid)
                state = IMEX_STATES.get(str((view or {}).get("state")), "NotReady")
                if state != domain.announced:
                    await self._announce(domain, state)
            except asyncio.CancelledError:
                raise
            except (KubeError, AgentCallError) as err:
                log.warning("checking the compute domain's state failed",
                            extra={"domain": domain.uid, "error": str(err)})
