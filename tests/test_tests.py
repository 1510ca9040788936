"""The suite's own rules, checked over its source: a test waits on the condition itself, never
on a sleep, and reads agent objects through their public surface, never their underscore
attributes. Test code is every file under tests/ and bench/tests/, and the root conftest.py.
Each rule is also shown refusing a planted offender.

Sleeps. A call of ``time.sleep`` or ``asyncio.sleep`` is refused anywhere in test code but the
one poll (``tests/waiting.py``) and the few places :data:`SLEEPS` names, each saying why time
itself is what it needs (pacing load, a fault that lasts a stated time, a harness that kills
at a seeded moment). ``sleep(0)`` waits for nothing: it yields to the event loop once, so it
is allowed. (Fake tools' sources that tests write to files are strings: not scanned.)

Private attributes. ``x._name`` (also ``getattr``/``setattr``/``monkeypatch.setattr`` with
``"_name"``, and ``from agent... import _name``) is refused unless ``x`` is ``self`` or
``cls`` (a class's own state is its business) or ``_name`` is a harness's own: defined by
code under tests/ or bench/ and nowhere in agent/ or cdi/. That refuses every underscore
attribute of an agent object, and of what it holds (a prometheus child's ``_value``: read
metrics through ``registry.get_sample_value``), with no list of agent names to keep.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_DIRS = ("tests", "bench/tests")
#: Test code outside those: the suite's own pytest hooks.
TEST_FILES = ("conftest.py",)
#: Where a harness's own classes live (bench/tests drive bench/'s).
HARNESS_DIRS = ("tests", "bench")
PRODUCT_DIRS = ("agent", "cdi")
SLEEPY = ("time", "asyncio")
WAITING = "tests/waiting.py"

#: "path::function" -> why that code needs time to pass rather than a condition to hold.
SLEEPS: dict[str, str] = {
    "tests/device/real_nvml_check.py::_idle_cpu":
        "measures the agent's idle CPU over a stated interval",
    "tests/from_bind.py::send_from_bind":
        "a caller retrying from the agent's bind on, paced (it records what it saw)",
    "tests/harness/crash.py::Harness._mps_burst": "the crash harness kills at a seeded moment",
    "tests/harness/crash.py::Harness._random_burst": "the crash harness kills at a seeded moment",
    "tests/integration/test_one_owner_devices.py::_slice_during_planning":
        "a race test sampling moments of one transition; every outcome is checked",
    "tests/k8s/test_faults_agent.py::"
    "test_agent_gone_longer_than_agent_lost_after_deletes_the_pool_until_it_returns":
        "the fault is an absence of a stated length, which the pool must outlive",
    "tests/k8s/test_faults_apiserver.py::test_api_server_unreachable_for_a_while":
        "the fault is an outage of a stated length",
    "tests/k8s/test_mig_labels.py::test_mode_off_ignores_the_label":
        "an absence with no later event to wait for: without the mode, nothing watches the "
        "Node",
    "tests/kubeplugin/test_publisher_loop.py::test_a_restarted_publisher_rewrites_nothing":
        "no further write: the publisher shows no count of the watch events it has seen",
    "tests/kubeplugin/test_publisher_loop.py::"
    "test_dropped_counters_withdraw_the_devices_that_consume_them":
        "no further write: the publisher shows no count of the watch events it has seen",
    "tests/kubeplugin/test_publisher_loop.py::test_dropped_shares_publish_the_gpus_whole":
        "no further write: the publisher shows no count of the watch events it has seen",
    "tests/reliability/one_owner.py::Rig.concurrently":
        "the stateful test's seeded delay between a change and the claims sent into it",
    "tests/reliability/one_owner.py::Rig.restart": "the stateful test kills at a seeded moment",
    "tests/reliability/test_flood.py::test_healthz_stays_fast_while_the_metrics_port_is_flooded":
        "paces the probes of a load test",
    "tests/reliability/peers.py::probe_for": "paces the probes of a load test",
    "tests/soak.py::_Driver.run": "the soak's load driver backs off after an error",
    "tests/soak.py::run_soak": "the soak samples the agent at a fixed rate",
}

#: "path::function" -> why it reads an underscore attribute that is not a harness's own.
PRIVATES: dict[str, str] = {
    "conftest.py::_starts_processes":
        "pytest's record of a test's fixtures (Item._fixtureinfo) has no public form",
    "tests/mpshost/test_host.py::_exchange_as":
        "os._exit, the standard library's exit without clean-up, in a forked child",
}


@dataclass(frozen=True)
class Finding:
    """One refused use: where (``path:line``), in which function, and what."""

    path: str
    line: int
    function: str
    what: str

    @property
    def key(self) -> str:
        return f"{self.path}::{self.function}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.function}): {self.what}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name != "_"


def defined_privates(sources: Iterable[str]) -> frozenset[str]:
    """Every underscore name the given sources define: functions, classes, module and class
    attributes, attributes assigned on any object, names imported as."""
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return frozenset(n for n in names if _private(n))


def harness_names(tests: Iterable[str], product: Iterable[str]) -> frozenset[str]:
    """The underscore names only test code defines: a harness's own, safe to read anywhere."""
    return defined_privates(tests) - defined_privates(product)


