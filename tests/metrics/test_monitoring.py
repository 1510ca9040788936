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

from agent.kubeplugin.metrics import PluginMetrics
from agent.kubeplugin.publisher import PublisherMetrics
from agent.metrics.agent import AgentMetrics
from agent.metrics.claims import ClaimMetrics
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
    ClaimMetrics(metrics.registry)
    names = {s.name for family in metrics.registry.collect() for s in family.samples}
    # The kubelet plugin's own series (its health listener), a sample in each family.
    plugin = CollectorRegistry()
    PluginMetrics(plugin).set_readiness({"registered": None})
    PublisherMetrics(plugin).dropped.set(0)
    names |= {s.name for family in plugin.collect() for s in family.samples}
    # Gauges whose labels only the code knows (one series per taint, per shared GPU).
    names |= {f.name for f in metrics.registry.collect() if f.type == "gauge"}
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
    assert {"GpuUnhealthy", "GpuXidError", "GpuMetricsStale", "MigTransitionFailed",
            "GpuMpsDaemonFailed", "GpuTaintedTooLong", "GpuKubeletPluginNotReady",
            "GpuClaimStuckInPrepare"} <= names


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


RULES = MONITORING / "gpu-node-agent-rules.yaml"
RULE_TESTS = MONITORING / "gpu-node-agent-rules.test.yaml"


def test_promtool_accepts_the_recording_rules_and_their_tests() -> None:
    """The per-GPU recording rules count a MIG-split GPU once (gpu-node-agent-rules.test)."""
    promtool = require_tool("promtool", "apt-get install prometheus")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=MONITORING,
                            capture_output=True, text=True, timeout=60, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    doc = yaml.safe_load(RULE_TESTS.read_text())
    checked = {case["expr"] for test in doc["tests"] for case in test["promql_expr_test"]}
    rules = yaml.safe_load(RULES.read_text())
    recorded = {rule["record"] for group in rules["groups"] for rule in group["rules"]}
    assert recorded <= checked  # every rule has a test
    assert referenced_names(rules) - exported_names() == set()


def referenced_names(rules: dict[str, object]) -> set[str]:
    """Exported metric names the recording rules read (not the ones they record)."""
    groups = rules["groups"]
    assert isinstance(groups, list)
    exprs = [rule["expr"] for group in groups for rule in group["rules"]]
    return {name for q in exprs for name in _METRIC.findall(q.replace(":", " "))
            if name.startswith(("DCGM_", "gpu_agent_"))}


# One node: GPU 0 split into three MIG instances, each repeating its 300 W and 61 C (as the
# agent and dcgm-exporter serve them), and GPU 1 whole at 200 W and 45 C.
_PANEL_SERIES = [
    *(f'{{name}}{{{{Hostname="node-a",gpu="0",UUID="GPU-0",GPU_I_PROFILE="{p}",GPU_I_ID="{i}"}}}}'
      for p, i in (("3g.40gb", 1), ("2g.20gb", 5), ("1g.10gb", 13))),
    '{name}{{Hostname="node-a",gpu="1",UUID="GPU-1"}}',
]
PANELS = [  # (panel title, metric, values of GPU 0 and GPU 1, series expected, their sum)
    ("GPU power total", "DCGM_FI_DEV_POWER_USAGE", (300, 200), 1, 500),
    ("GPU avg. temperature", "DCGM_FI_DEV_GPU_TEMP", (61, 45), 1, 53),
    ("Power draw", "DCGM_FI_DEV_POWER_USAGE", (300, 200), 2, 500),
    ("GPU temperature", "DCGM_FI_DEV_GPU_TEMP", (61, 45), 2, 106),
    ("SM clock", "DCGM_FI_DEV_SM_CLOCK", (1980, 345), 2, 2325),
    ("Last XID per GPU", "DCGM_FI_DEV_XID_ERRORS", (79, 0), 2, 79),
]


@pytest.mark.parametrize("case", PANELS, ids=[p[0] for p in PANELS])
def test_dashboard_panels_count_a_split_gpu_once(
        tmp_path: Path, case: tuple[str, str, tuple[int, int], int, int]) -> None:
    """The panel's own query, evaluated by promtool on a split and a whole GPU, gives one
    series per physical GPU (or one total), never one per MIG instance."""
    title, metric, values, count, total = case
    promtool = require_tool("promtool", "apt-get install prometheus")
    doc = json.loads(DASHBOARD.read_text())
    panel = next(p for p in doc["panels"] if p["title"] == title)
    expr = panel["targets"][0]["expr"].replace("$Hostname", ".*").replace("$gpu", ".*")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "panel", "rules": [{"record": "panel", "expr": expr}]}]}))
    series = [{"series": s.format(name=metric), "values": f"{values[0 if i < 3 else 1]}x5"}
              for i, s in enumerate(_PANEL_SERIES)]
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": "count(panel)", "eval_time": "2m",
             "exp_samples": [{"labels": "{}", "value": count}]},
            {"expr": "sum(panel)", "eval_time": "2m",
             "exp_samples": [{"labels": "{}", "value": total}]}]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    run = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
