"""The tiers' classifier (tests/processes.py): what it counts as starting a process, and the
run-time guard that keeps the in-process tier honest."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import gobuild
from tests.agent_process import start_agent
from tests.processes import Classifier, ProcessStarted, forbid_processes, starts_processes


def pure() -> int:
    return sum(range(3))


def runs_a_tool() -> None:
    subprocess.run(["true"], check=True)


def imports_subprocess_locally() -> None:
    import subprocess as sp  # noqa: PLC0415

    sp.run(["true"], check=True)


async def spawns_on_the_loop() -> None:
    await asyncio.create_subprocess_exec("true")


def forks() -> None:
    os.fork()


def calls_a_helper_that_starts_an_agent() -> None:
    start_agent  # noqa: B018 - naming it is what counts


def builds_go() -> None:
    gobuild.build  # noqa: B018


def through_a_helper() -> None:
    runs_a_tool()


def runs_simulated_tools(node: Any) -> None:
    node.tools_dir  # noqa: B018 - the simulator's nvidia-smi, run as a process


class Harness:
    def start(self) -> None:
        runs_a_tool()


def uses_a_class_that_spawns() -> None:
    Harness().start()


@starts_processes
def marked() -> None:
    """Hands a test product code that spawns."""


def recursive(n: int) -> int:
    return recursive(n - 1) if n else 0


@pytest.mark.parametrize(("target", "spawns"), [
    (pure, False),
    (recursive, False),
    (runs_a_tool, True),
    (imports_subprocess_locally, True),
    (spawns_on_the_loop, True),
    (forks, True),
    (calls_a_helper_that_starts_an_agent, True),
    (builds_go, True),
    (through_a_helper, True),
    (runs_simulated_tools, True),
    (uses_a_class_that_spawns, True),
    (Harness, True),
    (marked, True),
    (subprocess.run, True),
    (sys.exit, False),
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_the_classifier_follows_test_code_to_process_apis(target: Any, spawns: bool) -> None:
    """A test is in the process tier exactly when the code it reaches names a process API."""
    assert Classifier().spawns(target) is spawns


def test_the_guard_refuses_a_process_start_and_names_the_test() -> None:
    """Inside the in-process tier's guard, a Popen fails before any child exists."""
    with forbid_processes("tests/x.py::test_y"), pytest.raises(ProcessStarted) as refused:
        subprocess.run(["true"], check=True)
    assert "tests/x.py::test_y" in str(refused.value)
    assert subprocess.run(["true"], check=True).returncode == 0  # restored after the block


def test_the_guard_refuses_a_fork() -> None:
    with forbid_processes("t"), pytest.raises(ProcessStarted):
        os.fork()


CONFTEST = Path(__file__).resolve().parent.parent / "conftest.py"

TIERED = """
import subprocess


def spawn() -> None:
    subprocess.run(["true"], check=True)


def test_spawns() -> None:
    subprocess.run(["true"], check=True)


def test_pure() -> None:
    assert 1 + 1 == 2


def test_hides_its_process() -> None:
    spawn()  # a helper of a module the classifier does not follow
"""


def _project(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_tiered=TIERED)


def test_the_collection_hook_marks_what_starts_processes(pytester: pytest.Pytester) -> None:
    """The project's conftest marks a test that names a process API, and only it."""
    _project(pytester)
    collected = pytester.runpytest_inprocess("--collect-only", "-q", "-m", "process",
                                             "-p", "no:cacheprovider")
    assert "test_tiered.py::test_spawns" in collected.stdout.str()
    assert "test_pure" not in collected.stdout.str()


def test_an_unmarked_test_that_starts_a_process_fails_saying_so(
        pytester: pytest.Pytester) -> None:
    """A process start the classifier missed fails its test, naming the tier, instead of
    running silently in ``make check``."""
    _project(pytester)
    ran = pytester.runpytest_inprocess("-q", "-m", "not process", "-p", "no:cacheprovider")
    ran.assert_outcomes(passed=1, failed=1)
    assert "test_hides_its_process started a process" in ran.stdout.str()
    assert "is not in the 'process' tier" in ran.stdout.str()


GROUPED = """
import os

import pytest


@pytest.fixture(scope="session")
def kube_apiservers():
    return None


@pytest.mark.parametrize("version", ["1.34", "1.37"])
@pytest.mark.parametrize("case", range(4))
def test_versioned(kube_apiservers, version, case, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent.parent / f"{version}-{case}").write_text(
        str(os.getpid()))


@pytest.mark.parametrize("case", range(4))
def test_newest(kube_apiservers, case, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent.parent / f"newest-{case}").write_text(
        str(os.getpid()))
"""


@starts_processes  # pytester's runpytest_subprocess, and the workers pytest-xdist starts
def test_api_server_tests_run_on_one_worker_per_version(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``--dist loadgroup`` the tests of one Kubernetes version's shared API servers
    (of one module, for a version split in parts) run in one worker, which starts them once
    (pytest-xdist#1386 silently dropped the groups on pytest 9.2: every worker then started
    every server)."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_grouped=GROUPED)
    monkeypatch.setenv("PYTHONPATH", str(CONFTEST.parent))  # the conftest imports tests/
    ran = pytester.runpytest_subprocess("-n", "3", "--dist", "loadgroup", "-p",
                                        "no:cacheprovider")
    ran.assert_outcomes(passed=12)
    workers = {group: {(pytester.path / f"{group}-{case}").read_text() for case in range(4)}
               for group in ("1.34", "1.37", "newest")}
    assert all(len(pids) == 1 for pids in workers.values()), workers


def test_the_newest_versions_modules_are_spread_over_its_parts_whole() -> None:
    """A split version's modules go, whole, to the part with the fewest tests so far, the
    largest first: every part gets some, and none more than the largest module above an
    even share."""
    import conftest  # noqa: PLC0415 - the project's root conftest, as pytest loads it

    sizes = {"tests/k8s/test_a.py": 10, "tests/k8s/test_b.py": 7, "tests/k8s/test_c.py": 7,
             "tests/k8s/test_d.py": 5, "tests/k8s/test_e.py": 2, "tests/k8s/test_f.py": 1}
    items = [SimpleNamespace(nodeid=f"{module}::test_{i}", fixturenames=["kube_apiservers"])
             for module, count in sizes.items() for i in range(count)]
    items.append(SimpleNamespace(nodeid="tests/test_x.py::test_y", fixturenames=[]))
    part = conftest._parts(items)  # type: ignore[arg-type]
    assert set(part) == set(sizes)
    load = [sum(sizes[m] for m, p in part.items() if p == n)
            for n in range(conftest.PARTS["newest"])]
    assert all(load) and max(load) - min(load) <= max(sizes.values()), load
