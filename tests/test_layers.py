"""Imports run down the layers, never up: a module may import its own layer and the ones below,
so the hardware never knows about claims and no service knows about HTTP. The table of layers
lives here; docs/architecture.md ("Layers") shows the same table."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "cdi")

#: Bottom to top.
LAYERS = ("foundation", "hardware", "ledger", "services", "wiring", "api", "entry")

#: A module's layer is the row of its own name or of its nearest package; the root package
#: ``agent`` covers only ``agent/__init__.py``, so a new package needs a row of its own.
LAYER_OF = {
    # foundation: values, files and settings everything else may use
    "agent": "foundation",
    "agent.errors": "foundation",
    "agent.durable": "foundation",
    "agent.host": "foundation",
    "agent.logs": "foundation",
    "agent.events": "foundation",
    "agent.device_names": "foundation",
    "agent.quantity": "foundation",
    "agent.token_file": "foundation",
    "agent.settings": "foundation",
    "agent.readiness": "foundation",
    "cdi": "foundation",
    # hardware: the one door to NVML, and the simulator behind it
    "agent.gpu": "hardware",
    "agent.gpu.sim": "hardware",
    # starting MPS daemons: the launch seam, the agent's own launcher, the MPS host's protocol
    # and the agent's client of it; imported by the agent and by the MPS host alike
    "agent.mps": "hardware",
    # the MPS host: a process of its own that starts MPS daemons outside the agent's cgroup
    # (test_mps_host_imports_only_the_launch_seam narrows what it may import)
    "agent.mpshost": "hardware",
    # ledger: the one owner of each GPU's instances and their holders
    "agent.ledger": "ledger",
    # device health as Kubernetes sees it: faults and their taints (pure values the ledger's
    # one availability model is made of)
    "agent.health": "ledger",
    # services: what the agent does with the GPUs
    "agent.mig": "services",
    "agent.claims": "services",
    "agent.topology": "services",
    "agent.metrics": "services",
    "agent.dra": "services",
    # compute domains: the IMEX node list, this node's IMEX daemon, the channel claims hold
    "agent.domains": "services",
    # kubelet's PodResources client (pod labels on metrics; grpcio only with the flag)
    "agent.podresources": "services",
    # the kubelet plugin: a process of its own that reaches the agent only over REST
    # (test_kubeplugin_talks_to_the_agent_only_over_rest narrows what it may import)
    "agent.kubeplugin": "services",
    # wiring: build_node puts the services together
    "agent.wiring": "wiring",
    # api: HTTP, the only code that knows statuses
    "agent.api": "api",
    # entry: processes and their command lines
    "agent.daemon": "entry",
    "agent.cli": "entry",
    "agent.systemd": "entry",
    "agent.__main__": "entry",
}


def _modules() -> dict[str, Path]:
    """Every module under the checked packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str | None:
    """The layer of ``module`` from the table, or None when no row covers it."""
    name = module
    while True:
        # The root package's row is for agent/__init__.py alone.
        if name in LAYER_OF and (name == module or name != "agent"):
            return LAYER_OF[name]
        if "." not in name:
            return None
        name = name.rpartition(".")[0]


def resolve_imports(module: str, source: str, *, is_package: bool,
                    known: Collection[str]) -> Iterator[str]:
    """Every agent or cdi module that the code ``source`` of ``module`` imports, anywhere in
    its body (a lazy import inside a function or an ``if TYPE_CHECKING`` still depends on what
    it names). ``from pkg import name`` is the module ``pkg.name`` when that is in ``known``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                origin = f"{base}.{node.module}" if node.module else base
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known
                       else origin for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                yield target


def imports_of(module: str) -> set[str]:
    """The agent and cdi modules that the tree's ``module`` imports."""
    path = MODULES[module]
    return set(resolve_imports(module, path.read_text(), is_package=path.name == "__init__.py",
                               known=MODULES))


def test_every_module_has_a_layer() -> None:
    """Every module of agent/ and cdi/ is covered by a row of the layer table."""
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_table_rows_name_known_layers() -> None:
    """The table uses only the layers it orders."""
    assert set(LAYER_OF.values()) <= set(LAYERS)


def test_imported_modules_exist() -> None:
    """Each import resolves to a module of the tree, so the layer check sees real edges."""
    missing = sorted({f"{m} -> {t}" for m in MODULES for t in imports_of(m)
                      if t not in MODULES})
    assert missing == []


def test_no_import_runs_up_a_layer() -> None:
    """No module imports one of a higher layer (the same layer is allowed)."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for module in MODULES:
        mine = layer_of(module)
        for target in sorted(imports_of(module)):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and rank[theirs] > rank[mine]:
                upward.append(f"{module} -> {target} ({mine} -> {theirs})")
    assert upward == []


def test_kubeplugin_talks_to_the_agent_only_over_rest() -> None:
    """agent.kubeplugin imports only foundation modules and itself: never the claims, MIG,
    ledger, GPU or API code it reaches through the agent's REST API."""
    allowed = {m for m in MODULES if layer_of(m) == "foundation"}
    plugin = [m for m in MODULES if m.startswith("agent.kubeplugin")]
    assert "agent.kubeplugin.agent_client" in plugin
    reached = sorted(f"{m} -> {t}" for m in plugin for t in imports_of(m)
                     if not t.startswith("agent.kubeplugin") and t not in allowed)
    assert reached == []


