"""The committed gRPC stubs are what the committed .proto files generate, and they speak
kubelet's service and method names."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.kubeplugin import protogen


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    """protogen.generate into a scratch root writes byte-for-byte the committed stubs (run
    ``make protos`` after editing a .proto)."""
    written = protogen.generate(tmp_path)
    assert written, "no .proto files found"
    for path in written:
        committed = protogen.ROOT / path.relative_to(tmp_path)
        assert path.read_bytes() == committed.read_bytes(), f"{committed} is out of date"


@pytest.mark.parametrize(("module", "service"), [
    ("dra_v1_pb2", "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"),
    ("dra_v1beta1_pb2", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"),
    ("registration_pb2", "pluginregistration.Registration"),
])
def test_the_services_have_kubelets_full_names(module: str, service: str) -> None:
    """Each service's full name is the one kubelet dials (the gRPC method path)."""
    loaded = __import__(f"agent.kubeplugin.proto.{module}", fromlist=["DESCRIPTOR"])
    names = [s.full_name for s in loaded.DESCRIPTOR.services_by_name.values()]
    assert names == [service]
