"""External tools the metrics tests use (Debian's ``prometheus`` package: promtool and the
server). In CI (``CI=true``) a missing tool fails the test; elsewhere it skips, saying why."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (Debian/Ubuntu: apt-get install prometheus)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)
