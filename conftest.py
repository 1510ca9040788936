"""The two tiers, for tests/ and bench/tests/ alike (tests/processes.py): every test that
starts a process is marked ``process`` at collection, and every other test is refused any
process start at run time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from tests.processes import Classifier, forbid_processes

PROCESS = "process"
#: tests/test_processes.py runs this conftest on a small project of its own.
pytest_plugins = ("pytester",)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{PROCESS}: starts processes (a real agent, a Go build, kube-apiserver); "
        "applied at collection by tests/processes.py, never by hand")


#: Session fixtures worth a few per run, not a few per worker (an API server is about ten CPU
#: seconds): tests using them go to one pytest-xdist worker (``--dist loadgroup``) per
#: Kubernetes version the test names (its ``version`` parameter; the newest without one),
#: which starts that version's API servers once. One worker for all of them ran them one
#: after the other for longer than the rest of the suite.
SHARED_SERVERS = {"kube_apiservers": "kube-apiserver"}
#: Versions whose tests are split, whole modules each, over this many workers (each part
#: starts its own servers): one worker ran the newest version's 80 tests for 13 of the
#: suite's 17 minutes on two loaded cores.
PARTS = {"newest": 3}


# First, so the groups are marked before pytest-xdist reads them into the test IDs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    classifier = Classifier()
    for item in items:
        if _starts_processes(classifier, item):
            item.add_marker(PROCESS)
    part = _parts(items)
    for item in items:
        for fixture, group in SHARED_SERVERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                version = _version(item)
                name = f"{group}-{version}"
                if version in PARTS:
                    name += f"-{part[_module(item)]}"
                item.add_marker(pytest.mark.xdist_group(name))
    # Longest first, so no worker starts a long test at the end while the others are idle:
    # the shared API servers' tests (one worker a version), the slow ones, the others
    # that start processes, then the short in-process tests, which fill the workers up.
    items.sort(key=_run_order)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _parts(items: list[pytest.Item]) -> dict[str, int]:
    """Each module with shared-server tests of a split version, to a part: the modules with
    the most such tests first, each to the part with the fewest so far (the same on every
    worker: it depends on the collection alone)."""
    counts: dict[str, Counter[str]] = {version: Counter() for version in PARTS}
    for item in items:
        version = _version(item)
        if version in PARTS and any(f in getattr(item, "fixturenames", ())
                                    for f in SHARED_SERVERS):
            counts[version][_module(item)] += 1
    part: dict[str, int] = {}
    for version, modules in counts.items():
        load = [0] * PARTS[version]
        for module, count in sorted(modules.items(), key=lambda m: (-m[1], m[0])):
            lightest = load.index(min(load))
            part[module] = lightest
            load[lightest] += count
    return part


def _version(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    version = callspec.params.get("version") if callspec is not None else None
    return str(version) if version is not None else "newest"


def _run_order(item: pytest.Item) -> int:
    if item.get_closest_marker("xdist_group") is not None:
        return 0
    if item.get_closest_marker("slow") or item.get_closest_marker("packaging"):
        return 1
    return 2 if item.get_closest_marker(PROCESS) is not None else 3


def _starts_processes(classifier: Classifier, item: pytest.Item) -> bool:
    if not isinstance(item, pytest.Function):
        return True  # not a Python test: assume the worst
    if classifier.spawns(item.obj, test=True):
        return True
    # A parameter may be the code that runs (a callable passed by parametrize).
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(callable(value) and classifier.spawns(value)
                                    for value in callspec.params.values()):
        return True
    # pytest's own record of the fixtures the test uses (transitively), and their functions.
    definitions = item._fixtureinfo.name2fixturedefs
    return any(classifier.spawns(fixture.func) for name in item.fixturenames
               for fixture in definitions.get(name, ()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


def _guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker(PROCESS) is not None:
        return (yield)
    with forbid_processes(item.nodeid):
        return (yield)
