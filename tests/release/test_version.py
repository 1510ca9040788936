"""One version for a release: the package (``agent.__version__``, the single source), the
newest section of CHANGELOG.md, the Helm chart's ``version`` and ``appVersion``, the
kustomize base's image tag and the Containerfile's default, all equal; and a user can read
it from the CLI, the API and the metrics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

import agent

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpu-node-agent" / "Chart.yaml"
KUSTOMIZATION = ROOT / "daemonset" / "base" / "kustomization.yaml"
IMAGE = "ghcr.io/gpu-node-agent/gpu-node-agent"
#: A release heading of Keep a Changelog: ``## [1.2.3] - 2026-12-03``.
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def _newest_release() -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = RELEASE.findall(text)
    assert releases, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' section"
    versions = [tuple(int(p) for p in v.split(".")) for v, _ in releases]
    assert versions == sorted(versions, reverse=True), "CHANGELOG.md: newest release first"
    # "Unreleased" sits above the releases and is the only other section.
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[0] == "[Unreleased]" and len(heads) == len(releases) + 1, heads
    return str(releases[0][0])


def test_changelog_newest_release_is_the_package_version() -> None:
    assert _newest_release() == agent.__version__


def test_chart_version_and_app_version_are_the_package_version() -> None:
    chart = yaml.safe_load(CHART.read_text())
    assert (chart["version"], str(chart["appVersion"])) == (agent.__version__,) * 2


def test_kustomize_image_tag_is_the_package_version() -> None:
    images = yaml.safe_load(KUSTOMIZATION.read_text())["images"]
    (image,) = [i for i in images if i["name"] == "gpu-node-agent"]
    assert (image["newName"], str(image["newTag"])) == (IMAGE, agent.__version__)


def test_containerfile_default_version_is_the_package_version() -> None:
    text = (ROOT / "Containerfile").read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", text, re.M) == [agent.__version__]
    # The wheel's build stage has the licence file the metadata names.
    assert re.search(r"^COPY .*\bLICENSE\b.* \./$", text, re.M)


def test_license_is_the_apache_license_the_metadata_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert text.rstrip().endswith("limitations under the License.")
    # The unmodified text: nine sections of terms, then the appendix.
    for n in range(1, 10):
        assert f"\n   {n}. " in text, n
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject
    assert 'license-files = ["LICENSE"]' in pyproject


def test_cli_prints_the_version() -> None:
    out = subprocess.run([sys.executable, "-m", "agent", "--version"], capture_output=True,
                         text=True, check=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == f"gpu-agent {agent.__version__}"
