"""An MPS claim's CDI spec as the agent writes it, judged by the reference CDI library and the
upstream schema: the pipe directory variable and the pipe and shm bind mounts reach the
container."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.claims.requests import DeviceRequest
from agent.claims.sharing import MpsConfig, SharingConfig, short_id
from tests.cdi.conftest import Checker
from tests.claims.fake_tools import Tools, open_node


async def test_an_mps_claim_spec_loads_and_injects_its_pipe_and_shm(
        tmp_path: Path, cdi_checker: Checker,
        cdi_schema: Callable[[dict[str, Any]], None]) -> None:
    """The reference library loads an MPS claim's spec (declared cdiVersion = the minimum)
    and injects CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps with <root>/pipe and <root>/shm bind
    mounted rw,nosuid,nodev at /tmp/nvidia-mps and /dev/shm."""
    node = await open_node(tmp_path, Tools())
    try:
        record = await node.claims.prepare("c-mps", [DeviceRequest(
            request="gpu", kind="gpu", device="0",
            sharing=SharingConfig("MPS", mps=MpsConfig(thread_percentage=50)))], {})
        root = node.node.settings.mps_root / short_id("c-mps")  # type: ignore[operator]
        spec_path = node.claims.cdi.claim_path("c-mps")
        cdi_schema(json.loads(spec_path.read_text()))
        report = cdi_checker(node.cdi_dir, record.devices[0].cdi_device)
    finally:
        await node.close()
    assert report["errors"] == {} and report["exit"] == 0, report
    version = next(v for p, v in report["versions"].items() if Path(p) == spec_path)
    assert version["declared"] == version["minimum"]
    injected = report["injected"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in injected["process"]["env"]
    mounts = {(m["source"], m["destination"], tuple(m["options"])) for m in injected["mounts"]}
    options = ("rw", "nosuid", "nodev", "bind")
    assert {(f"{root}/pipe", "/tmp/nvidia-mps", options),
            (f"{root}/shm", "/dev/shm", options)} <= mounts
