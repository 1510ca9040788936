"""Regenerate the committed gRPC stubs in ``agent/kubeplugin/proto/`` and
``agent/podresources/proto/`` from the ``.proto`` files beside them (``make protos``, or
``python -m agent.kubeplugin.protogen``).

The stubs are committed so that an install needs protobuf and grpcio at run time only, never
grpcio-tools; ``tests/kubeplugin/test_protos.py`` regenerates them into a scratch directory and
compares, so an edited ``.proto`` without regenerated stubs fails the tests. The output depends
on the grpcio-tools version (the stubs check the protobuf and grpcio they run on): regenerate
with the version the ``kubernetes`` extra pins.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
#: The plugin's DRA and registration protocols, and the agent's PodResources client (the
#: agent never imports this module: it is a build tool that happens to live here).
PROTO_DIRS = (Path(__file__).resolve().parent / "proto",
              ROOT / "agent" / "podresources" / "proto")
#: Generated beside each ``X.proto``: messages, their type stubs, and the service glue.
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def sources() -> list[Path]:
    """The ``.proto`` files, relative to the repository root (protoc's import root, so the
    generated modules import each other as ``agent.kubeplugin.proto.X_pb2``)."""
    return sorted(p.relative_to(ROOT) for d in PROTO_DIRS for p in d.glob("*.proto"))


def outputs(out_root: Path) -> list[Path]:
    """Every file :func:`generate` writes under ``out_root``."""
    return [out_root / src.parent / f"{src.stem}{suffix}"
            for src in sources() for suffix in SUFFIXES]


def generate(out_root: Path = ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) on every ``.proto``, writing under ``out_root`` (the
    repository root by default: the committed files); the files written."""
    from grpc_tools import protoc  # noqa: PLC0415 - a build-time tool, not a runtime dependency

    out_root.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *(str(src) for src in sources())]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed ({code}): {' '.join(args)}")
    return outputs(out_root)


def main() -> int:
    for path in generate():
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
