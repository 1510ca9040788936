"""The shipped Grafana dashboard and Prometheus alerts use only metrics the agent exports,
and promtool proves each alert fires on a synthetic series."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, ProcessCollector

from agent.metrics.agent import AgentMetrics
from agent.metrics.fields import BY_NAME
from tests.tools import require_tool

MONITORING = Path(__file__).resolve().parents[2] / "daemonset" / "monitoring"
DASHBOARD = MONITORING / "gpu-node-agent-dashboard.json"
ALERTS = MONITORING / "gpu-node-agent-alerts.yaml"
ALERT_TESTS = MONITORING / "gpu-node-agent-alerts.test.yaml"
_METRIC = re.compile(r"\b(DCGM_[A-Z0-9_]+|gpu_agent_[a-z0-9_]+|process_[a-z0-9_]+)\b")


def exported_names() -> set[str]:
    """Sample names of the agent's own registry (with a sample in every labelled family),
    the process collector's, and every DCGM field."""
    metrics = AgentMetrics(CollectorRegistry(), process=False)
    metrics.nvml_errors.labels("nvmlInit", "NVML_ERROR_UNKNOWN")
    metrics.http_requests.labels("GET", "/metrics", "200")
    metrics.mig_geometry_drift.labels("0")
    metrics.gpu_healthy.labels("0", "GPU-x")
    metrics.xid_errors.labels("79")
    metrics.set_build(version="0", backend="test")
    names = {s.name for family in metrics.registry.collect() for s in family.samples}
    process = CollectorRegistry()
    ProcessCollector(registry=process)
    names |= {s.name for family in process.collect() for s in family.samples}
    return names | set(BY_NAME)


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return queries


def alert_queries() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_referenced_metric_is_exported(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    referenced = {name for q in queries for name in _METRIC.findall(q)}
    assert referenced, "no metric found: the pattern or the file is wrong"
    assert referenced - exported_names() == set()


def test_the_alerts_the_issue_asks_for_are_there() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    names = {rule["alert"] for group in doc["groups"] for rule in group["rules"]}
    assert {"GpuUnhealthy", "GpuXidError", "GpuMetricsStale", "MigTransitionFailed"} <= names


def test_promtool_accepts_the_rules_and_each_alert_fires() -> None:
    promtool = require_tool("promtool", "apt-get install prometheus")
    check = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                           text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], cwd=MONITORING,
                            capture_output=True, text=True, timeout=60, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a firing case in the unit tests.
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    fired = {case["alertname"] for test in doc["tests"] for case in test["alert_rule_test"]
             if case.get("exp_alerts")}
    rules = yaml.safe_load(ALERTS.read_text())
    assert fired == {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
