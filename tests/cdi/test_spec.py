"""CDI specs: the minimum version table, names, deterministic bytes, the store, and the
NVIDIA edits, judged by the upstream schema and the reference library."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cdi.build import CLAIM_KIND, NODE_KIND, NamedEdits, build_spec, claim_device
from cdi.names import CdiNameError, qualified, split_kind, transient_file_name
from cdi.nvidia import (
    HostDevices,
    HostFactsError,
    common_edits,
    gpu_edits,
    mig_edits,
    parse_mig_minors,
    parse_proc_devices,
)
from cdi.spec import (
    ContainerEdits,
    Device,
    DeviceNode,
    IntelRdt,
    Mount,
    NetDevice,
    Spec,
)
from cdi.store import SpecStore
from cdi.version import minimum_version
from tests.cdi.conftest import Checker

NODE = DeviceNode(path="/dev/x", type="c", major=1, minor=2)
PROC_DEVICES = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n510 nvidia-uvm\n" \
               "511 nvidia-caps\n\nBlock devices:\n  8 sd\n"
MIG_MINORS = "config 1\nmonitor 2\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n"
HOST = HostDevices(parse_proc_devices(PROC_DEVICES), parse_mig_minors(MIG_MINORS))


def _spec(*, kind: str = "example.com/gpu", name: str = "dev", spec_edits: ContainerEdits |
          None = None, device_edits: ContainerEdits | None = None,
          annotations: dict[str, str] | None = None,
          device_annotations: dict[str, str] | None = None) -> Spec:
    return Spec(cdi_version="1.1.0", kind=kind, annotations=annotations,
                container_edits=spec_edits,
                devices=(Device(name=name, annotations=device_annotations,
                                container_edits=device_edits or ContainerEdits(
                                    device_nodes=(NODE,))),))


@pytest.mark.parametrize(("spec", "version"), [
    (_spec(), "0.3.0"),
    (_spec(spec_edits=ContainerEdits(mounts=(Mount(host_path="/a", container_path="/a",
                                                    type="bind"),))), "0.4.0"),
    (_spec(spec_edits=ContainerEdits(mounts=(Mount(host_path="/a", container_path="/a"),))),
     "0.3.0"),
    (_spec(device_edits=ContainerEdits(device_nodes=(DeviceNode(path="/dev/x",
                                                                host_path="/dev/y"),))),
     "0.5.0"),
    (_spec(name="0"), "0.5.0"),
    (_spec(name="0:1"), "0.5.0"),
    (_spec(annotations={"a": "b"}), "0.6.0"),
    (_spec(device_annotations={"a": "b"}), "0.6.0"),
    (_spec(kind="example.com/gpu.mig"), "0.6.0"),
    (_spec(spec_edits=ContainerEdits(intel_rdt=IntelRdt(clos_id="c"))), "0.7.0"),
    (_spec(device_edits=ContainerEdits(additional_gids=(44,))), "0.7.0"),
    (_spec(spec_edits=ContainerEdits(net_devices=(NetDevice(host_interface_name="eth0",
                                                            name="net0"),))), "1.1.0"),
    (_spec(spec_edits=ContainerEdits(intel_rdt=IntelRdt(schemata=("L3:0=f",)))), "1.1.0"),
    (_spec(spec_edits=ContainerEdits(intel_rdt=IntelRdt(enable_monitoring=True))), "1.1.0"),
])
def test_minimum_version_follows_the_reference_table(spec: Spec, version: str) -> None:
    assert minimum_version(spec) == version


@pytest.mark.parametrize(("ok", "kind", "device"), [
    (True, "nodeagent.dev/gpu", "0"),
    (True, "nodeagent.dev/gpu", "0:1"),
    (True, "k8s.gpu.nodeagent.dev/claim", "abc-gpu-0"),
    (True, "nodeagent.dev/gpu", "GPU-5faa4600-783d-5573-8004-af1f035d0bb9"),
    (False, "nodeagent.dev", "0"),
    (False, "1vendor.com/gpu", "0"),
    (False, "vendor.com/gpu-", "0"),
    (False, "nodeagent.dev/gpu", "-0"),
    (False, "nodeagent.dev/gpu", "a/b"),
    (False, "nodeagent.dev/gpu", "0:"),
])
def test_names(ok: bool, kind: str, device: str) -> None:
    if ok:
        assert qualified(kind, device) == f"{kind}={device}"
    else:
        with pytest.raises(CdiNameError):
            qualified(kind, device)


def test_file_names() -> None:
    assert transient_file_name(CLAIM_KIND, "uid-1") == "k8s.gpu.nodeagent.dev-claim_uid-1.json"
    assert split_kind(NODE_KIND) == ("nodeagent.dev", "gpu")
    with pytest.raises(CdiNameError):
        transient_file_name(CLAIM_KIND, "../escape")


def test_nvidia_edits_carry_type_major_minor_and_the_mig_caps() -> None:
    assert gpu_edits(3).device_nodes == (DeviceNode(path="/dev/nvidia3", type="c", major=195,
                                                    minor=3),)
    nodes = mig_edits(HOST, 0, 2, 0).device_nodes or ()
    assert [(n.path, n.major, n.minor) for n in nodes] == [
        ("/dev/nvidia0", 195, 0), ("/dev/nvidia-caps/nvidia-cap21", 511, 21),
        ("/dev/nvidia-caps/nvidia-cap22", 511, 22)]
    common = common_edits(HOST)
    assert common.env == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert [(n.path, n.major, n.minor) for n in common.device_nodes or ()] == [
        ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 510, 0),
        ("/dev/nvidia-uvm-tools", 510, 1)]
    with pytest.raises(HostFactsError, match="gi5"):
        mig_edits(HOST, 0, 5, 0)
    with pytest.raises(HostFactsError, match="driver loaded"):
        common_edits(HostDevices({}, {}))


def _node_spec() -> Spec:
    return build_spec(NODE_KIND, [NamedEdits(("0", "GPU-aaa"), gpu_edits(0)),
                                  NamedEdits(("1:0", "MIG-bbb"), mig_edits(HOST, 0, 2, 0))],
                      common_edits(HOST), with_all=True)


def test_build_is_deterministic_and_minimal() -> None:
    spec = _node_spec()
    assert spec.to_json() == _node_spec().to_json()
    assert spec.cdi_version == "0.5.0"  # device names start with a digit; nothing newer used
    assert [d.name for d in spec.devices] == ["0", "GPU-aaa", "1:0", "MIG-bbb", "all"]
    assert b"null" not in spec.to_json()
    claim = build_spec(CLAIM_KIND, [NamedEdits((claim_device("u1", "gpu-0"),), gpu_edits(0))],
                       common_edits(HOST))
    assert claim.cdi_version == "0.3.0"


def test_store_writes_atomically_lists_only_its_own_and_removes_idempotently(
        tmp_path: Path) -> None:
    store = SpecStore(tmp_path, (NODE_KIND, CLAIM_KIND))
    (tmp_path / "nvidia.com-gpu.json").write_text("{}")  # nvidia-ctk's: never ours
    node = store.write(_node_spec())
    claim = store.write(build_spec(CLAIM_KIND, [NamedEdits(("u1-gpu-0",), gpu_edits(0))],
                                   common_edits(HOST)), spec_id="u1")
    assert store.owned() == sorted([node, claim])
    assert store.remove(claim) and not store.remove(claim)
    with pytest.raises(ValueError, match=r"needs exactly 0\.5\.0"):
        store.write(_node_spec().model_copy(update={"cdi_version": "0.6.0"}))


def _claim_spec(uid: str) -> Spec:
    return build_spec(CLAIM_KIND, [NamedEdits((f"{uid}-gpu-0",), gpu_edits(0))],
                      common_edits(HOST))


def test_stores_with_owners_touch_only_their_own_specs(tmp_path: Path) -> None:
    """Two owners on one directory: each lists and removes only the specs it marked; a spec
    without a mark (written before marks) is adopted; removing a spec removes its mark."""
    first = SpecStore(tmp_path, (NODE_KIND, CLAIM_KIND), owner="agent-a")
    second = SpecStore(tmp_path, (NODE_KIND, CLAIM_KIND), owner="agent-b")
    mine = first.write(_claim_spec("a1"), spec_id="a1")
    theirs = second.write(_claim_spec("b1"), spec_id="b1")
    legacy = SpecStore(tmp_path, (CLAIM_KIND,)).write(_claim_spec("old"), spec_id="old")
    assert first.owner_of(mine) == "agent-a" and first.owner_of(legacy) is None
    assert first.owned() == sorted([mine, legacy])
    assert second.owned() == sorted([theirs, legacy])
    assert not first.remove(theirs) and theirs.exists()
    assert first.remove(mine) and not mine.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        f".{theirs.name}.owner"]
    assert second.remove(legacy) and not legacy.exists()


def test_specs_validate_against_the_upstream_schema(
        cdi_schema: Callable[[dict[str, Any]], None]) -> None:
    cdi_schema(json.loads(_node_spec().to_json()))
    cdi_schema(json.loads(_spec(spec_edits=ContainerEdits(
        mounts=(Mount(host_path="/a", container_path="/b", options=("ro",)),))).to_json()))


def test_the_reference_library_loads_and_injects(tmp_path: Path, cdi_checker: Checker) -> None:
    """The current reference library loads the node and claim specs, injects their devices,
    and computes for each the very cdiVersion the agent declared (the minimum its content
    needs, so runtimes with an older library still load it)."""
    store = SpecStore(tmp_path, (NODE_KIND, CLAIM_KIND))
    store.write(_node_spec())
    store.write(build_spec(CLAIM_KIND, [NamedEdits((claim_device("u1", "gpu-0"),), gpu_edits(0))],
                           common_edits(HOST)), spec_id="u1")
    report = cdi_checker(tmp_path, "nodeagent.dev/gpu=1:0", "nodeagent.dev/gpu=GPU-aaa")
    assert report["errors"] == {} and report["exit"] == 0
    versions = {Path(path).name: v for path, v in report["versions"].items()}
    assert len(versions) == 2
    assert {v["declared"] for v in versions.values()} == {"0.5.0", "0.3.0"}
    assert all(v["declared"] == v["minimum"] for v in versions.values()), versions
    assert "nodeagent.dev/gpu=all" in report["devices"]
    linux = report["injected"]["linux"]["devices"]
    assert {(d["path"], d["major"], d["minor"]) for d in linux} >= {
        ("/dev/nvidia0", 195, 0), ("/dev/nvidia-caps/nvidia-cap21", 511, 21),
        ("/dev/nvidia-caps/nvidia-cap22", 511, 22), ("/dev/nvidiactl", 195, 255)}
    assert "NVIDIA_VISIBLE_DEVICES=void" in report["injected"]["process"]["env"]


def test_the_reference_library_rejects_a_broken_spec(tmp_path: Path,
                                                     cdi_checker: Checker) -> None:
    # The library parses strictly: an unknown field, and empty device edits (#250).
    (tmp_path / "a.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "nodeagent.dev/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [
            {"path": "/dev/x", "colour": "red"}]}}]}))
    (tmp_path / "b.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "nodeagent.dev/other",
        "devices": [{"name": "x", "containerEdits": {}}]}))
    report = cdi_checker(tmp_path)
    assert report["exit"] == 1
    messages = " ".join(e for errs in report["errors"].values() for e in errs)
    assert "colour" in messages and "empty" in messages


def test_annotations_serialise_sorted_whatever_their_order() -> None:
    """Canonical: the same content gives the same bytes, however a caller built the dict."""
    edits = gpu_edits(0)
    one = Device(name="a", annotations={"b": "2", "a": "1"}, container_edits=edits)
    two = Device(name="a", annotations={"a": "1", "b": "2"}, container_edits=edits)
    assert one == two
    specs = [Spec(cdi_version="0.6.0", kind=CLAIM_KIND, devices=(d,),
                  annotations={"z": "", "y": ""}) for d in (one, two)]
    assert specs[0].to_json() == specs[1].to_json()
    assert specs[0].to_json().index(b'"cdiVersion"') < specs[0].to_json().index(b'"kind"')
