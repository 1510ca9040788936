"""Operator signals for claims, GPU shares and MPS daemons (``gpu_agent_claims``,
``gpu_agent_gpu_share_*``, ``gpu_agent_mps_daemons``), published from one sample.

Metrics never reads claims itself: the claims layer takes a :class:`ClaimSignals` sample
(``agent/claims/signals.py``) on the event loop and hands it to :meth:`ClaimMetrics.publish`,
which replaces every series at once, so a scrape (on the same loop) sees one sample whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge

from agent.metrics.agent import NAMESPACE

#: The ledger's hold states: the closed label set of ``gpu_agent_claims{state}``.
HOLD_STATES = ("reserved", "prepared", "releasing")
#: The claims' MPS daemon states (``agent/claims/checkpoint.py: MpsState``).
MPS_STATES = ("starting", "running", "failed")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuShareUse:
    """One shareable GPU: its shareable memory, what claims take of it, and how many share
    it. A GPU held whole (exclusively, under MPS or not) has all of it taken."""

    gpu: int
    uuid: str
    capacity_mib: int
    taken_mib: int
    claims: int

    @property
    def left_mib(self) -> int:
        return max(0, self.capacity_mib - self.taken_mib)


@dataclass(frozen=True)
class ClaimSignals:
    """One sample: claims by the state of their holds, how long the oldest reservation has
    been seen reserved, the shareable GPUs, and the claims' MPS daemons by state."""

    claims: Mapping[str, int] = field(default_factory=dict)
    oldest_reserved_s: float = 0.0
    shares: Sequence[GpuShareUse] = ()
    mps_daemons: Mapping[str, int] = field(default_factory=dict)


class ClaimMetrics:
    """The gauges, on the agent's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, text: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(name, text, labels, namespace=NAMESPACE, registry=registry)

        self.claims = gauge(
            "claims", "Claims holding devices, by the state of their holds in the ledger "
            "(reserved: being prepared; prepared: durable; releasing: being unprepared)",
            ["state"])
        self.oldest_reserved = gauge(
            "claims_oldest_reserved_seconds", "How long the oldest claim still being "
            "prepared has held its reservation (as seen by the sampler, one collect interval "
            "apart); 0 when no claim is being prepared")
        gpu = ["gpu", "UUID"]
        self.share_capacity = gauge(
            "gpu_share_capacity_bytes", "Memory of a shareable GPU that counted shares may "
            "add up to (its total rounded down to whole GiB)", gpu)
        self.share_taken = gauge(
            "gpu_share_taken_bytes", "Memory of a shareable GPU taken by claims' shares (all "
            "of it while a claim holds the GPU whole)", gpu)
        self.share_left = gauge(
            "gpu_share_left_bytes", "Memory of a shareable GPU still free for new shares", gpu)
        self.share_claims = gauge(
            "gpu_share_claims", "Claims holding a shareable GPU (its shares, or the one "
            "holding it whole)", gpu)
        self.mps_daemons = gauge(
            "mps_daemons", "The claims' MPS control daemons by state (failed: it stopped "
            "answering; the claim keeps its GPUs until it is unprepared)", ["state"])
        self.publish(ClaimSignals())

    def publish(self, sample: ClaimSignals) -> None:
        """Every series from ``sample``; GPUs no longer shareable lose theirs."""
        for state in HOLD_STATES:
            self.claims.labels(state).set(sample.claims.get(state, 0))
        self.oldest_reserved.set(sample.oldest_reserved_s)
        for state in MPS_STATES:
            self.mps_daemons.labels(state).set(sample.mps_daemons.get(state, 0))
        for family in (self.share_capacity, self.share_taken, self.share_left,
                       self.share_claims):
            family.clear()
        for use in sample.shares:
            labels = (str(use.gpu), use.uuid)
            self.share_capacity.labels(*labels).set(use.capacity_mib * _MIB)
            self.share_taken.labels(*labels).set(use.taken_mib * _MIB)
            self.share_left.labels(*labels).set(use.left_mib * _MIB)
            self.share_claims.labels(*labels).set(use.claims)
