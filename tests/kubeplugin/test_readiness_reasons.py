"""docs/kubernetes.md explains every reason the plugin's ``/readyz`` can give: each phrase of
agent/kubeplugin/reasons.py is in its section "Reading the plugin's /readyz", under the
check it appears in, so a reason added to the code without its explanation fails here. The
two sections the plugin owns close the document."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agent.kubeplugin import reasons
from agent.kubeplugin.credentials import NodeBinding

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kubernetes.md"
READYZ = "Reading the plugin's /readyz"
RENEWING = "Renewing a Node-bound credential"
#: The modules whose readiness answers are built from reasons.py.
PRODUCERS = ("agent_client.py", "claim_status.py", "credentials.py", "domain_slots.py",
             "health.py", "publisher.py", "servers.py")


def sections() -> dict[str, str]:
    """The document's ``## `` sections by title, in order."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def flowing(text: str) -> str:
    """``text`` with line breaks as spaces (a phrase may wrap)."""
    return " ".join(text.split())


def test_the_plugins_two_sections_close_the_document() -> None:
    assert list(sections())[-2:] == [READYZ, RENEWING]


@pytest.mark.parametrize("reason", reasons.ALL, ids=lambda r: f"{r.where}:{r.text}")
def test_every_readiness_reason_is_explained(reason: reasons.Reason) -> None:
    """Each phrase appears as code in the /readyz section, after the heading of its check."""
    text = flowing(sections()[READYZ])
    where = reason.where.removeprefix("checks.").removeprefix("warnings.")
    heading = "**Any check**" if where == "*" else \
        f"`{reason.where}`" if reason.where.startswith("warnings.") else f"**`{reason.where}`**"
    assert heading in text, f"no paragraph for {reason.where}"
    assert f"`{reason.text}`" in text[text.index(heading):], \
        f"{reason.text!r} ({reason.where}) is not explained in {READYZ!r}"


def test_every_reason_the_code_builds_comes_from_the_catalogue() -> None:
    """No readiness text is spelled out where the answers are built: the producing modules
    name no phrase of reasons.py as a literal of their own (they use the constants)."""
    phrases = {r.text for r in reasons.ALL}
    found = []
    for name in PRODUCERS:
        tree = ast.parse((ROOT / "agent" / "kubeplugin" / name).read_text())
        # A log line's message may say the same words: it is not a readiness answer.
        messages = {id(call.args[0]) for call in ast.walk(tree)
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("debug", "info", "warning", "error", "exception")
                    and call.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    id(node) not in messages and any(node.value.startswith(p) for p in phrases):
                found.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
    assert not found, f"readiness phrases spelled out instead of reasons.*: {found}"


def test_classify_tells_every_reason_by_its_check() -> None:
    for reason in reasons.ALL:
        where = "checks.agent" if reason.where == "checks.*" else reason.where
        assert reasons.classify(where, reason.says("details")) is reason
    assert reasons.classify("checks.agent", "API server unreachable: x") is None


def test_the_renewal_section_gives_the_command_the_reason_names() -> None:
    """The command in "Renewing a Node-bound credential" is the one the plugin's reason
    gives, for the install's namespace and ServiceAccount."""
    text = flowing(sections()[RENEWING].replace("\\\n", " "))
    command = NodeBinding(node='"$NODE"', uid="", namespace="gpu-node-agent",
                          service_account="gpu-node-agent").renew_command()
    words = command.split()
    assert all(word in text for word in words), (command, text)
    assert reasons.NODE_CREDENTIAL_DEAD.text in text
