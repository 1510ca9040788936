"""The committed gRPC stubs are what the committed .proto files generate, they speak
kubelet's service and method names, and each .proto has the wire shape of kubelet's own
(from the Go module the test bed pins, read in the module cache)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from agent.kubeplugin import protogen
from tests.gobuild import find_go

MODULES = protogen.ROOT / "tests" / "k8s"


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
    ("dra_health_v1_pb2", "v1.DRAResourceHealth"),
    ("dra_health_v1alpha1_pb2", "v1alpha1.DRAResourceHealth"),
])
def test_the_services_have_kubelets_full_names(module: str, service: str) -> None:
    """Each service's full name is the one kubelet dials (the gRPC method path)."""
    loaded = __import__(f"agent.kubeplugin.proto.{module}", fromlist=["DESCRIPTOR"])
    names = [s.full_name for s in loaded.DESCRIPTOR.services_by_name.values()]
    assert names == [service]


def _upstream_dir(version: str) -> Path:
    """Where ``k8s.io/kubelet``, as tests/k8s/v<version>/go.mod pins it, lies in the module
    cache (``go mod download`` fetches it when it is not there yet)."""
    module = MODULES / f"v{version}"
    go = find_go(module)
    done = subprocess.run([go, "mod", "download", "-json", "k8s.io/kubelet"], cwd=module,
                          env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return Path(json.loads(done.stdout)["Dir"])


def _compiled(root: Path, proto: str, out: Path) -> descriptor_pb2.FileDescriptorProto:
    from grpc_tools import protoc  # noqa: PLC0415 - the build tool, as protogen loads it

    assert protoc.main(["grpc_tools.protoc", f"-I{root}", f"--descriptor_set_out={out}",
                        proto]) == 0, f"protoc failed on {root / proto}"
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def _messages(messages: Any, package: str, prefix: str = "") -> dict[str, Any]:
    """Message name -> field number -> what the wire and the generated code depend on; map
    entries and other nested types by their dotted names."""
    def named(type_name: str) -> str:
        return type_name.removeprefix(f".{package}.")

    found: dict[str, Any] = {}
    for message in messages:
        name = prefix + message.name
        found[name] = {f.number: (f.name, f.type, f.label, named(f.type_name),
                                  f.proto3_optional) for f in message.field}
        found.update(_messages(message.nested_type, package, f"{name}."))
    return found


def wire_shape(file: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    """A .proto's package, services and methods (types, streaming), messages and enums."""
    def named(type_name: str) -> str:
        return type_name.removeprefix(f".{file.package}.")

    return {
        "package": file.package,
        "services": {s.name: {m.name: (named(m.input_type), named(m.output_type),
                                       m.client_streaming, m.server_streaming)
                              for m in s.method} for s in file.service},
        "messages": _messages(file.message_type, file.package),
        "enums": {e.name: {v.number: v.name for v in e.value} for e in file.enum_type},
    }


@pytest.mark.parametrize(("ours", "version", "theirs", "newer_fields"), [
    ("dra_v1.proto", "1.37", "pkg/apis/dra/v1/api.proto", {}),
    ("dra_v1beta1.proto", "1.37", "pkg/apis/dra/v1beta1/api.proto", {}),
    ("registration.proto", "1.37", "pkg/apis/pluginregistration/v1/api.proto", {}),
    ("dra_health_v1.proto", "1.37", "pkg/apis/dra-health/v1/api.proto", {}),
    ("dra_health_v1alpha1.proto", "1.37", "pkg/apis/dra-health/v1alpha1/api.proto", {}),
    # 1.34's v1alpha1 had no timeout or message yet: its kubelet skips them as unknown.
    ("dra_health_v1alpha1.proto", "1.34", "pkg/apis/dra-health/v1alpha1/api.proto",
     {"DeviceHealth": {4, 5}}),
])
def test_each_proto_has_the_wire_shape_of_kubelets_own(
        ours: str, version: str, theirs: str, newer_fields: dict[str, set[int]],
        tmp_path: Path) -> None:
    """Our .proto, compiled, has the package, services, methods, messages, field names,
    numbers, types and enums of k8s.io/kubelet's file at the version the test bed pins
    (written independently, so a typo in a number or a name would go unseen by our own
    stubs; ``newer_fields`` are ours beyond an older kubelet's)."""
    upstream = wire_shape(_compiled(_upstream_dir(version), theirs, tmp_path / "theirs.pb"))
    mine = wire_shape(_compiled(protogen.ROOT, f"agent/kubeplugin/proto/{ours}",
                                tmp_path / "ours.pb"))
    for message, numbers in newer_fields.items():
        for number in numbers:
            assert number not in upstream["messages"][message], (message, number)
            del mine["messages"][message][number]
    assert mine == upstream
