"""Which NVML the agent drives: the real ``pynvml`` module, or a simulated node of a preset.
The one place that chooses; everything else gets the chosen module object."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agent.gpu.sim.node import SimulatedNode


class NvmlErrorType(Exception):
    """What ``pynvml.NVMLError`` is: an exception carrying NVML's return code."""

    value: int


class Nvml(Protocol):
    """The ``pynvml`` module's surface, or the simulator's object with the same names,
    argument order, return types and ``NVMLError`` codes. Functions and constants are looked
    up by name (:meth:`agent.gpu.session.NvmlSession.call`), so only the error type, which the
    session catches, is declared."""

    NVMLError: type[NvmlErrorType]

    def __getattr__(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Backend:
    """The NVML implementation, and the simulator's controls when simulated."""

    nvml: Nvml
    name: str
    sim: SimulatedNode | None = None
    sys_root: Path = Path("/sys")
    #: The root under which device nodes are looked for (None: the host's, see CdiWriter).
    dev_root: Path | None = None


def open_backend(*, simulate: str | None, state_dir: Path, proc_root: Path,
                 sim_cluster_uuid: str | None = None,
                 sim_clique_id: int | None = None) -> Backend:
    """The simulated node of preset ``simulate`` (state under ``state_dir``, in the NVLink
    domain the ``sim_*`` arguments name), or real NVML."""
    if simulate:
        from agent.gpu.sim.node import SimulatedNode  # noqa: PLC0415 - only when simulating

        node = SimulatedNode(simulate, state_dir, proc_root, cluster_uuid=sim_cluster_uuid,
                             clique_id=sim_clique_id)
        # Faults armed before NVML is first touched (e.g. nvmlInit failing as if the driver
        # were not loaded yet); later ones come through /v1/sim/faults.
        for fault in json.loads(os.environ.get("GPU_AGENT_SIM_FAULTS", "[]")):
            node.add_fault(**fault)
        return Backend(nvml=node.nvml, name=f"simulated:{simulate}", sim=node,
                       sys_root=node.sys_root, dev_root=node.dev_root)
    import pynvml  # noqa: PLC0415 - the real library is only loaded on real nodes

    return Backend(nvml=pynvml, name="nvml")
