"""Readable terminal output for the client verbs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, like kubectl."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])


def _mig(gpu: dict[str, Any]) -> str:
    mode = gpu.get("mig_mode")
    if mode is None:
        return "-"
    text = "on" if mode["current"] else "off"
    if mode["pending"] != mode["current"]:
        text += " (pending " + ("on" if mode["pending"] else "off") + ")"
    return text


def _holders(gpu: dict[str, Any]) -> str:
    """Who holds what on the GPU, from the ledger: ``claim (whole GPU)``,
    ``claim (slices 0:1, reserved)``; the transition owning it, if any."""
    held = [f"{h['claim']} ({h['device']}" + ("" if h["state"] == "prepared"
                                              else f", {h['state']}") + ")"
            for h in gpu.get("holds", ())]
    if gpu.get("transition"):
        held.append(f"transition {gpu['transition']}")
    return ", ".join(held) or "-"


def _available(gpu: dict[str, Any]) -> str:
    reasons = gpu.get("availability", {}).get("reasons", [])
    return "ok" if not reasons else "NO: " + "; ".join(reasons)


def gpu_table(gpus: Sequence[dict[str, Any]]) -> str:
    rows = [[str(g["index"]), g["name"], g["uuid"], g["pci_bus_id"], str(g["memory_total_mib"]),
             "-" if g["numa_node"] is None else str(g["numa_node"]), _mig(g),
             ",".join(d["profile"] for d in g["mig_devices"]) or "-",
             "ok" if g["health"]["healthy"] else "UNHEALTHY: " + "; ".join(g["health"]["reasons"]),
             _available(g), _holders(g)]
            for g in gpus]
    return table(["IDX", "NAME", "UUID", "BUS ID", "MEMORY MiB", "NUMA", "MIG", "MIG DEVICES",
                  "HEALTH", "AVAILABLE", "HELD BY"], rows)


def node_lines(node: dict[str, Any]) -> list[str]:
    keys = ["hostname", "backend", "gpu_count", "driver_version", "cuda_driver_version",
            "nvml_version", "agent_version", "boot_id"]
    width = max(len(k) for k in keys)
    return [f"{k.ljust(width)}  {node[k]}" for k in keys]
