"""One key per device, however a caller names it: index, UUID, ``<gpu>:<mig>``, MIG UUID,
ResourceSlice device name or placement. A key is a GPU and, for a MIG device, the memory-slice
run it occupies, so an existing MIG device and an on-demand slice at the same place are the
same device, and two devices conflict exactly when their slices overlap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.device_names import parse_device_name, profile_label
from agent.errors import InvalidRequest
from agent.gpu.types import Gpu, MigDevice, Placement


@dataclass(frozen=True)
class DeviceKey:
    """A whole GPU (``placement`` None) or the memory slices of one MIG device on it."""

    gpu: str
    placement: Placement | None = None

    def conflicts(self, other: DeviceKey) -> bool:
        """Whether the two cannot both be held exclusively: the same GPU, and either one is
        the whole GPU or their slices overlap."""
        if self.gpu != other.gpu:
            return False
        if self.placement is None or other.placement is None:
            return True
        return self.placement.overlaps(other.placement)

    def __str__(self) -> str:
        if self.placement is None:
            return f"{self.gpu} (whole GPU)"
        return f"{self.gpu} slices {self.placement.start}:{self.placement.size}"


def key_of(gpu: Gpu, device: MigDevice | None) -> DeviceKey:
    return DeviceKey(gpu.uuid, None if device is None else device.placement)


def resolve(ref: str, gpus: Sequence[Gpu]) -> tuple[Gpu, MigDevice | None]:
    """A GPU or MIG device by UUID, index, ``<gpu>:<mig>`` or ResourceSlice device name;
    :class:`InvalidRequest` when nothing on the node has that name."""
    for gpu in gpus:
        if ref in (gpu.uuid, str(gpu.index)):
            return gpu, None
        for device in gpu.mig_devices:
            if ref in (device.uuid, f"{gpu.index}:{device.index}"):
                return gpu, device
    parsed = parse_device_name(ref)
    if parsed is not None:
        for gpu in gpus:
            if gpu.static.minor != parsed.minor:
                continue
            if parsed.profile is None:
                return gpu, None
            ids = {p.name: p.id for p in gpu.profiles}
            for device in gpu.mig_devices:
                if (profile_label(device.profile), ids.get(device.profile),
                        device.placement.start) == (parsed.profile, parsed.profile_id,
                                                    parsed.start):
                    return gpu, device
    raise InvalidRequest(f"devices: no device {ref!r} on this node (a GPU UUID or index, a "
                         "MIG UUID, <gpu>:<mig>, or a ResourceSlice device name)",
                         [{"field": "devices.device", "reason": "unknown device"}])
