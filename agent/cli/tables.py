"""Readable terminal output for the client verbs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


def table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None) -> str:
    """Left-aligned columns separated by two spaces, like kubectl. With ``width``, the widest
    columns are narrowed (their cells cut, ending in ``...``) until every line fits in it;
    a column never gets narrower than its header."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*cells, strict=True)]
    if width is not None:
        floors = [max(len(h), 3) for h in header]
        over = sum(widths) + 2 * (len(widths) - 1) - width
        while over > 0:
            narrowable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not narrowable:
                break
            widest = max(narrowable, key=lambda i: widths[i])
            others = max((widths[i] for i in narrowable if i != widest), default=0)
            step = min(over, widths[widest] - max(others, floors[widest]) or 1)
            widths[widest] -= step
            over -= step
    return "\n".join("  ".join(_cut(c, w).ljust(w) for c, w in zip(row, widths, strict=True))
                     .rstrip() for row in cells)


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


def _short_name(name: str) -> str:
    return name.removeprefix("NVIDIA ")


def _health(gpu: dict[str, Any], wide: bool) -> str:
    if gpu["health"]["healthy"]:
        return "ok"
    return "UNHEALTHY: " + "; ".join(gpu["health"]["reasons"]) if wide else "UNHEALTHY"


def fabric_text(gpu: dict[str, Any]) -> str:
    """``completed``, ``in_progress``, ``completed (NVML_ERROR_...)``, ``completed,
    degraded_bandwidth``; ``-`` for a GPU without an NVLink fabric."""
    fabric = gpu.get("fabric")
    if not fabric:
        return "-"
    text = fabric["state"]
    if fabric["status"] != "NVML_SUCCESS":
        text += f" ({fabric['status']})"
    return ",".join([text, *fabric.get("health", [])])


def _clique(gpu: dict[str, Any]) -> str:
    return (gpu.get("fabric") or {}).get("clique") or "-"


def _gpu_row(g: dict[str, Any], wide: bool) -> list[str]:
    if not wide:
        return [str(g["index"]), _short_name(g["name"]), str(g["memory_total_mib"]), _mig(g),
                _health(g, wide), available_text(g), holders_text(g)]
    return [str(g["index"]), g["name"], g["uuid"], g["pci_bus_id"], str(g["memory_total_mib"]),
            "-" if g["numa_node"] is None else str(g["numa_node"]), _mig(g),
            ",".join(d["profile"] for d in g["mig_devices"]) or "-", _health(g, wide),
            _taints(g), fabric_text(g), _clique(g), g.get("domain") or "-", available_text(g),
            holders_text(g)]


#: The ``gpus`` columns: the default fits 120 columns (taints are listed under the table);
#: ``-o wide`` adds identity, placement, every MIG device and taint, and the NVLink fabric.
GPU_COLUMNS = ["IDX", "NAME", "MEMORY MiB", "MIG", "HEALTH", "AVAILABLE", "HELD BY"]
GPU_WIDE_COLUMNS = ["IDX", "NAME", "UUID", "BUS ID", "MEMORY MiB", "NUMA", "MIG", "MIG DEVICES",
                    "HEALTH", "TAINTS", "FABRIC", "CLIQUE", "DOMAIN", "AVAILABLE",
                    "HELD BY"]


def gpu_table(gpus: Sequence[dict[str, Any]], width: int | None = None) -> str:
    """The ``gpus`` listing: cut to ``width`` columns with fewer of them, or (None) every
    column in full, as ``-o wide``; then each taint and why."""
    wide = width is None
    text = table(GPU_WIDE_COLUMNS if wide else GPU_COLUMNS,
                 [_gpu_row(g, wide) for g in gpus], width)
    why = [line if width is None else _cut(line, width) for line in taint_lines(gpus)]
    return text + ("\n\nTaints:\n" + "\n".join(why) if why else "")


def key_values(rows: Sequence[tuple[str, str]], width: int | None = None) -> list[str]:
    """``key  value`` lines, the values aligned; each line cut to ``width``."""
    pad = max(len(k) for k, _ in rows)
    return [f"{k.ljust(pad)}  {v}" if width is None else _cut(f"{k.ljust(pad)}  {v}", width)
            for k, v in rows]


def gpu_detail(gpu: dict[str, Any], width: int | None = None) -> str:
    """``gpus N``: one GPU as ``key  value`` lines, then its MIG devices and its taints."""
    rows = [("index", str(gpu["index"])), ("name", gpu["name"]), ("uuid", gpu["uuid"]),
            ("bus id", gpu["pci_bus_id"]), ("architecture", gpu.get("architecture", "-")),
            ("memory", f"{gpu['memory_total_mib']} MiB"),
            ("numa node", "-" if gpu["numa_node"] is None else str(gpu["numa_node"])),
            ("cpu affinity", gpu.get("cpu_affinity") or "-"), ("mig", _mig(gpu)),
            ("health", _health(gpu, True)), ("fabric", fabric_text(gpu)),
            ("clique", _clique(gpu)), ("drained", gpu.get("drained") or "-"),
            ("available", available_text(gpu)), ("held by", holders_text(gpu))]
    text = "\n".join(key_values(rows, width))
    devices = gpu.get("mig_devices") or []
    if devices:
        text += "\n\n" + table(
            ["MIG", "PROFILE", "GI", "CI", "PLACEMENT", "MEMORY MiB", "AVAILABLE", "UUID"],
            [[str(d["index"]), d["profile"], str(d["gi_id"]), str(d["ci_id"]),
              f"{d['placement']['start']}:{d['placement']['size']}", str(d["memory_mib"]),
              "yes" if d["availability"]["available"] else "no", d["uuid"]]
             for d in devices], width)
    why = [line if width is None else _cut(line, width) for line in taint_lines([gpu])]
    return text + ("\n\nTaints:\n" + "\n".join(why) if why else "")


def node_lines(node: dict[str, Any], width: int | None = None) -> list[str]:
    keys = ["hostname", "backend", "gpu_count", "driver_version", "cuda_driver_version",
            "nvml_version", "agent_version", "boot_id"]
    return key_values([(k, str(node[k])) for k in keys], width)
