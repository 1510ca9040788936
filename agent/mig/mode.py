"""When the agent may change a GPU's MIG mode for a slice (pure): on Hopper and newer a mode
change takes effect at once, without a GPU reset; on Ampere it needs one, which could wedge a
VM's GPU, so the agent never toggles it there."""

from __future__ import annotations

from agent.gpu.types import Gpu

#: MIG-capable architectures whose MIG mode changes take effect without a GPU reset.
MODE_CHANGES_WITHOUT_RESET = frozenset({"hopper", "blackwell"})


def switches_mig_on(gpu: Gpu) -> bool:
    """Whether a slice made for a scheduler's allocation may switch this GPU's MIG on first:
    MIG-capable, Hopper or newer, MIG off with no change pending (pure)."""
    mode = gpu.mig_mode
    return (gpu.static.mig_capable and gpu.static.architecture in MODE_CHANGES_WITHOUT_RESET
            and mode is not None and not mode.current and not mode.pending)


def slice_ready(gpu: Gpu, *, allocated: bool) -> bool:
    """Whether a slice can be made on ``gpu``: MIG on, or (for a device the scheduler
    allocated from the dynamic slices, ``allocated``) MIG off where :func:`switches_mig_on`."""
    mode = gpu.mig_mode
    return (mode is not None and mode.current) or (allocated and switches_mig_on(gpu))
