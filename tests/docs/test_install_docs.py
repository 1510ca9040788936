"""The install steps of docs/deploy.md provide what the manifests and units they install need:
every Secret key the DaemonSet mounts or reads, and every extra the bare-metal units import.
Read in-process from the files themselves, so a key or extra added later fails here first."""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy.md"


def _sections(text: str) -> dict[str, str]:
    """Each ``## `` section of a Markdown document by its heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _commands(section: str) -> Iterator[list[str]]:
    """The shell commands of a section's ``sh`` blocks, continuation lines joined, split as
    the shell splits them (comments dropped)."""
    for block in re.findall(r"^```sh\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                yield words


def _secret_keys_created(section: str) -> dict[str, set[str]]:
    """The Secrets a section's ``kubectl``/``oc create secret`` commands make, with their
    keys."""
    made: dict[str, set[str]] = {}
    for words in _commands(section):
        if words[0] not in {"kubectl", "oc"} or "secret" not in words:
            continue
        at = words.index("secret")
        kind, name = words[at + 1], words[at + 2]
        keys = made.setdefault(name, set())
        if kind == "tls":
            keys |= {"tls.crt", "tls.key"}
        for word in words[at + 3:]:
            flag, _, value = word.partition("=")
            if flag in {"--from-file", "--from-literal"}:
                keys.add(value.partition("=")[0] if "=" in value else Path(value).name)
    return made


def _secret_keys_needed(daemonset: dict[str, Any]) -> dict[str, set[str]]:
    """The Secrets the DaemonSet's volumes and env name, with the keys they name (empty when
    a volume mounts the whole Secret)."""
    pod = daemonset["spec"]["template"]["spec"]
    needed: dict[str, set[str]] = {}
    for volume in pod.get("volumes", []):
        sources = [volume] if "secret" in volume else volume.get("projected", {}).get(
            "sources", [])
        for source in sources:
            if "secret" in source:
                ref = source["secret"]
                name = ref.get("secretName") or ref["name"]
                needed.setdefault(name, set()).update(i["key"] for i in ref.get("items", []))
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                needed.setdefault(ref["name"], set()).add(ref["key"])
        for env_from in container.get("envFrom", []):
            if "secretRef" in env_from:
                needed.setdefault(env_from["secretRef"]["name"], set())
    return needed


def _daemonset() -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "daemonset/base/daemonset.yaml").read_text())
    found: list[dict[str, Any]] = [d for d in docs if d and d["kind"] == "DaemonSet"]
    (daemonset,) = found
    return daemonset


#: The sections that install the DaemonSet, by the command that applies it.
INSTALLS = {"Kubernetes": "kubectl", "OpenShift": "oc"}


def test_the_daemonset_names_secret_keys() -> None:
    """The manifest this checks against names both Secrets and the plugin's key (a parser
    that found nothing would let every doc pass)."""
    needed = _secret_keys_needed(_daemonset())
    assert needed["gpu-node-agent-tokens"] >= {"tokens", "kubelet-plugin-token"}
    assert "gpu-node-agent-tls" in needed


@pytest.mark.parametrize("heading", list(INSTALLS))
def test_each_install_creates_every_secret_key_the_daemonset_uses(heading: str) -> None:
    """Following a section's commands leaves no Secret or key of the DaemonSet missing (a
    missing key keeps the pod in ContainerCreating)."""
    (section,) = [body for title, body in _sections(DEPLOY.read_text()).items()
                  if title.startswith(heading)]
    assert any(w[0] == INSTALLS[heading] and "apply" in w
               for w in _commands(section)), f"{heading} installs nothing"
    created = _secret_keys_created(section)
    missing = {name: sorted(keys - created.get(name, set()))
               for name, keys in _secret_keys_needed(_daemonset()).items()
               if name not in created or keys - created[name]}
    assert missing == {}, f"{heading}: the doc's secrets lack these keys"


def _extras_providing(module_packages: set[str]) -> set[str]:
    """The runtime pyproject extras (not ``test``, which repeats them for the suite) that list
    any of ``module_packages`` (distribution names)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return {extra for extra, reqs in extras.items() if extra != "test"
            if any(re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0] in module_packages
                   for req in reqs)}


def test_the_bare_metal_install_has_every_extra_its_units_need() -> None:
    """The bare-metal pip line installs the extras the units it installs import: systemd-python
    for ``Type=notify``, grpcio and the Kubernetes client for the kubelet plugin's unit
    (without them the plugin exits "grpc is missing")."""
    (section,) = [body for title, body in _sections(DEPLOY.read_text()).items()
                  if title.startswith("Bare metal")]
    (pip,) = [w for w in _commands(section) if w[0].endswith("/pip") and "install" in w]
    (target,) = [w for w in pip if w.startswith(".[")]
    installed = set(target[2:-1].split(","))
    needed = _extras_providing({"systemd-python"})
    if (ROOT / "systemd/gpu-agent-kubelet-plugin.service").exists():
        needed |= _extras_providing({"grpcio", "kubernetes-asyncio"})
    assert needed >= {"systemd", "kubernetes"}
    assert needed - installed == set(), pip
