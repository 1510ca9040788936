"""Building whole specs from named edits, deterministically: the same devices always give the
same bytes, so a repeated prepare rewrites an identical file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cdi.names import check_device, split_kind
from cdi.nvidia import merge
from cdi.spec import ContainerEdits, Device, Spec
from cdi.version import minimum_version

#: The node-wide spec: every device by index and UUID (MIG as ``i:j`` and ``MIG-<uuid>``).
NODE_KIND = "nodeagent.dev/gpu"
#: One transient spec per prepared claim. Never ``nvidia.com/gpu``: nvidia-ctk writes that
#: kind, and runtimes drop devices defined twice at the same priority.
CLAIM_KIND = "k8s.gpu.nodeagent.dev/claim"


@dataclass(frozen=True)
class NamedEdits:
    """One device under one or more names (``("0", "GPU-…")``)."""

    names: tuple[str, ...]
    edits: ContainerEdits


def build_spec(kind: str, devices: Sequence[NamedEdits], common: ContainerEdits, *,
               with_all: bool = False) -> Spec:
    """A spec of ``kind`` declaring the minimum ``cdiVersion`` its content needs."""
    split_kind(kind)
    entries = [Device(name=check_device(name), container_edits=d.edits)
               for d in devices for name in d.names]
    if with_all and devices:
        entries.append(Device(name="all", container_edits=merge([d.edits for d in devices])))
    draft = Spec(cdi_version="1.1.0", kind=kind, devices=tuple(entries),
                 container_edits=common)
    return draft.model_copy(update={"cdi_version": minimum_version(draft)})


def claim_device(uid: str, device_name: str) -> str:
    """The device name inside a claim's spec: ``<uid>-<device>`` (unique per claim, so a
    runtime's cache can never give a false hit)."""
    return check_device(f"{uid}-{device_name}")
