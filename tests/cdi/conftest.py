"""The reference CDI library (Go, ``tags.cncf.io/container-device-interface`` as
tests/cdi/checker/go.mod pins it) and the upstream JSON schema, as judges of the specs the
agent writes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests import gobuild

DATA = Path(__file__).resolve().parents[1] / "data" / "cdi-schema"
CHECKER_SOURCE = Path(__file__).resolve().parent / "checker"

Checker = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def cdi_checker() -> Checker:
    """``check(spec_dir, *devices)`` → the checker's report; builds the Go program once."""
    binary = gobuild.build(CHECKER_SOURCE, gobuild.BUILD / "cdi-check" / "cdi-check",
                           timeout_s=600)

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
