"""What the container image would run, without a container engine: build the wheel, install it
with constraints.txt into a clean venv, then ``gpu-agent --version`` and ``gpu-agent serve
--simulate dgx-h100`` to ready. Needs the package index (the pinned dependencies)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import agent
from tests.waiting import wait_for

from .tools import ROOT

CONTAINERFILE = ROOT / "Containerfile"
CONSTRAINTS = ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    # The image installs the kubelet plugin's extra too (Containerfile).
    for text in project["dependencies"] + project["optional-dependencies"]["kubernetes"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} violates {req}"


def test_containerfile() -> None:
    text = CONTAINERFILE.read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f.startswith("registry.access.redhat.com/ubi9/") for f in froms)
    assert "python3.11" in text
    assert "--constraint /tmp/constraints.txt" in text
    assert 'ENTRYPOINT ["gpu-agent", "serve"]' in text
    for label in ("title", "version", "licenses", "source", "description"):
        assert f"org.opencontainers.image.{label}=" in text


@pytest.mark.packaging
def test_wheel_installs_with_constraints_and_serves(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir",
                    str(wheels), str(ROOT)], check=True, timeout=180, cwd=tmp_path)
    (wheel,) = wheels.glob("gpu_node_agent-*.whl")
    # The licence file pyproject names travels in the wheel (PEP 639: dist-info/licenses/).
    assert any(n.endswith(".dist-info/licenses/LICENSE")
               for n in zipfile.ZipFile(wheel).namelist())
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    # As the image installs it: with the kubelet plugin's extra.
    subprocess.run([*pip, "--constraint", str(CONSTRAINTS), f"{wheel}[kubernetes]"],
                   check=True, timeout=300)
    gpu_agent = env_dir / "bin" / "gpu-agent"
    version = subprocess.run([str(gpu_agent), "--version"], capture_output=True, text=True,
                             check=True, timeout=30)
    assert version.stdout.strip() == f"gpu-agent {agent.__version__}"
    # The generated stubs (plugin, PodResources client) load against the pinned grpcio and
    # protobuf.
    stubs = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "import agent.kubeplugin.process, agent.podresources.client"],
                           capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, check=False)
    assert stubs.returncode == 0, stubs.stderr
    # Only the pinned versions were installed.
    frozen = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "freeze"],
                            capture_output=True, text=True, check=True, timeout=60).stdout
    pins = _pins()
    for line in frozen.splitlines():
        name, _, installed = line.partition("==")
        if canonicalize_name(name) in pins:
            assert installed == pins[canonicalize_name(name)], line
    # What the image's ENTRYPOINT runs, on a simulated node, from outside the checkout.
    state = tmp_path / "state"
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(gpu_agent), "serve", "--simulate", "dgx-h100",
                                 "--state-dir", str(state), "--listen", "127.0.0.1:0",
                                 "--metrics-listen", "127.0.0.1:0"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            listeners = state / "listeners.json"
            if not listeners.exists():
                return False
            metrics = json.loads(listeners.read_text())["metrics"][0]
            try:
                with urllib.request.urlopen(f"{metrics}/readyz", timeout=5) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False
        try:
            wait_for(ready, "the installed agent to be ready", 30, every_s=0.1)
        except AssertionError as err:
            pytest.fail(f"{err}:\n{log.read_text()}")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0, log.read_text()
