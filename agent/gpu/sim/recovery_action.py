"""What the simulated driver sets NVML's recovery action (field 230) to after an XID (pure).

The driver keeps one recovery action per GPU: the most it takes to make the GPU usable
again. An XID can raise it, never lower it (only a GPU reset or a driver reload clears it,
back to NONE). Which XID asks for what follows the immediate action of NVIDIA's Xid catalog
(``reference/health.md``): a reset for the memory, row-remapping and GSP faults, a node
reboot for a GPU fallen off the bus, draining peer-to-peer traffic for an NVLink fault on a
GPU that has NVLink. Application XIDs and contained memory errors (94: the page is offlined,
other work goes on) leave it as it is, and so does every XID the table does not know. A
caller that knows better (a test, an operator rehearsing a fault) names the action instead.
"""

from __future__ import annotations

import pynvml

NONE = int(pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
GPU_RESET = int(pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
NODE_REBOOT = int(pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
DRAIN_P2P = int(pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P)
DRAIN_AND_RESET = int(pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)

#: The names the simulation controls take (``gpu-agent sim xid --recovery-action``).
ACTION_BY_NAME: dict[str, int] = {"none": NONE, "reset": GPU_RESET, "reboot": NODE_REBOOT,
                                  "drain-p2p": DRAIN_P2P, "drain-and-reset": DRAIN_AND_RESET}
NAME_OF_ACTION: dict[int, str] = {v: k for k, v in ACTION_BY_NAME.items()}

#: How much each action takes, least first: of two, the driver keeps the heavier.
_WEIGHT = {NONE: 0, DRAIN_P2P: 1, GPU_RESET: 2, DRAIN_AND_RESET: 3, NODE_REBOOT: 4}

#: XID -> the action it asks for.
_AFTER_XID: dict[int, int] = {
    48: GPU_RESET,  # double-bit ECC error
    63: GPU_RESET,  # row remapping recorded: a reset applies it
    64: GPU_RESET,  # row remapping failed
    95: GPU_RESET,  # uncontained ECC error
    119: GPU_RESET,  # GSP RPC timeout
    120: GPU_RESET,  # GSP error
    79: NODE_REBOOT,  # fallen off the bus
}
XID_NVLINK = 74


def action_after(xid: int, current: int, *, nvlink: bool) -> int:
    """The GPU's recovery action after ``xid``, from ``current`` (the action it had)."""
    wanted = DRAIN_P2P if xid == XID_NVLINK and nvlink else _AFTER_XID.get(xid, NONE)
    return wanted if _WEIGHT[wanted] > _WEIGHT.get(current, 0) else current


def action_name(action: int) -> str:
    """``reset`` for GPU_RESET; the number itself for an action this table has no name for."""
    return NAME_OF_ACTION.get(action, str(action))