def _sources(directories: Iterable[str]) -> Iterator[tuple[str, str]]:
    for directory in directories:
        for path in sorted((ROOT / directory).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


@cache
def _harness() -> frozenset[str]:
    return harness_names((s for _, s in _sources(HARNESS_DIRS)),
                         (s for _, s in _sources(PRODUCT_DIRS)))


class _Scan(ast.NodeVisitor):
    """Walks one test module, recording refused sleeps and private reads by function."""

    def __init__(self, path: str, harness: frozenset[str]) -> None:
        self.path, self.harness = path, harness
        self.scope: list[str] = []
        self.sleeps: list[Finding] = []
        self.reads: list[Finding] = []
        self.modules: set[str] = set()  # local names of the time and asyncio modules
        self.sleep_names: set[str] = set()  # names bound to a sleep by "from ... import"

    def _refused(self, name: str) -> bool:
        return _private(name) and name not in self.harness

    def _find(self, into: list[Finding], node: ast.AST, what: str) -> None:
        into.append(Finding(self.path, getattr(node, "lineno", 0),
                            ".".join(self.scope) or "<module>", what))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        self.modules |= {a.asname or a.name for a in node.names if a.name in SLEEPY}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            if module in SLEEPY and alias.name == "sleep":
                self.sleep_names.add(alias.asname or alias.name)
            if module.split(".")[0] in PRODUCT_DIRS and _private(alias.name):
                self._find(self.reads, node, f"from {module} import {alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        sleeps = (isinstance(func, ast.Attribute) and func.attr == "sleep"
                  and isinstance(func.value, ast.Name) and func.value.id in self.modules) \
            or (isinstance(func, ast.Name) and func.id in self.sleep_names)
        yields = bool(node.args) and isinstance(node.args[0], ast.Constant) \
            and node.args[0].value == 0
        if sleeps and not yields:
            self._find(self.sleeps, node, ast.unparse(node))
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else ""
        if name in ("getattr", "setattr", "hasattr", "delattr"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                        and self._refused(arg.value.split(".")[-1]):
                    self._find(self.reads, node, ast.unparse(node))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if not own and self._refused(node.attr):
            self._find(self.reads, node, ast.unparse(node))
        self.generic_visit(node)


def scan(path: str, source: str, harness: frozenset[str]) -> tuple[list[Finding],
                                                                  list[Finding]]:
    """The refused sleeps and the refused private reads of one test module's source."""
    visitor = _Scan(path, harness)
    visitor.visit(ast.parse(source))
    return visitor.sleeps, visitor.reads


@cache
def _all_findings() -> tuple[list[Finding], list[Finding]]:
    sleeps: list[Finding] = []
    reads: list[Finding] = []
    files = [(name, (ROOT / name).read_text(encoding="utf-8")) for name in TEST_FILES
             if (ROOT / name).exists()]
    for path, source in [*_sources(TEST_DIRS), *files]:
        found_sleeps, found_reads = scan(path, source, _harness())
        sleeps += found_sleeps if path != WAITING else []
        reads += found_reads
    return sleeps, reads


def test_no_test_sleeps_to_synchronise() -> None:
    """Every sleep in test code is the one poll's pause or an allowed, reasoned one."""
    sleeps, _ = _all_findings()
    refused = [str(f) for f in sleeps if f.key not in SLEEPS]
    assert not refused, "wait on the condition (tests/waiting.py), not a sleep:\n" + \
        "\n".join(refused)


def test_no_test_reads_an_agent_objects_underscore_attributes() -> None:
    """No test code reads (or patches) an underscore attribute but its own harness's."""
    _, reads = _all_findings()
    refused = [str(f) for f in reads if f.key not in PRIVATES]
    assert not refused, "use the public surface (API, metrics, files, accessors):\n" + \
        "\n".join(refused)


def test_every_allowance_is_still_needed() -> None:
    """An allow-list entry whose code no longer sleeps or reads a private is stale."""
    sleeps, reads = _all_findings()
    assert sorted(set(SLEEPS) - {f.key for f in sleeps}) == []
    assert sorted(set(PRIVATES) - {f.key for f in reads}) == []


HARNESS = '''
class Stack:
    def __init__(self):
        self._fixtures = []
        self._holders = {}  # agent/ defines it too: not a harness's own
'''
PRODUCT = '''
class Ledger:
    _shared = 1
    def __init__(self):
        self._holders = {}
    def _lock_for(self, gpu): ...
def _helper(): ...
_TABLE = {}
'''

CASES = [
    ("a time.sleep", "import time\ndef test():\n    time.sleep(0.2)\n", 1, 0),
    ("an aliased module's sleep", "import time as t\ndef test():\n    t.sleep(1)\n", 1, 0),
    ("an imported sleep", "from time import sleep\ndef test():\n    sleep(0.1)\n", 1, 0),
    ("an awaited asyncio.sleep",
     "import asyncio\nasync def test():\n    await asyncio.sleep(0.3)\n", 1, 0),
    ("a sleep of a computed time", "import time\ndef f(x):\n    time.sleep(x)\n", 1, 0),
    ("asyncio.sleep(0) yields, waits for nothing",
     "import asyncio\nasync def test():\n    await asyncio.sleep(0)\n", 0, 0),
    ("another object's sleep", "def test(clock):\n    clock.sleep(5)\n", 0, 0),
    ("an agent object's private attribute", "def test(ledger):\n    ledger._holders\n", 0, 1),
    ("a private attribute deep in a chain", "def test(n):\n    n.claims.ledger._lock_for(1)\n",
     0, 1),
    ("a private class attribute", "def test(L):\n    L._shared\n", 0, 1),
    ("a private write", "def test(l):\n    l._holders = {}\n", 0, 1),
    ("a private module function", "import m\ndef test():\n    m._helper()\n", 0, 1),
    ("a private import from agent", "from agent.ledger import _TABLE\n", 0, 1),
    ("a private through getattr", "def test(l):\n    getattr(l, '_holders')\n", 0, 1),
    ("a patched private", "def test(mp, l):\n    mp.setattr(l, '_lock_for', None)\n", 0, 1),
    ("a patched private by path",
     "def test(mp):\n    mp.setattr('agent.ledger._helper', None)\n", 0, 1),
    ("a test class's own state",
     "class Harness:\n    def go(self):\n        self._holders = 1\n        return cls._shared\n",
     0, 0),
    ("a harness's own attribute", "def test(stack):\n    stack._fixtures\n", 0, 0),
    ("what an agent object holds (a prometheus child)",
     "def test(m):\n    m.errors.labels('x')._value.get()\n", 0, 1),
    ("a library's private", "def test(item):\n    item._fixtureinfo\n", 0, 1),
    ("a dunder", "def test(x):\n    x.__class__\n", 0, 0),
    ("a private import from elsewhere", "from os import _exit\n", 0, 0),
]


@pytest.mark.parametrize(("source", "sleeps", "reads"),
                         [(s, n, r) for _, s, n, r in CASES], ids=[c[0] for c in CASES])
def test_the_checker_refuses_planted_offenders(source: str, sleeps: int, reads: int) -> None:
    """Each snippet gives exactly the findings its description says."""
    found_sleeps, found_reads = scan("t.py", source, harness_names([HARNESS], [PRODUCT]))
    assert (len(found_sleeps), len(found_reads)) == (sleeps, reads), \
        (found_sleeps, found_reads)


def test_findings_name_the_function_they_are_in() -> None:
    """An allow-list entry is keyed by path and enclosing function, methods by class."""
    source = "import time\nclass Load:\n    def pace(self):\n        time.sleep(1)\n"
    sleeps, _ = scan("tests/x.py", source, frozenset())
    assert [f.key for f in sleeps] == ["tests/x.py::Load.pace"]