#: What the claims may import of agent.mig: the one owner of the instances and the values it
#: speaks in (geometry, catalog, the pure MIG-mode rule); never the executor, the journal,
#: the transitions or the session behind it.
MIG_OWNER_API = {"agent.mig.devices", "agent.mig.geometry", "agent.mig.catalog",
                 "agent.mig.mode"}


def test_claims_reach_mig_instances_only_through_the_one_owner() -> None:
    """agent.claims imports of agent.mig only the one owner's API (MigDevices and its value
    types), and nothing of the NVML session: every change to a GPU's instances goes through
    one door."""
    claims = [m for m in MODULES if m.startswith("agent.claims")]
    reached = sorted(f"{m} -> {t}" for m in claims for t in imports_of(m)
                     if (t.startswith("agent.mig") and t not in MIG_OWNER_API)
                     or t == "agent.gpu.session")
    assert reached == []


#: What the MPS host may import besides foundation modules and itself.
MPS_HOST_SEAM = {"agent.mps.launch", "agent.mps.direct", "agent.mps.protocol"}


def test_mps_host_imports_only_the_launch_seam() -> None:
    """agent.mpshost imports only foundation modules, itself and the launch seam (the
    MpsLauncher types and DirectLauncher): never NVML, claims, ledger or API code, so the
    root process outside the agent's cgroup stays small."""
    allowed = {m for m in MODULES if layer_of(m) == "foundation"} | MPS_HOST_SEAM
    host = [m for m in MODULES if m.startswith("agent.mpshost")]
    assert "agent.mpshost.server" in host
    reached = sorted(f"{m} -> {t}" for m in host for t in imports_of(m)
                     if not t.startswith("agent.mpshost") and t not in allowed)
    assert reached == []


def test_mps_host_is_reached_only_by_its_command() -> None:
    """Only the CLI subcommand imports agent.mpshost: the agent never runs the server in its
    own process, and reaches it through agent.mps (the protocol both speak)."""
    users = sorted(m for m in MODULES if not m.startswith("agent.mpshost")
                   and any(t.startswith("agent.mpshost") for t in imports_of(m)))
    assert users == ["agent.cli.mps_host"]


def test_the_mps_seam_imports_neither_side() -> None:
    """agent.mps imports only foundation modules and itself: neither the GPU layer that uses
    it nor the MPS host."""
    allowed = {m for m in MODULES if layer_of(m) == "foundation"}
    seam = [m for m in MODULES if m.startswith("agent.mps.") or m == "agent.mps"]
    reached = sorted(f"{m} -> {t}" for m in seam for t in imports_of(m)
                     if not t.startswith("agent.mps.") and t != "agent.mps" and t not in allowed)
    assert reached == []


def test_every_package_needs_its_own_row() -> None:
    """A module is covered by its own row or its package's; the root package covers nothing
    but itself, so a new package without a row is reported."""
    assert layer_of("agent.gpu.sim.node") == "hardware"
    assert layer_of("agent.api.metrics_app") == "api"
    assert layer_of("cdi.spec") == "foundation"
    assert layer_of("agent") == "foundation"
    assert layer_of("agent.newthing") is None
    assert layer_of("agent.newthing.part") is None


KNOWN = {"agent.api.admin", "agent.claims.checkpoint", "agent.claims.service", "agent.errors",
         "agent.gpu.session"}


@pytest.mark.parametrize(("line", "modules"), [
    ("import json", set()),
    ("import agent.errors", {"agent.errors"}),
    ("from agent.api import admin, models", {"agent.api.admin", "agent.api"}),
    ("from agent.gpu.types import Gpu", {"agent.gpu.types"}),
    ("from . import checkpoint", {"agent.claims.checkpoint"}),
    ("from .service import ClaimService", {"agent.claims.service"}),
    ("from .. import errors as e", {"agent.errors"}),
    ("from ..gpu import session", {"agent.gpu.session"}),
    ("def later() -> None:\n    from agent.daemon import serve", {"agent.daemon"}),
    ("if TYPE_CHECKING:\n    from agent.api.context import AgentContext",
     {"agent.api.context"}),
])
def test_imports_resolve_to_modules(line: str, modules: set[str]) -> None:
    """Absolute, relative, package-level and lazy imports (in agent/claims/placement.py) each
    resolve to the module they load; imports from outside agent/ and cdi/ are no edges."""
    found = set(resolve_imports("agent.claims.placement", line, is_package=False, known=KNOWN))
    assert found == modules
