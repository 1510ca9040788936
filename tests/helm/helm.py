"""Helm for the chart tests: the CLI of the pinned ``helm.sh/helm/v4`` module (tests/helm/go.mod,
main.go), built by tests/gobuild.py, run with homes of its own (no user config, cache or
repositories leak in), and the chart's objects compared with the kustomize tree's."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests import gobuild

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpu-node-agent"
MODULE = Path(__file__).resolve().parent
VALUES = MODULE / "values"
BINARY = gobuild.BUILD / "helm" / "helm"
#: A cold build links Helm with client-go and kubectl's libraries: minutes on 2 shared cores.
BUILD_TIMEOUT_S = 1800.0
#: Labels only Helm puts on objects (its release bookkeeping and the chart's version); the
#: rest, app.kubernetes.io/name and part-of included, must be the kustomize tree's.
HELM_ONLY_LABELS = frozenset({"helm.sh/chart", "app.kubernetes.io/instance",
                              "app.kubernetes.io/managed-by", "app.kubernetes.io/version"})
#: Lists whose order means nothing to Kubernetes (merged by name), which a kustomize strategic
#: merge patch reorders (the mig-manager overlay puts kubelet-plugin first).
BY_NAME = frozenset({"containers", "volumes", "volumeMounts", "env", "ports"})
#: CEL, where whitespace means nothing: YAML parsers disagree on a folded block's indented
#: lines (kustomize keeps a blank line that Helm and PyYAML do not).
CEL = frozenset({"expression", "messageExpression"})

Json = dict[str, Any]
Key = tuple[str, str, str]


def helm_binary() -> Path:
    """``build/helm/helm``, built from tests/helm if its sources or Go changed."""
    return gobuild.build(MODULE, BINARY, BUILD_TIMEOUT_S)


def helm_env(home: Path, kubeconfig: Path | None = None) -> dict[str, str]:
    """An environment for helm with every home under ``home`` and only ``kubeconfig``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}
    env["KUBECONFIG"] = str(kubeconfig) if kubeconfig else str(home / "no-kubeconfig")
    return env


def run(home: Path, *args: str, kubeconfig: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One helm command; its result (the caller checks the return code)."""
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=helm_env(home, kubeconfig))


def template(home: Path, *, values: Sequence[Path] = (), sets: Sequence[str] = (),
             namespace: str = "gpu-node-agent", chart: Path = CHART) -> list[Json]:
    """The chart's objects as ``helm template`` renders them (release ``gpu-node-agent``)."""
    args = [a for v in values for a in ("--values", str(v))]
    args += [a for s in sets for a in ("--set", s)]
    done = run(home, "template", "gpu-node-agent", str(chart), "--namespace", namespace, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _normal(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_normal(v) for v in value]
        if key in BY_NAME and all(isinstance(v, dict) and "name" in v for v in items):
            items.sort(key=lambda v: str(v["name"]))
        return items
    if isinstance(value, str) and key in CEL:
        return " ".join(value.split())
    return value


def keyed(docs: Sequence[Json]) -> dict[Key, Json]:
    """The objects by (kind, namespace, name), normalised: Helm-only labels dropped, lists
    merged by name in name order, CEL whitespace collapsed."""
    out: dict[Key, Json] = {}
    for doc in docs:
        meta = doc["metadata"]
        labels = {k: v for k, v in (meta.get("labels") or {}).items()
                  if k not in HELM_ONLY_LABELS}
        key = (str(doc["kind"]), str(meta.get("namespace", "")), str(meta["name"]))
        assert key not in out, f"{key} twice"
        out[key] = _normal({**doc, "metadata": {**meta, "labels": labels}})
    return out


def differences(chart: Sequence[Json], kustomize: Sequence[Json]) -> list[str]:
    """One line per object that is in one set only or differs (with the first differing
    field's path), empty when the two install the same objects."""
    ours, theirs = keyed(chart), keyed(kustomize)
    lines = [f"only in the chart: {k}" for k in sorted(ours.keys() - theirs.keys())]
    lines += [f"only in kustomize: {k}" for k in sorted(theirs.keys() - ours.keys())]
    lines += [f"differs: {k} at {first_difference(ours[k], theirs[k])}"
              for k in sorted(ours.keys() & theirs.keys()) if ours[k] != theirs[k]]
    return lines


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """The path of the first field where ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path or '.'}: chart {a!r:.80} / kustomize {b!r:.80}"
