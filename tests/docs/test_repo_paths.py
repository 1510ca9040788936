"""Every repository path the README and docs/*.md name in backticks exists: a renamed test or
module leaves no pointer to nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The tree's top-level folders a backticked path may start with; other backticked text
#: (``/etc/gpu-agent/tokens``, ``memory: 10Gi``) is not a path in the repository.
TOP = tuple(f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
#: A backticked path, up to a space or ``::`` (a test's node id names its file first).
PATH = re.compile(r"`([A-Za-z0-9_./-]+?)(?:::[^`]*)?`")
#: A path to a file of a known kind anywhere in the text, backticked or not (an HTML comment
#: naming the test that generates a table).
FILE = re.compile(r"(?<![\w/.-])([A-Za-z0-9_-]+/[A-Za-z0-9_./-]*"
                  r"\.(?:py|md|yaml|json|toml|service))\b")


def _named_paths(doc: Path) -> list[str]:
    """The repository paths ``doc`` names in backticks, without globs or placeholders."""
    text = doc.read_text()
    found = {m for m in PATH.findall(text) + FILE.findall(text) if m.startswith(TOP)}
    return sorted(p.rstrip("/") for p in found if not re.search(r"[*<>{}]|\.\.\.", p))


def test_the_docs_name_repository_paths() -> None:
    """The finder finds the paths the README is known to name (an empty finder would pass
    every doc)."""
    assert "systemd/gpu-agent.service" in _named_paths(ROOT / "docs" / "deploy.md")
    assert len([p for doc in DOCS for p in _named_paths(doc)]) >= 20


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    """Each backticked path in ``doc`` is a file or folder of the repository."""
    missing = [p for p in _named_paths(doc) if not (ROOT / p).exists()]
    assert missing == [], f"{doc.name} names paths that do not exist"
