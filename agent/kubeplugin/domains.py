"""This node's part in compute domains: announcing itself on its Node, waiting for the
domain to form, keeping the agent's IMEX node list equal to the seats, and leaving.

Prepare of a domain claim on this node (:meth:`DomainMembership.join`, then
:meth:`DomainMembership.ready`):

1. the node labels itself with the claim's UID and annotates its IMEX address, state
   ``Joining``, no seat (one patch of its own Node);
2. it waits, up to ``form_timeout_s``, until every seat of the domain is held and this node
   holds one (:func:`~agent.kubeplugin.domain_members.seats`, from the members' records):
   the IMEX daemons then start with the whole node list at once, not restarted once per late
   member (a claim failing here is retried by kubelet; the announcement stays, so the
   members still waiting count it). A node joining a domain that formed before (a pod
   rescheduled after a node was lost) takes the free seat;
3. it gives the agent the node list by seat (``PUT /v1/domains/{uid}``, None at a free
   seat); the channel prepare that follows waits for the local IMEX daemon's readiness;
4. once prepared, the node says ``Ready`` and writes the seat it holds with its generation
   (a second patch): from then on its seat is its record's, not the name order's.

While the claim is prepared here, a follower watches the members: a node that joins, leaves
or is lost (its Node not Ready) changes the holder of one seat, and the new list goes to the
agent (which rewrites the IMEX hosts file and has the daemon reconnect: the other seats keep
their names, so no healthy member restarts). While this node holds no seat (it was lost and
its seat taken, or it joined beside a full domain) it gives the agent nothing (the agent
wants this node's own address in the list) and writes nothing: it keeps its record, and takes
a seat that frees up. The agent's view of the domain (``nvidia-imex-ctl``'s domain state)
becomes this member's announced state (``Degraded`` while a peer is down), a patch only when
it changes. Unprepare of the claim takes the label and the annotation off
(:meth:`DomainMembership.leave`). Two patches to join and one to leave, whatever the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
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
    node_list,
    seat_of,
    seats,
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

    async def configure_domain(self, domain: str, peers: list[str | None]) -> None: ...

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
    pushed: tuple[str | None, ...] | None = None
    #: The state last announced on the Node.
    announced: MemberState = "Joining"
    #: The seat and its generation last written on the Node (None: no claim written).
    seat: int | None = None
    generation: int = 0
    #: This node held no seat when the members last changed (logged once per spell).
    unseated: bool = False
    #: One node list on its way to the agent at a time, computed once the previous is there
    #: (so the last one given is of the latest members).
    pushing: asyncio.Lock = field(default_factory=asyncio.Lock)
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
        member) is followed again, as prepared; the agent keeps its IMEX daemon meanwhile.
        The domain's size is the length of the agent's node list (the claim is not at hand;
        a domain the agent does not hold yet gets its size from kubelet's next prepare)."""
        node = await self._kube.get_node(self.node_name)
        meta = node.get("metadata") or {}
        uid = (meta.get("labels") or {}).get(DOMAIN_LABEL)
        if not uid:
            return
        mine = [m for m in members([node], uid) if m.node == self.node_name]
        if not mine:
            return
        record = mine[0]
        domain = _Domain(uid=uid, size=0, address=record.address, announced=record.state,
                         seat=record.seat, generation=record.generation)
        view = await self._agent.domain(uid)
        if view is not None:
            # Configured before the restart: follow, and keep the agent's list current.
            listed = view.get("peers")
            if isinstance(listed, list) and all(p is None or isinstance(p, str)
                                                for p in listed):
                domain.size = len(listed)
                domain.pushed = tuple(listed)
            else:
                domain.pushed = ()
        self._domains[uid] = domain
        self._follow(domain)
        log.info("domain membership recovered", extra={"domain": uid,
                                                      "state": domain.announced})

    def joined(self, uid: str) -> bool:
        return uid in self._domains

    def members_of(self, uid: str) -> tuple[Member, ...]:
        """The members of domain ``uid`` as this node last saw them (none: not a member)."""
        domain = self._domains.get(uid)
        return domain.members if domain is not None else ()

    def seat(self, uid: str) -> int | None:
        """The seat this node holds in domain ``uid`` now (None: none, or not a member)."""
        domain = self._domains.get(uid)
        if domain is None:
            return None
        mine = seat_of(seats(domain.members, domain.size), self.node_name)
        return mine.seat if mine is not None else None

    async def join(self, claim: KubeletClaim, wanted: DomainClaim) -> tuple[str | None, ...]:
        """Announce this node in ``wanted`` and wait until it has formed; the node list by
        seat given to the agent. :class:`ClaimError` when this node is in another domain,
        the agent runs no IMEX, or the domain did not form in time (retryable)."""
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
        async with domain.pushing:
            await self._push(domain, list_)
        # The follower gives the agent nothing before its first list: a change of members
        # while that list was on its way is given now.
        await self._sync(domain)
        return list_

    async def ready(self, uid: str) -> None:
        """The claim is prepared here: announce ``Ready`` with the seat this node holds
        (unless the agent already says otherwise, which the follower announces)."""
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
        # The seat goes with every announcement, at no extra write: the seat this node holds
        # now (taken by name order until written), else the claim it wrote before, kept.
        if not labelled:
            mine = seat_of(seats(domain.members, domain.size), self.node_name)
            if mine is not None:
                domain.seat, domain.generation = mine.seat, mine.generation
        seat = None if labelled else domain.seat
        await self._kube.patch_node_metadata(
            self.node_name, labels=labels,
            annotations={MEMBER_ANNOTATION: member_annotation(
                domain.uid, domain.address, state, seat, domain.generation)})
        self.metrics.node_writes.labels("join" if labelled else "state").inc()
        domain.announced = state
        log.info("compute domain membership announced",
                 extra={"domain": domain.uid, "state": state, "seat": seat})

    async def _formed(self, claim: KubeletClaim, domain: _Domain) -> tuple[str | None, ...]:
        """The node list by seat once every seat is held and this node holds one (a domain
        that formed here before, and lost a node since, waits only for this node's seat)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._form_timeout_s
        while True:
            held = seats(domain.members, domain.size)
            mine = seat_of(held, self.node_name)
            if mine is not None and (len(held) == domain.size or domain.pushed is not None):
                return node_list(held, domain.size)
            domain.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                joined = ", ".join(m.node for m in domain.members) or "none"
                unseated = "" if mine is not None else "; this node holds no seat"
                raise ClaimError("domain-forming", f"claim {claim}: compute domain "
                                                   f"{domain.uid}: {len(held)} of "
                                                   f"{domain.size} seats are held after "
                                                   f"{self._form_timeout_s:g} s (joined: "
                                                   f"{joined}){unseated}", retryable=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, self._check_interval_s)):
                    await domain.changed.wait()

    async def _push(self, domain: _Domain, list_: tuple[str | None, ...]) -> None:
        if domain.pushed == list_:
            return
        await self._agent.configure_domain(domain.uid, list(list_))
        self.metrics.peer_updates.inc()
        domain.pushed = list_
        log.info("compute domain node list given to the agent",
                 extra={"domain": domain.uid,
                        "peers": ",".join(p or "-" for p in list_)})

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
                    events = self._kube.watch_nodes(selector, version)
                    try:
                        async for event in events:
                            version = event.resource_version or version
                            if event.type == "BOOKMARK":
                                continue
                            name = str((event.object.get("metadata") or {}).get("name"))
                            if event.type == "DELETED":
                                nodes.pop(name, None)
                            else:
                                nodes[name] = event.object
                            await self._members_changed(domain, nodes)
                    finally:
                        # Closed at once when the follower stops inside an event (a push,
                        # or a wait for one), so the watch's connection goes now, not at a
                        # garbage collection after the loop may have closed.
                        if isinstance(events, AsyncGenerator):
                            await events.aclose()
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
        await self._sync(domain)

    async def _sync(self, domain: _Domain) -> None:
        """Give the agent the node list of the members as they are now, once it has had one
        (the domain formed here) and while this node holds a seat."""
        async with domain.pushing:
            if domain.pushed is None or domain.leaving:
                return
            held = seats(domain.members, domain.size)
            if seat_of(held, self.node_name) is None:
                # The agent wants this node in the list: the list it has stays until this
                # node holds a seat again (or leaves, the claim unprepared).
                if not domain.unseated:
                    log.warning("this node holds no seat of the compute domain; the agent's "
                                "node list stays as it was", extra={"domain": domain.uid})
                domain.unseated = True
                return
            domain.unseated = False
            await self._push(domain, node_list(held, domain.size))

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
