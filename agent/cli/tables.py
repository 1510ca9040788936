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


def _share_of(gpu: dict[str, Any], claim: str) -> dict[str, Any] | None:
    shares = gpu.get("shares") or {}
    return next((h for h in shares.get("holders", ()) if h["claim"] == claim), None)


def _hold_text(gpu: dict[str, Any], hold: dict[str, Any]) -> str:
    """One hold: ``claim (whole GPU)``, ``claim (share 10240 MiB)``, ``claim (slices 0:1,
    reserved)``, ``claim (whole GPU, admin)``."""
    what = hold["device"]
    if hold.get("kind") == "share":
        share = _share_of(gpu, hold["claim"])
        what = "share" if share is None or share["memory_mib"] is None \
            else f"share {share['memory_mib']} MiB"
    elif hold.get("kind") == "admin":
        what += ", admin"
    if hold["state"] != "prepared":
        what += f", {hold['state']}"
    return f"{hold['claim']} ({what})"


def holders_text(gpu: dict[str, Any]) -> str:
    """Who holds what on the GPU, from the ledger; the transition owning it, if any."""
    held = [_hold_text(gpu, h) for h in gpu.get("holds", ())]
    if gpu.get("transition"):
        held.append(f"transition {gpu['transition']}")
    return ", ".join(held) or "-"


def available_text(gpu: dict[str, Any]) -> str:
    """What a new claim may have of the GPU: ``ok`` (all of it), the memory shares have left,
    the free MIG devices, or ``NO`` and why (the blocking reasons, or who holds it)."""
    availability = gpu.get("availability", {})
    reasons = availability.get("reasons", [])
    if reasons:
        return "NO: " + "; ".join(reasons)
    shares = gpu.get("shares")
    if shares and any(h["memory_mib"] is None for h in shares["holders"]):
        return "NO: held"  # whole, under one claim's MPS daemon
    if shares:
        left, capacity = shares["left_mib"], shares["capacity_mib"]
        return f"shares: {left} of {capacity} MiB left" if left else \
            f"NO: shares take all {capacity} MiB"
    migs = gpu.get("mig_devices", [])
    if migs:
        free = sum(1 for d in migs if d["availability"]["available"])
        return f"{free} of {len(migs)} MIG devices" if free else \
            f"NO: all {len(migs)} MIG devices held"
    if availability.get("holders"):
        return "NO: held"
    return "ok"


def taint_text(taint: dict[str, Any]) -> str:
    """``key=value:effect`` as a toleration names it (``key:effect`` without a value)."""
    value = taint.get("value")
    return f"{taint['key']}{'' if value in (None, '') else '=' + str(value)}:{taint['effect']}"


def _taints(gpu: dict[str, Any]) -> str:
    """The GPU's taints, and its MIG devices' own ones (those it does not carry itself)."""
    own = [taint_text(t) for t in gpu.get("taints") or ()]
    for device in gpu.get("mig_devices", []):
        extra = [taint_text(t) for t in device.get("taints") or () if taint_text(t) not in own]
        if extra:
            own.append(f"{device['profile']} gi {device['gi_id']}: {', '.join(extra)}")
    return ", ".join(own) or "-"


def taint_lines(gpus: Sequence[dict[str, Any]]) -> list[str]:
    """Each taint and why, with when it was added: one line per GPU or MIG device taint."""
    lines = []
    for gpu in gpus:
        devices = [(f"GPU {gpu['index']}", gpu)] + [
            (f"GPU {gpu['index']} {d['profile']} gi {d['gi_id']}", d)
            for d in gpu.get("mig_devices", [])]
        shown: set[str] = set()
        for name, device in devices:
            for taint in device.get("taints") or ():
                text = taint_text(taint)
                if device is not gpu and text in shown:
                    continue  # the GPU's own taint, carried by its MIG devices too
                if device is gpu:
                    shown.add(text)
                lines.append(f"{name}  {text}  since {taint.get('time_added') or '?'}: "
                             f"{taint.get('reason') or '-'}")
    return lines


def gpu_table(gpus: Sequence[dict[str, Any]]) -> str:
    rows = [[str(g["index"]), g["name"], g["uuid"], g["pci_bus_id"], str(g["memory_total_mib"]),
             "-" if g["numa_node"] is None else str(g["numa_node"]), _mig(g),
             ",".join(d["profile"] for d in g["mig_devices"]) or "-",
             "ok" if g["health"]["healthy"] else "UNHEALTHY: " + "; ".join(g["health"]["reasons"]),
             _taints(g), available_text(g), holders_text(g)]
            for g in gpus]
    text = table(["IDX", "NAME", "UUID", "BUS ID", "MEMORY MiB", "NUMA", "MIG", "MIG DEVICES",
                  "HEALTH", "TAINTS", "AVAILABLE", "HELD BY"], rows)
    why = taint_lines(gpus)
    return text + ("\n\nTaints:\n" + "\n".join(why) if why else "")


def node_lines(node: dict[str, Any]) -> list[str]:
    keys = ["hostname", "backend", "gpu_count", "driver_version", "cuda_driver_version",
            "nvml_version", "agent_version", "boot_id"]
    width = max(len(k) for k in keys)
    return [f"{k.ljust(width)}  {node[k]}" for k in keys]
