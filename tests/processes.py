"""Which tests start processes (a real agent, a Go build, kube-apiserver, a CLI run): the
``process`` tier. ``make check`` runs everything else; ``make test`` runs both.

A test is in the tier when its code, its fixtures' code or any test-side code they reach by
name (functions, classes and modules under ``tests/`` and ``bench/``, followed transitively)
names a process-starting API (the ``subprocess`` module, ``asyncio.create_subprocess_*``,
``os.fork``...) or something marked with :func:`starts_processes`. Nothing is listed by
hand. Product code that starts processes itself (the sharing tools, an MPS launcher) is not
followed: a fixture that hands a test such code is marked with :func:`starts_processes`.

The classification is checked at run time: a test outside the tier that starts a process
fails with a message saying so (:func:`forbid_processes`), so it can never silently drift.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

MARK = "__starts_processes__"
#: Attribute and global names that start a process wherever they are called from; the
#: simulator's ``tools_dir`` holds its nvidia-smi and nvidia-cuda-mps-control, which are run
#: as processes, as on a real node.
SPAWNING_NAMES = frozenset({
    "create_subprocess_exec", "create_subprocess_shell", "Popen", "fork", "forkpty",
    "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl", "execv", "execve",
    "Process", "ProcessPoolExecutor", "system", "tools_dir",
})
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "pty"})
#: Code of these packages is followed by name; everything else is a leaf.
FOLLOWED = ("tests", "bench")


def starts_processes(obj: F) -> F:
    """Mark a fixture or helper whose use starts processes through code this module does not
    follow (product code that spawns tools)."""
    setattr(obj, MARK, True)
    return obj


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _followed(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] in FOLLOWED


class Classifier:
    """Memoised reachability of process-starting names from test-side objects."""

    def __init__(self) -> None:
        self._known: dict[int, bool] = {}

    def spawns(self, obj: Any, *, test: bool = False) -> bool:
        """Whether calling or using ``obj`` (a function, class, module) may start a process;
        a ``test`` function's own code is read wherever its module lives."""
        key = id(obj)
        if key in self._known:
            return self._known[key]
        self._known[key] = False  # a cycle adds nothing
        found = self._spawns(obj, test=test)
        self._known[key] = found
        return found

    def _spawns(self, obj: Any, *, test: bool) -> bool:
        if getattr(obj, MARK, False):
            return True
        if isinstance(obj, types.ModuleType):
            return obj.__name__.split(".")[0] in SPAWNING_MODULES
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and module.split(".")[0] in SPAWNING_MODULES:
            return True
        if not test and not _followed(obj):
            return False
        obj = inspect.unwrap(obj) if callable(obj) else obj
        if isinstance(obj, type):
            return any(self.spawns(member) for klass in obj.__mro__ if _followed(klass)
                       for member in vars(klass).values()
                       if inspect.isfunction(member) or isinstance(member, (
                           staticmethod, classmethod, property)))
        if isinstance(obj, (staticmethod, classmethod)):
            return self.spawns(obj.__func__)
        if isinstance(obj, property):
            return any(self.spawns(f) for f in (obj.fget, obj.fset) if f is not None)
        function = getattr(obj, "__func__", obj)
        code = getattr(function, "__code__", None)
        if code is None:
            return False
        namespace: dict[str, Any] = getattr(function, "__globals__", {})
        names = {name for c in _codes(code) for name in c.co_names}
        # ``import subprocess`` inside a function names the module in co_names too.
        if names & SPAWNING_NAMES or names & SPAWNING_MODULES:
            return True
        for name in names:
            value = namespace.get(name)
            if value is None:
                continue
            if self.spawns(value):
                return True
            # ``gobuild.build(...)``: the members of a followed module that the code names.
            if isinstance(value, types.ModuleType) and _followed(value) and any(
                    self.spawns(member) for attr in names
                    if not isinstance(member := getattr(value, attr, None), types.ModuleType)
                    and member is not None):
                return True
        return False


class ProcessStarted(AssertionError):
    """A test outside the ``process`` tier started a process."""


@contextmanager
def forbid_processes(test: str) -> Iterator[None]:
    """Fail any process start inside the block, naming the test and what it ran."""
    original_init = subprocess.Popen.__init__
    original_fork = os.fork

    def refuse(what: str) -> ProcessStarted:
        return ProcessStarted(
            f"{test} started a process ({what}) but is not in the 'process' tier: start it "
            "through a fixture or helper under tests/ that names the process API, or mark "
            "the fixture that hands it product code that spawns with "
            "tests.processes.starts_processes")

    def guarded_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        self._child_created = False  # what Popen.__del__ reads of a Popen that never started
        raise refuse(f"Popen {args!r}"[:200])

    def guarded_fork() -> int:
        raise refuse("os.fork")

    subprocess.Popen.__init__ = guarded_init  # type: ignore[method-assign]
    os.fork = guarded_fork
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original_init  # type: ignore[method-assign]
        os.fork = original_fork
