"""The minimum ``cdiVersion`` a spec's content needs (``specs-go/version.go``, reference B1).

Runtimes built on older CDI libraries parse strictly and reject what they do not know, so a
producer declares the lowest version that covers what it wrote, as nvidia-ctk does.
"""

from __future__ import annotations

from cdi.spec import ContainerEdits, Spec

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
EARLIEST = "0.3.0"


#: Every version this module names is one of KNOWN_VERSIONS, in order: compared by rank, not
#: parsed per comparison (this runs on every claim spec written).
_RANK = {version: rank for rank, version in enumerate(KNOWN_VERSIONS)}


def _latest(versions: list[str]) -> str:
    return max(versions, key=_RANK.__getitem__)


def _edits_need(edits: ContainerEdits | None) -> str:
    if edits is None:
        return EARLIEST
    needed = [EARLIEST]
    if edits.mounts and any(m.type for m in edits.mounts):
        needed.append("0.4.0")
    if edits.device_nodes and any(d.host_path for d in edits.device_nodes):
        needed.append("0.5.0")
    if edits.intel_rdt is not None or edits.additional_gids:
        needed.append("0.7.0")
    if edits.net_devices or (edits.intel_rdt is not None and (
            edits.intel_rdt.schemata is not None or
            edits.intel_rdt.enable_monitoring is not None)):
        needed.append("1.1.0")
    return _latest(needed)


def minimum_version(spec: Spec) -> str:
    """The lowest known version whose schema covers everything the spec uses."""
    needed = [_edits_need(spec.container_edits)]
    vendor_class = spec.kind.split("/", 1)
    if spec.annotations or any(d.annotations for d in spec.devices) or (
            len(vendor_class) == 2 and "." in vendor_class[1]):
        needed.append("0.6.0")
    for device in spec.devices:
        needed.append(_edits_need(device.container_edits))
        if device.name[:1].isdigit():
            needed.append("0.5.0")
    return _latest(needed)
