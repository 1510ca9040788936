"""A GPU's multi-node NVLink fabric as faults (pure: values in, values out).

- registration not done (state ``not_started``, ``in_progress``) or failed (COMPLETED with an
  NVML error status): a ``fabric`` fault, value the state or the status word. Such a GPU has
  no clique, so it cannot join a domain; it blocks every claim, as NVIDIA's driver refuses to
  run at all on it (``CrashOnNVLinkFabricErrors``);
- registered, but the health mask flags a problem (``degraded_bandwidth``, ...): a
  ``fabric-health`` fault (informational), value the first flag in NVML's order;
- no fabric (NVML NOT_SUPPORTED, or an unreadable one: ``Gpu.fabric`` None), or a registered
  one with a healthy mask: nothing. A zero cluster UUID on a registered fabric is a GPU in no
  multi-node domain (a single-node NVSwitch system), not a fault.

Both faults go the moment the fabric reads healthy again; they are derived from the last
inventory read, so they are not kept across restarts.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.gpu.types import Fabric
from agent.health.taints import Fault, label_value

_COMPLETED = "completed"
_SUCCESS = 0  # NVML_SUCCESS: the registration's return code

#: When a fault was first seen, by (kind, value): a fault seen again keeps its ``since``.
FirstSeen = Mapping[tuple[str, str | None], float]


def fabric_faults(fabric: Fabric | None, *, seen: FirstSeen, now: float) -> tuple[Fault, ...]:
    """The faults of a GPU's fabric as last read; ``since`` from ``seen`` where the same
    fault was there before, else ``now``."""
    if fabric is None:
        return ()
    found: list[Fault] = []
    if fabric.state_name != _COMPLETED:
        word = label_value(fabric.state_name) or "unknown"
        found.append(Fault(kind="fabric", value=word, since=seen.get(("fabric", word), now),
                           reason=f"NVLink fabric not registered: {fabric.state_name}"))
    elif fabric.status != _SUCCESS:
        word = label_value(fabric.status_name) or "unknown"
        found.append(Fault(kind="fabric", value=word, since=seen.get(("fabric", word), now),
                           reason=f"NVLink fabric registration failed: {fabric.status_name}"))
    if fabric.health:
        flag = fabric.health[0]
        found.append(Fault(kind="fabric-health", value=flag,
                           since=seen.get(("fabric-health", flag), now),
                           reason=f"NVLink fabric health: {', '.join(fabric.health)}"))
    return tuple(found)
