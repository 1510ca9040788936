"""Write the upgrade fixture: a state directory as the agent on PYTHONPATH leaves it with
three prepared claims (whole GPU 2, the 3g.40gb MIG device of GPU 5, an on-demand 1g.10gb
slice on GPU 6) and an open journal entry (GPU 0 killed by the simulator's CRASH fault at the
second GPU-instance create of 7g.80gb -> balanced). Run once per baseline, from the baseline's
checkout, e.g.:

    PYTHONPATH=/work/main /work/main/.venv/bin/python tests/data/upgrade/make_fixture.py \
        tests/data/upgrade/main-c087fb4

It writes OUT/state/ (the agent's and the simulator's files; sockets, locks, listeners.json and
the regenerated proc/ and sys/ trees left out) and OUT/expected.json (what the API showed).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import agent
from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

BALANCED = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
MUTATING = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy",
            "nvmlGpuInstanceDestroy")
LEFT_OUT = ("agent.sock", "agent.lock", "listeners.json", "proc", "sim/sys", "sim/hardware.lock")


def _geometry(a: AgentProcess, gpu: str, body: dict[str, object]) -> None:
    reply = a.request("PUT", f"/v1/gpus/{gpu}/mig", body)
    assert reply.status in (200, 202), reply.body
    if reply.status == 202:
        def ended() -> dict[str, object] | None:
            body: dict[str, object] = a.request("GET", reply.headers["location"],
                                                token=None).body
            return body if body["terminal"] else None
        done = wait_for(ended, "the transition to end", 30)
        assert done["state"] == "succeeded", done


def _layout(a: AgentProcess, gpu: str) -> list[str]:
    body = a.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in body["instances"])


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        a = start_agent(state)
        try:
            _geometry(a, "5", {"profiles": ["3g.40gb"]})
            _geometry(a, "6", {"profiles": []})
            _geometry(a, "0", {"profiles": ["7g.80gb"]})
            mig = a.request("GET", "/v1/gpus/5", token=None).body["mig_devices"][0]["uuid"]
            for uid, device in (("whole", {"request": "gpu", "device": "gpu-2"}),
                                ("mig", {"request": "gpu", "device": mig}),
                                ("slice", {"request": "slice", "profile": "1g.10gb",
                                           "gpu": "6"})):
                reply = a.request("PUT", f"/v1/claims/{uid}", {"devices": [device]})
                assert reply.status == 200, reply.body
            claims = a.request("GET", "/v1/claims", token=None).body["claims"]
            old = _layout(a, "0")
            a.request("PUT", "/v1/sim/latency", dict.fromkeys(MUTATING, 0.02))
            uuid = a.request("GET", "/v1/gpus/0", token=None).body["uuid"]
            a.request("POST", "/v1/sim/faults", {
                "function": "nvmlDeviceCreateGpuInstanceWithPlacement", "error": "CRASH",
                "gpu": uuid, "skip": 1})
            started = a.request("PUT", "/v1/gpus/0/mig", {"profiles": BALANCED})
            assert started.status == 202, started.body
            assert a.proc.wait(30) == -signal.SIGKILL
        finally:
            a.stop(signal.SIGKILL)
        journal = list((state / "mig" / "journal").glob("*.json"))
        assert len(journal) == 1, journal
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(state, out / "state", symlinks=True, ignore=lambda d, names: [
            n for n in names
            if str((Path(d) / n).relative_to(state)) in LEFT_OUT or n.endswith(".tmp")])
        commit = subprocess.run(["git", "-C", str(Path(agent.__file__).parents[1]), "rev-parse",
                                 "HEAD"], capture_output=True, text=True, check=True)
        expected = {
            "written_by": {"commit": commit.stdout.strip(), "agent_version": agent.__version__},
            "claims": {c["uid"]: {"devices": [d["uuid"] for d in c["devices"]],
                                  "cdi_devices": [n for d in c["devices"]
                                                  for n in d["cdi_devices"]]}
                       for c in claims},
            "transition": {"id": started.body["transition"]["id"], "gpu": uuid, "old": old,
                           "target": sorted(f"{i['profile']}@{i['placement']['start']}:"
                                            f"{i['placement']['size']}"
                                            for i in started.body["plan"]["keep"]
                                            + started.body["plan"]["create"])},
        }
        (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
