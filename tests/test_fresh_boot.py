"""On a machine booted seconds ago (a fresh CI VM) the tests that stamp requests on
CLOCK_BOOTTIME pass as they do anywhere: they are run again in a time namespace whose boot
clock reads under a minute (``unshare --time``, util-linux, as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tools import unavailable

ROOT = Path(__file__).resolve().parent.parent
#: The files whose tests send or compare ordering stamps (tests/stamps.py).
STAMPING = ("tests/api/test_claims_api.py", "tests/claims/test_ordering.py",
            "tests/claims/test_stamps_restart.py")
#: The boot clock inside the namespace when it starts: well under a minute.
UPTIME_S = 5


def _fresh_boot(unshare: str) -> list[str]:
    """The command prefix that runs a program with CLOCK_BOOTTIME near ``UPTIME_S``."""
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    offset = max(0, int(uptime) - UPTIME_S)
    return [unshare, "--time", f"--boottime={-offset}"]


def _own_run() -> dict[str, str]:
    """This environment less what marks it as a pytest run or an xdist worker: the inner run
    is a session of its own."""
    return {k: v for k, v in os.environ.items()
            if k != "PYTEST_CURRENT_TEST" and not k.startswith("PYTEST_XDIST")}


@pytest.mark.slow
def test_the_stamping_tests_pass_on_a_machine_booted_seconds_ago() -> None:
    """Every test in :data:`STAMPING` passes where the machine has been up for seconds."""
    unshare = shutil.which("unshare")
    if unshare is None:
        unavailable("unshare is not installed (util-linux)")
    prefix = _fresh_boot(unshare)
    probe = subprocess.run(
        [*prefix, sys.executable, "-c",
         "import time; print(time.clock_gettime(time.CLOCK_BOOTTIME))"],
        capture_output=True, text=True, check=False, timeout=60)
    if probe.returncode != 0:
        unavailable(f"no time namespace here (unshare --time needs root and Linux 5.6+): "
                    f"{probe.stderr.strip()}")
    assert float(probe.stdout) < 60, f"the namespace's boot clock reads {probe.stdout}"
    run = subprocess.run(
        [*prefix, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *STAMPING],
        cwd=ROOT, env=_own_run(), capture_output=True, text=True, check=False, timeout=900)
    assert run.returncode == 0, \
        f"the stamping tests fail on a freshly booted machine:\n{run.stdout[-6000:]}" \
        f"\n{run.stderr[-2000:]}"
