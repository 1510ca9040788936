"""Go test programs built with the machine's Go toolchain from modules pinned in the repo
(go.mod and go.sum beside the source), through the Go module proxy and the default module and
build caches, so a second build is seconds. Debian's ``golang-go`` (1.19) is too old for the
pinned modules and may shadow the newer Go on PATH, so the newest Go found wins and one below
the module's ``go`` line counts as missing: a skip on a developer machine, a failure in CI."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.tools import unavailable

#: Where the Go toolchain is installed on the project's machines, besides PATH.
KNOWN_GO = (Path("/usr/local/go/bin/go"),)
#: Where the programs are built (ignored by git): one path per program, so a build whose
#: binary is current costs Go's up-to-date check (a second), not a link (several CPU seconds,
#: in every pytest worker).
BUILD = Path(__file__).resolve().parent.parent / "build"


def _version(go: str) -> tuple[int, ...] | None:
    try:
        done = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True,
                              timeout=30, check=False, env={**os.environ, "GOTOOLCHAIN": "local"})
    except OSError:
        return None
    match = re.fullmatch(r"go(\d+)\.(\d+)(?:\.(\d+))?\S*", done.stdout.strip())
    return tuple(int(p) for p in match.groups() if p is not None) if match else None


def _required(module: Path) -> tuple[int, ...]:
    match = re.search(r"^go (\d+)\.(\d+)(?:\.(\d+))?\s*$", (module / "go.mod").read_text(), re.M)
    assert match, f"{module}/go.mod has no go line"
    return tuple(int(p) for p in match.groups() if p is not None)


def find_go(module: Path) -> str:
    """The newest Go toolchain found ($GO, PATH, /usr/local/go), if it is new enough for
    ``module``'s go.mod; otherwise the test is unavailable (it fails under CI=true)."""
    candidates = [os.environ.get("GO"), shutil.which("go"), *map(str, KNOWN_GO)]
    found = {c: v for c in dict.fromkeys(c for c in candidates if c) if (v := _version(c))}
    needed = _required(module)
    if not found:
        unavailable("the Go toolchain is not installed (https://go.dev/dl, into /usr/local/go)")
    go, version = max(found.items(), key=lambda item: item[1])
    if version < needed:
        unavailable(f"{go} is Go {'.'.join(map(str, version))}; {module.name} needs Go "
                    f"{'.'.join(map(str, needed))} or newer (Debian's golang-go is too old)")
    return go


def build(module: Path, output: Path, timeout_s: float) -> Path:
    """``go build`` the main package in ``module`` to ``output``, with the dependencies exactly
    as go.sum pins them (-mod=readonly) and no automatic toolchain download. A file lock
    beside ``output`` keeps parallel pytest workers from building it at once. A binary built
    from the same sources by the same Go is not built again: Go's own up-to-date check costs
    one to four CPU seconds, in every worker."""
    go = find_go(module)
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly", "GO111MODULE": "on"}
    output.parent.mkdir(parents=True, exist_ok=True)
    inputs = output.with_name(f".{output.name}.inputs")
    with output.with_name(f".{output.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = _inputs(go, module)
        if output.is_file() and inputs.is_file() and inputs.read_text() == key:
            return output
        inputs.unlink(missing_ok=True)
        done = subprocess.run([go, "build", "-o", str(output), "."], cwd=module, env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        assert done.returncode == 0, f"go build in {module} failed:\n{done.stderr}"
        inputs.write_text(key)
    return output


def _inputs(go: str, module: Path) -> str:
    """What a build of ``module`` depends on: the toolchain (its path and version) and every
    file of the module (go.mod and go.sum pin the rest)."""
    digest = hashlib.sha256(f"{go}\0{_version(go)}\0".encode())
    for path in sorted(p for p in module.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(module)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
