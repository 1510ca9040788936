"""The agent's own metrics, on an injected registry so tests can assert exact values."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)

from agent.errors import NvmlError

NAMESPACE = "gpu_agent"
# The terminal transition states (agent.mig.transition.TERMINAL), the closed label set.
TRANSITION_RESULTS = ("succeeded", "aborted", "rolled_back", "failed", "pending_reset")


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 process: bool = True) -> None:
        # No *_created series: they double every counter and histogram for no dashboard use
        # (a process-wide switch of prometheus-client).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry or CollectorRegistry()
        self.build = Info("build", "Agent version and backend", namespace=NAMESPACE,
                          registry=self.registry)
        self.ready = Gauge("ready", "1 when the agent serves requests that need NVML",
                           namespace=NAMESPACE, registry=self.registry)
        self.nvml_errors = Counter("nvml_errors", "NVML calls that returned an error",
                                   ["function", "code"], namespace=NAMESPACE,
                                   registry=self.registry)
        self.http_requests = Counter("http_requests", "HTTP requests served",
                                     ["method", "route", "code"], namespace=NAMESPACE,
                                     registry=self.registry)
        self.mig_transitions = Counter("mig_transitions", "MIG transitions by terminal state",
                                       ["result"], namespace=NAMESPACE, registry=self.registry)
        for result in TRANSITION_RESULTS:
            self.mig_transitions.labels(result)
        self.mig_transition_duration = Histogram(
            "mig_transition_duration_seconds", "Time from request to terminal state",
            namespace=NAMESPACE, registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.mig_instances_destroyed = Counter(
            "mig_instances_destroyed", "MIG GPU instances destroyed by transitions",
            namespace=NAMESPACE, registry=self.registry)
        self.mig_geometry_drift = Gauge(
            "mig_geometry_drift", "1 while a GPU's MIG geometry differs from the one last "
            "applied through the agent (changed behind its back)", ["gpu"], namespace=NAMESPACE,
            registry=self.registry)
        # Metrics collection and GPU health (agent/metrics/collector.py, health.py).
        self.collection_duration = Histogram(
            "collection_duration_seconds", "Time one metrics collection round took",
            namespace=NAMESPACE, registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.last_collection = Gauge(
            "last_collection_timestamp_seconds", "Unix time of the last successful metrics "
            "collection (the DCGM series are as old as this)", namespace=NAMESPACE,
            registry=self.registry)
        self.collection_interval = Gauge(
            "collection_interval_seconds", "Configured metrics collection interval",
            namespace=NAMESPACE, registry=self.registry)
        self.gpu_healthy = Gauge(
            "gpu_healthy", "1 while the GPU is healthy; 0 after a critical XID or when it stops "
            "answering NVML (GPU_IS_LOST)", ["gpu", "UUID"], namespace=NAMESPACE,
            registry=self.registry)
        self.gpu_available = Gauge(
            "gpu_available", "1 while new claims may use the GPU; 0 while it is lost, "
            "unhealthy or quarantined (the ledger's availability)", ["gpu", "UUID"],
            namespace=NAMESPACE, registry=self.registry)
        # Device taints (agent/health/, published by agent/wiring.py with the availability).
        self.gpu_taint_added = Gauge(
            "gpu_taint_added_timestamp_seconds", "Unix time a device taint was added (its "
            "timeAdded), one series per taint present: GPU_I_ID is the MIG GPU instance of a "
            "taint scoped to one, empty for the whole GPU; absent when untainted",
            ["gpu", "UUID", "GPU_I_ID", "key", "value", "effect"], namespace=NAMESPACE,
            registry=self.registry)
        self.xid_errors = Counter("xid_errors", "XID errors reported by NVML events",
                                  ["xid"], namespace=NAMESPACE, registry=self.registry)
        self.claims_checkpoint_writes = Counter(
            "claims_checkpoint_writes", "Durable writes of the claims checkpoint; concurrent "
            "prepares share one (group commit)", namespace=NAMESPACE, registry=self.registry)
        # Pod attribution from kubelet (agent/podresources/, --pod-resources-socket).
        self.podresources_errors = Counter(
            "podresources_errors", "PodResources List calls to kubelet that failed or timed "
            "out", namespace=NAMESPACE, registry=self.registry)
        self.podresources_last_success = Gauge(
            "podresources_last_success_timestamp_seconds", "Unix time of kubelet's last "
            "PodResources answer (the pod labels are as old as this)", namespace=NAMESPACE,
            registry=self.registry)
        # This node's IMEX daemon for its compute domain (agent/domains/).
        self.imex_domain_nodes = Gauge(
            "imex_domain_nodes", "Nodes of this node's compute domain by IMEX status, as "
            "nvidia-imex-ctl -N reports them (READY, UNAVAILABLE, other)", ["state"],
            namespace=NAMESPACE, registry=self.registry)
        self.imex_daemon_up = Gauge(
            "imex_daemon_up", "1 while this node's IMEX daemon runs for its compute domain",
            namespace=NAMESPACE, registry=self.registry)
        self.imex_daemon_restarts = Counter(
            "imex_daemon_restarts", "IMEX daemon restarts (attempts) because it had stopped while "
            "claims held the domain's channel", namespace=NAMESPACE, registry=self.registry)
        self.imex_reconnects = Counter(
            "imex_reconnects", "SIGUSR1s sent to this node's IMEX daemon after a seat of its "
            "domain moved to another address (it reconnects, resolving the names again)",
            namespace=NAMESPACE, registry=self.registry)
        for state in ("READY", "UNAVAILABLE", "other"):
            self.imex_domain_nodes.labels(state).set(0)
        if process:
            ProcessCollector(registry=self.registry)
        self.ready.set(0)

    def count_nvml_error(self, error: NvmlError) -> None:
        self.nvml_errors.labels(error.function, error.name).inc()

    def set_build(self, *, version: str, backend: str) -> None:
        self.build.info({"version": version, "backend": backend})
