"""``gpu-agent claims`` and ``gpu-agent cdi`` against a real agent process, and ``cdi generate``
offline on a simulated node."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from agent.cli.claims import parse_slice
from cdi.spec import Spec
from cdi.version import minimum_version
from tests.agent_process import AgentProcess, start_agent
from tests.integration.owner_steps import wait_transition
from tests.integration.test_cli import cli
from tests.waiting import wait_for

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "cdi-schema"


def _agent(h100: AgentProcess) -> list[str]:
    return ["--url", h100.url, "--token-file", str(h100.state_dir / "tokens")]


def _set_mig(agent: AgentProcess, gpu: int, body: dict[str, Any]) -> None:
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", body)
    assert reply.status in (200, 202), reply.body
    transition = reply.body["transition"]
    if transition is None:
        return
    done = wait_transition(agent, f"/v1/transitions/{transition['id']}")
    assert done["state"] == "succeeded", done


def _check_spec(doc: dict[str, Any]) -> None:
    """Upstream JSON schema, and the declared cdiVersion is the minimum the content needs."""
    registry: Registry[Any] = Registry().with_resource("defs.json", Resource.from_contents(
        json.loads((SCHEMA / "defs.json").read_text()), default_specification=DRAFT7))
    validator = jsonschema.Draft7Validator(json.loads((SCHEMA / "schema.json").read_text()),
                                           registry=registry)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors
    assert doc["cdiVersion"] == minimum_version(Spec.model_validate(doc))


def test_prepare_show_list_unprepare_a_full_gpu(h100: AgentProcess) -> None:
    opts = _agent(h100)
    out = cli("claims", "prepare", "cli-a", "--gpu", "6", "--namespace", "ml", "--pod", "train",
              "--container", "main", "--json", *opts)
    assert out.returncode == 0, out.stderr
    claim = json.loads(out.stdout)
    assert claim["metadata"] == {"namespace": "ml", "pod": "train", "container": "main"}
    [device] = claim["devices"]
    assert (device["kind"], device["device_name"]) == ("gpu", "gpu-6")
    assert device["cdi_devices"] == ["k8s.gpu.nodeagent.dev/claim=cli-a-gpu-6"]

    # The same prepare again (options before the verb this time) is the same answer.
    again = cli("claims", "--json", *opts, "prepare", "cli-a", "--gpu", "6", "--namespace", "ml",
                "--pod", "train", "--container", "main")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["created_at"] == claim["created_at"]

    listed = cli("claims", *opts).stdout.splitlines()
    assert listed[0].split() == ["UID", "STATE", "DEVICES", "SHARING", "SHARE", "MPS", "POD",
                                 "AGE", "NOTES"]
    row = next(line.split() for line in listed[1:] if line.startswith("cli-a "))
    assert row[:7] == ["cli-a", "prepare_completed", "gpu-6", "-", "-", "-", "ml/train"]

    shown = cli("claims", "cli-a", *opts)  # `claims UID` is `claims show UID`
    assert shown.returncode == 0, shown.stderr
    assert "namespace  ml" in shown.stdout and claim["cdi_spec"] in shown.stdout
    assert "k8s.gpu.nodeagent.dev/claim=cli-a-gpu-6" in shown.stdout
    assert json.loads(cli("claims", "show", "cli-a", "--json", *opts).stdout) == claim

    gone = cli("claims", "unprepare", "cli-a", *opts)
    assert (gone.returncode, gone.stdout) == (0, "claim cli-a unprepared\n")
    assert not Path(claim["cdi_spec"]).exists()
    assert cli("claims", "unprepare", "cli-a", *opts).returncode == 0  # idempotent
    late = cli("claims", "prepare", "cli-a", "--gpu", "6", *opts)  # a stale retry
    assert late.returncode == 1
    assert late.stderr.startswith("gpu-agent: 409") and "unprepared" in late.stderr
    missing = cli("claims", "cli-a", *opts)
    assert missing.returncode == 1 and "404" in missing.stderr


def test_a_held_device_is_refused_naming_the_holder(h100: AgentProcess) -> None:
    opts = _agent(h100)
    assert cli("claims", "prepare", "cli-holder", "--gpu", "5", *opts).returncode == 0
    try:
        refused = cli("claims", "prepare", "cli-other", "--gpu", "gpu-5", *opts)
        assert refused.returncode == 1
        assert refused.stderr.count("\n") == 1
        assert "409" in refused.stderr and "held by claim cli-holder" in refused.stderr
    finally:
        assert cli("claims", "unprepare", "cli-holder", *opts).returncode == 0


def test_slices_on_demand_by_profile_and_by_device_name(h100: AgentProcess) -> None:
    opts = _agent(h100)
    _set_mig(h100, 7, {"mig_enabled": True})
    try:
        out = cli("claims", "prepare", "cli-slices", "--slice", "1g.10gb@7:2",
                  "--slice", "gpu-7-mig-3g40gb-9-4", "--json", *opts)
        assert out.returncode == 0, out.stderr
        claim = json.loads(out.stdout)
        assert [d["device_name"] for d in claim["devices"]] == [
            "gpu-7-mig-1g10gb-19-2", "gpu-7-mig-3g40gb-9-4"]
        gpu7 = h100.request("GET", "/v1/gpus/7").body["uuid"]
        assert all(d["on_demand"] and d["parent_uuid"] == gpu7 and d["uuid"].startswith("MIG-")
                   for d in claim["devices"])
        specs = cli("cdi", "list", *opts)
        assert specs.returncode == 0, specs.stderr
        assert "k8s.gpu.nodeagent.dev-claim_cli-slices.json" in specs.stdout
        assert json.loads(cli("cdi", "list", "--json", *opts).stdout)["specs"]
    finally:
        assert cli("claims", "unprepare", "cli-slices", *opts).returncode == 0
    assert h100.request("GET", "/v1/gpus/7/mig").body["instances"] == []  # destroyed
    _set_mig(h100, 7, {"mig_enabled": False})


def test_a_malformed_slice_is_one_line_before_any_request(tmp_path: Path) -> None:
    nowhere = ["--url", f"unix:{tmp_path / 'nothing.sock'}"]
    for bad in ("1g.10gb:x", "1g.10gb@", "@3"):
        out = cli("claims", "prepare", "u", "--slice", bad, *nowhere)
        assert out.returncode == 2 and out.stderr.count("\n") == 1
        assert "PROFILE[@GPU][:START]" in out.stderr, out.stderr
    empty = cli("claims", "prepare", "u", *nowhere)
    assert empty.returncode == 2 and "--gpu" in empty.stderr


def _generate(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = cli("cdi", "generate", "--simulate", "dgx-h100", "--state-dir",
              str(tmp_path / "state"), *extra)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_cdi_generate_prints_the_node_wide_spec(tmp_path: Path) -> None:
    doc = _generate(tmp_path)
    _check_spec(doc)
    assert doc["kind"] == "nodeagent.dev/gpu"
    names = [d["name"] for d in doc["devices"]]
    uuids = [n for n in names if n.startswith("GPU-")]
    assert [n for n in names if n.isdigit()] == [str(i) for i in range(8)]
    assert len(set(uuids)) == 8 and names[-1] == "all" and len(names) == 17
    by_name = {d["name"]: d["containerEdits"] for d in doc["devices"]}
    assert by_name["3"]["deviceNodes"][0]["path"] == "/dev/nvidia3"
    assert by_name["3"] == by_name[names[names.index("3") + 1]]  # index and UUID alike
    assert "NVIDIA_VISIBLE_DEVICES=void" in doc["containerEdits"]["env"]

    written = cli("cdi", "generate", "--simulate", "dgx-h100", "--state-dir",
                  str(tmp_path / "state"), "--output", str(tmp_path / "cdi"))
    assert written.returncode == 0, written.stderr
    assert "cdiVersion" in written.stdout
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == ["nodeagent.dev-gpu.json"]
    assert json.loads((tmp_path / "cdi" / "nodeagent.dev-gpu.json").read_text()) == doc


def test_cdi_generate_names_mig_devices_as_the_agent_does(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state")
    try:
        _set_mig(agent, 2, {"profiles": ["3g.40gb", "1g.10gb"]})
        mig = agent.request("GET", "/v1/gpus/2").body["mig_devices"]
        node_spec = agent.state_dir / "cdi" / "nodeagent.dev-gpu.json"
        # The agent rewrites its node spec soon after.
        wait_for(lambda: "2:1" in node_spec.read_text(), "the node spec to name 2:1")
        from_agent = json.loads(node_spec.read_text())
    finally:
        agent.stop(signal.SIGTERM)
    doc = _generate(tmp_path)
    _check_spec(doc)
    names = [d["name"] for d in doc["devices"]]
    assert "2" not in names and {"2:0", "2:1"} <= set(names)
    assert {d["uuid"] for d in mig} <= set(names)
    assert doc == from_agent  # offline, the same spec the running agent keeps


def test_cdi_generate_refuses_a_state_dir_a_running_agent_holds(h100: AgentProcess) -> None:
    out = cli("cdi", "generate", "--simulate", "dgx-h100", "--state-dir", str(h100.state_dir))
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "holds" in out.stderr and str(h100.state_dir) in out.stderr


@pytest.mark.parametrize("text, body", [
    ("1g.10gb", {"kind": "slice", "profile": "1g.10gb"}),
    ("3g.40gb@2", {"kind": "slice", "profile": "3g.40gb", "gpu": "2"}),
    ("1g.10gb@GPU-1a2b:5", {"kind": "slice", "profile": "1g.10gb", "gpu": "GPU-1a2b",
                            "placement": {"start": 5}}),
    ("2g.20gb:4", {"kind": "slice", "profile": "2g.20gb", "placement": {"start": 4}}),
    ("gpu-1-mig-1g10gb-19-0", {"kind": "slice", "device": "gpu-1-mig-1g10gb-19-0"}),
])
def test_slice_arguments(text: str, body: dict[str, Any]) -> None:
    assert parse_slice(text) == body
