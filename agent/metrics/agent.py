"""The agent's own metrics, on an injected registry so tests can assert exact values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

NAMESPACE = "gpu_agent"


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.build = Info("build", "Agent version and backend", namespace=NAMESPACE,
                          registry=self.registry)
        self.ready = Gauge("ready", "1 when the agent serves requests that need NVML",
                           namespace=NAMESPACE, registry=self.registry)
        self.nvml_errors = Counter("nvml_errors", "NVML calls that returned an error",
                                   ["function", "error"], namespace=NAMESPACE,
                                   registry=self.registry)
        self.http_requests = Counter("http_requests", "HTTP requests served",
                                     ["method", "route", "code"], namespace=NAMESPACE,
                                     registry=self.registry)
        self.ready.set(0)

    def set_build(self, *, version: str, backend: str) -> None:
        self.build.info({"version": version, "backend": backend})
