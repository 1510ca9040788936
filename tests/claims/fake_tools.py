"""Recording fakes of the sharing tools (nvidia-smi, nvidia-cuda-mps-control) in the shape
of the hardware layer's NvidiaSmi and MpsControl, and a simulated L40S node that uses them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.claims.sharing_runtime import DaemonSpec, SharingRuntime
from agent.errors import SharingUnavailable
from agent.gpu import backend as gpu_backend
from agent.settings import resolve
from agent.wiring import build_node
from tests.service_node import ServiceNode, start


@dataclass
class FakeSmi:
    """nvidia-smi: records (uuid, what, value); ``fail`` makes every call exit non-zero."""

    calls: list[tuple[str, str, object]] = field(default_factory=list)
    present: bool = True
    fail: bool = False

    def available(self) -> bool:
        return self.present

    async def set_compute_mode(self, uuid: str, mode: str) -> None:
        self._call(uuid, "compute_mode", mode)

    async def set_timeslice(self, uuid: str, value: int) -> None:
        self._call(uuid, "timeslice", value)

    def _call(self, uuid: str, what: str, value: object) -> None:
        if self.fail:
            raise SharingUnavailable("nvidia-smi exited 3", tool="nvidia-smi", gpu=uuid,
                                     reason="exit 3")
        self.calls.append((uuid, what, value))


@dataclass
class FakeMps:
    """nvidia-cuda-mps-control: live daemons by root; ``fail_start``/``fail_stop``."""

    running: dict[Path, DaemonSpec] = field(default_factory=dict)
    started: list[DaemonSpec] = field(default_factory=list)
    stopped: list[Path] = field(default_factory=list)
    present: bool = True
    fail_start: bool = False
    fail_stop: bool = False
    #: Called with each spec as the daemon starts (to look at what is durable by then).
    on_start: Callable[[DaemonSpec], None] | None = None

    def available(self) -> bool:
        return self.present

    async def start(self, spec: DaemonSpec) -> None:
        if self.fail_start:
            raise SharingUnavailable("nvidia-cuda-mps-control -d exited 1",
                                     tool="nvidia-cuda-mps-control", reason="exit 1")
        if self.on_start is not None:
            self.on_start(spec)
        self.started.append(spec)
        self.running[spec.root] = spec

    async def alive(self, root: Path) -> bool:
        return root in self.running

    async def servers(self, root: Path) -> list[int]:
        return [100] if root in self.running else []

    async def clients(self, root: Path, server: int) -> list[int]:
        return [101]

    async def stop(self, root: Path) -> None:
        if self.fail_stop:
            raise SharingUnavailable("daemon did not quit", tool="nvidia-cuda-mps-control",
                                     reason="timeout")
        self.stopped.append(root)
        self.running.pop(root, None)


@dataclass
class Tools:
    smi: FakeSmi = field(default_factory=FakeSmi)
    mps: FakeMps = field(default_factory=FakeMps)
    #: MPS client pid -> MiB used, per device UUID (what NVML would report).
    used: dict[str, dict[int, int]] = field(default_factory=dict)

    async def usage(self, device: str) -> dict[int, int]:
        return self.used.get(device, {})


async def open_node(directory: Path, tools: Tools, **settings: Any) -> ServiceNode:
    """A started simulated L40S node (4 GPUs of 46,068 MiB) whose sharing uses ``tools``."""
    state = directory / "state"
    resolved = resolve({"simulate": "l40s", "state_dir": state, "proc_root": directory / "proc",
                        "cdi_dir": directory / "cdi", "run_dir": directory / "run",
                        "collect_interval": 3600.0, **settings}, env={})
    backend = gpu_backend.open_backend(simulate=resolved.simulate, state_dir=state,
                                       proc_root=directory / "proc")
    assert resolved.mps_root is not None
    node = build_node(resolved, backend, sharing=SharingRuntime(
        nvidia_smi=tools.smi, mps=tools.mps, mps_root=resolved.mps_root, usage=tools.usage))
    return await start(node, state, directory / "cdi")
