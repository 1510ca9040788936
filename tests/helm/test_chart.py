"""The Helm chart deploy/helm/gpu-node-agent: it lints clean, and with default values it renders
the kustomize base daemonset/base object by object (Helm's own labels aside), so a change to
one side only fails here. Helm is the pinned helm.sh/helm/v4 built from tests/helm (go.mod)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import agent
from tests import gobuild
from tests.deploy.manifests import render
from tests.deploy.tools import ROOT

CHART = ROOT / "deploy" / "helm" / "gpu-node-agent"
MODULE = Path(__file__).resolve().parent
IMAGE = "ghcr.io/gpu-node-agent/gpu-node-agent"
DIGEST = "sha256:" + "ab" * 32
#: Labels Helm's standard set adds that the kustomize base does not have.
HELM_ONLY_LABELS = frozenset({"helm.sh/chart", "app.kubernetes.io/instance",
                              "app.kubernetes.io/managed-by", "app.kubernetes.io/version"})
#: Every value the chart has, set away from its default.
ALL_FEATURES = ["image.registry=registry.example.com", "image.repository=gpu/agent",
                "image.tag=9.9.9", f"image.digest={DIGEST}", "namespace=gpu-system",
                "createNamespace=false", "monitoring.enabled=false",
                "deviceClasses.gpu.extendedResourceName=nvidia.com/gpu",
                "nodeSelector.gpu=yes", "tolerations=null"]
Key = tuple[str, str, str]


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary, built once (minutes cold: Helm and client-go)."""
    return str(gobuild.build(MODULE, gobuild.BUILD / "helm" / "helm", timeout_s=1800))


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                          check=False, env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin",
                                            "HELM_CACHE_HOME": "/nonexistent/cache",
                                            "HELM_CONFIG_HOME": "/nonexistent/config",
                                            "HELM_DATA_HOME": "/nonexistent/data"})


def template(helm: str, *sets: str) -> list[dict[str, Any]]:
    """The chart's objects as ``helm template`` renders them with ``sets`` (key=value)."""
    args = [a for s in sets for a in ("--set", s)]
    done = run_helm(helm, "template", "gpu-node-agent", str(CHART), *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def squeezed(value: Any) -> Any:
    """``value`` with each string's whitespace runs made one space: kustomize re-serialises a
    folded scalar with more-indented lines (a CEL expression) with an extra line break, which
    means nothing to CEL or Prometheus."""
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, dict):
        return {k: squeezed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [squeezed(v) for v in value]
    return value


def keyed(docs: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """The objects by (kind, namespace, name), Helm-only labels dropped."""
    out: dict[Key, dict[str, Any]] = {}
    for doc in docs:
        meta = doc["metadata"]
        labels = {k: v for k, v in meta.get("labels", {}).items() if k not in HELM_ONLY_LABELS}
        key = (doc["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = squeezed({**doc, "metadata": {**meta, "labels": labels}})
    return out


def differences(chart: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[str]:
    """What differs between the two sets of objects, one line per object."""
    ours, theirs = keyed(chart), keyed(base)
    lines = [f"only in the chart: {k}" for k in ours.keys() - theirs.keys()]
    lines += [f"only in the base: {k}" for k in theirs.keys() - ours.keys()]
    lines += [f"differs: {k}" for k in ours.keys() & theirs.keys() if ours[k] != theirs[k]]
    return sorted(lines)


def images(docs: list[dict[str, Any]]) -> set[str]:
    """Every container image of every pod template."""
    return {c["image"] for d in docs if "template" in d.get("spec", {})
            for c in d["spec"]["template"]["spec"]["containers"]}


def gpu_class(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == "DeviceClass"
                and d["metadata"]["name"] == "gpu.nodeagent.dev"]
    return found


@pytest.mark.parametrize("sets", [[], ALL_FEATURES], ids=["defaults", "all-features"])
def test_the_chart_lints_strictly(helm: str, sets: list[str]) -> None:
    args = [a for s in sets for a in ("--set", s)]
    done = run_helm(helm, "lint", "--strict", str(CHART), *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_defaults_render_the_kustomize_base(helm: str) -> None:
    assert differences(template(helm), render("daemonset/base")) == []


@pytest.mark.parametrize(("sets", "expected"), [
    (["namespace=other"], "only in the chart: ('DaemonSet', 'other', 'gpu-node-agent')"),
    (["monitoring.enabled=false"], "only in the base: ('ServiceMonitor', 'gpu-node-agent', "
                                   "'gpu-node-agent')"),
    (["createNamespace=false"], "only in the base: ('Namespace', '', 'gpu-node-agent')"),
    (["deviceClasses.gpu.extendedResourceName=nvidia.com/gpu"],
     "differs: ('DeviceClass', '', 'gpu.nodeagent.dev')"),
])
def test_the_comparison_sees_a_change_on_one_side(helm: str, sets: list[str],
                                                   expected: str) -> None:
    assert expected in differences(template(helm, *sets), render("daemonset/base"))


def test_chart_version_and_app_version_are_the_agents() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (agent.__version__, agent.__version__)


@pytest.mark.parametrize(("sets", "expected"), [
    ([], f"{IMAGE}:{agent.__version__}"),
    (["image.tag=1.2.3"], f"{IMAGE}:1.2.3"),
    ([f"image.digest={DIGEST}"], f"{IMAGE}@{DIGEST}"),
    (["image.tag=1.2.3", f"image.digest={DIGEST}"], f"{IMAGE}@{DIGEST}"),
    (["image.registry=registry.example.com", "image.repository=gpu/agent"],
     f"registry.example.com/gpu/agent:{agent.__version__}"),
])
def test_every_container_runs_the_chosen_image(helm: str, sets: list[str],
                                               expected: str) -> None:
    assert images(template(helm, *sets)) == {expected}


def test_the_default_image_is_the_kustomize_bases() -> None:
    assert images(render("daemonset/base")) == {f"{IMAGE}:{agent.__version__}"}


@pytest.mark.parametrize(("sets", "expected"), [
    ([], None),
    (["deviceClasses.gpu.extendedResourceName=nvidia.com/gpu"], "nvidia.com/gpu"),
])
def test_extended_resource_name_only_when_set(helm: str, sets: list[str],
                                              expected: str | None) -> None:
    docs = template(helm, *sets)
    assert gpu_class(docs)["spec"].get("extendedResourceName") == expected
    others = [d for d in docs if d["kind"] == "DeviceClass" and d is not gpu_class(docs)]
    assert len(others) == 3
    assert all("extendedResourceName" not in d["spec"] for d in others)


def test_scheduling_and_namespace_values_reach_every_pod(helm: str) -> None:
    # --set merges into the default map; null drops the default key.
    docs = template(helm, "namespace=gpu-system", "nodeSelector.nvidia\\.com/gpu\\.present=null",
                    "nodeSelector.pool=gpu", "tolerations=null")
    pods = [d for d in docs if d["kind"] == "DaemonSet"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["metadata"]["namespace"] == "gpu-system"
        assert pod["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert "tolerations" not in pod["spec"]["template"]["spec"]
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 2
    for policy in policies:
        (condition,) = policy["spec"]["matchConditions"]
        assert "system:serviceaccount:gpu-system:gpu-node-agent" in condition["expression"]
