"""Host facts and process tuning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.host import boot_id


def test_boot_id_prefers_the_given_proc_root(tmp_path: Path) -> None:
    (tmp_path / "sys/kernel/random").mkdir(parents=True)
    (tmp_path / "sys/kernel/random/boot_id").write_text("abc\n")
    assert boot_id(tmp_path) == "abc"
    assert boot_id(tmp_path / "missing") == Path("/proc/sys/kernel/random/boot_id").read_text(
    ).strip()


def test_malloc_arenas_are_capped_unless_the_environment_says_otherwise() -> None:
    code = "from agent.host import limit_malloc_arenas as f; print(f())"
    capped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PATH": "/usr/bin:/bin"})
    assert capped.stdout.strip() == "True"  # glibc, as on every supported node
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "4"})
    assert left.stdout.strip() == "False"
