"""The plugin's own metrics (``gpu_agent_plugin_*``) on the registry the publisher shares, served
at the health listener's ``/metrics``."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Per claim, from kubelet's call arriving to the answer: a claim on an existing device takes
#: about a millisecond, one whose MIG instance is made on demand seconds, and kubelet gives up
#: at 45 s.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 20.0, 45.0, 90.0)


class PluginMetrics:
    """Prepare and unprepare latency and errors, registration, and the work still running
    after kubelet's deadline."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prepare_seconds = Histogram(
            "gpu_agent_plugin_prepare_seconds",
            "Time to prepare one claim, from kubelet's call arriving to the answer",
            registry=registry, buckets=BUCKETS)
        self.unprepare_seconds = Histogram(
            "gpu_agent_plugin_unprepare_seconds",
            "Time to unprepare one claim, from kubelet's call arriving to the answer",
            registry=registry, buckets=BUCKETS)
        self.prepare_errors = Counter(
            "gpu_agent_plugin_prepare_errors",
            "Claims whose prepare failed, by reason (agent-not-ready, agent-unreachable, "
            "agent-refused, claim-not-found, uid-mismatch, not-allocated, no-devices, "
            "api-server, api-server-timeout, claim-too-large, bad-claim-name, "
            "bad-allocation, ...)", ["reason"], registry=registry)
        self.unprepare_errors = Counter(
            "gpu_agent_plugin_unprepare_errors",
            "Claims whose unprepare failed, by reason", ["reason"], registry=registry)
        self.prepares_undone = Counter(
            "gpu_agent_plugin_prepares_undone",
            "Failed prepares the agent may have made, unprepared there before kubelet was "
            "answered, by outcome (undone; failed: the agent may still hold the claim)",
            ["outcome"], registry=registry)
        self.in_flight = Gauge(
            "gpu_agent_plugin_claims_in_flight",
            "Claim prepares and unprepares running, those kubelet stopped waiting for included",
            registry=registry)
        self.finished_late = Counter(
            "gpu_agent_plugin_finished_after_deadline",
            "Claim prepares and unprepares that finished after kubelet's deadline had passed "
            "(kubelet's retry finds the result)", ["call"], registry=registry)
        self.registered = Gauge(
            "gpu_agent_plugin_registered",
            "1 while kubelet reports the plugin registered", registry=registry)
        # Readiness (agent/kubeplugin/health.py): what /readyz answers, as of the last probe
        # or scrape, so an alert sees a node whose plugin is not ready, and which check.
        self.ready = Gauge(
            "gpu_agent_plugin_ready",
            "1 while /readyz answers ready (every check passes), as of the last probe or "
            "scrape", registry=registry)
        self.ready_checks = Gauge(
            "gpu_agent_plugin_ready_check",
            "1 while the /readyz check passes (registered, agent, api_server, slices), as of "
            "the last probe or scrape", ["check"], registry=registry)

    def set_readiness(self, checks: Mapping[str, str | None]) -> None:
        """The result of one round of /readyz checks (None: the check passes)."""
        for name, reason in checks.items():
            self.ready_checks.labels(name).set(1 if reason is None else 0)
        self.ready.set(0 if any(r is not None for r in checks.values()) else 1)
