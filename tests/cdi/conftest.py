"""The reference CDI library (Go, Debian's package) and the upstream JSON schema, as judges of
the specs the agent writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests.tools import unavailable

DATA = Path(__file__).resolve().parents[1] / "data" / "cdi-schema"
CHECKER_SOURCE = Path(__file__).resolve().parent / "checker"
GOPATH = Path("/usr/share/gocode")
CDI_LIBRARY = GOPATH / "src/github.com/container-orchestrated-devices/container-device-interface"

Checker = Callable[..., dict[str, Any]]


def _missing(what: str) -> None:
    unavailable(f"{what} is not installed (apt-get install golang-go "
                "golang-github-container-orchestrated-devices-container-device-interface-dev)")


@pytest.fixture(scope="session")
def cdi_checker(tmp_path_factory: pytest.TempPathFactory) -> Checker:
    """``check(spec_dir, *devices)`` → the checker's report; builds the Go program once."""
    go = shutil.which("go")
    if go is None:
        _missing("the Go toolchain")
    if not CDI_LIBRARY.is_dir():
        _missing("the reference CDI library")
    binary = tmp_path_factory.mktemp("checker") / "cdi-check"
    env = {**os.environ, "GOPATH": str(GOPATH), "GO111MODULE": "off",
           "GOCACHE": str(tmp_path_factory.mktemp("gocache"))}
    build = subprocess.run([str(go), "build", "-o", str(binary), "."], cwd=CHECKER_SOURCE,
                           env=env, capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr

    def check(spec_dir: Path, *devices: str) -> dict[str, Any]:
        result = subprocess.run([str(binary), str(spec_dir), *devices], capture_output=True,
                                text=True, timeout=60, check=False)
        report: dict[str, Any] = json.loads(result.stdout)
        report["exit"] = result.returncode
        return report

    return check


@pytest.fixture(scope="session")
def cdi_schema() -> Callable[[dict[str, Any]], None]:
    """Validate a spec document against the upstream JSON schema (schema.json + defs.json)."""
    schema = json.loads((DATA / "schema.json").read_text())
    defs = json.loads((DATA / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    validator = jsonschema.Draft7Validator(schema, registry=registry)

    def validate(doc: dict[str, Any]) -> None:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]

    return validate
