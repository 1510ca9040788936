"""Paths the deployment tests share; the tool checks live in :mod:`tests.tools`."""

from __future__ import annotations

from pathlib import Path

from tests.tools import require_module, require_tool

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "require_module", "require_tool"]
