"""A node's compute-domain slot: one device in a ResourceSlice of its own that a domain's
shared claim counts (pure: values in, a dict or None out).

A compute domain is one ResourceClaim shared by the N pods of a job, asking for N devices of
DeviceClass ``compute-domain.<driver>`` with ``matchAttribute`` on ``fabricClique``. Each node
whose GPUs can all join one NVLink clique offers one slot, in a slice selected by node label
(``spec.nodeSelector`` on ``<driver>/fabric-clique=<clique label>``), not by node name: the
scheduler's allocator then sees, on every node of clique X, the slots of all nodes of X, so a
claim for N slots is allocated from one clique with an allocation node selector naming it, and
every pod sharing the claim lands on that clique. N above any clique's size is not allocated.

A node offers its slot only when every GPU of it has a usable fabric (registered: COMPLETED
and SUCCESS, a non-zero cluster UUID: ``Fabric.clique``), all in one clique, and no GPU has a
blocking fabric fault; a lost GPU, a registration in progress, a failed one or a second clique
withdraw it. Informational fabric health (``degraded_bandwidth``) does not: the GPUs stay in
the clique and are offered with an informational taint.

The slice's pool is ``<node>/compute-domain`` (one slice, its own generation; names in
``agent/device_names.py``); the plugin adds the owner reference to its Node and the Node label
(``agent/kubeplugin/domain_slots.py``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from agent.device_names import SLOT_DEVICE, SLOT_POOL_SUFFIX, clique_label, slot_slice_name
from agent.dra.resource_slices import API_VERSION, GpuFacts

Json = dict[str, Any]

SLOT_TYPE = "compute-domain-slot"
#: A label value: at most 63 characters, alphanumeric at both ends, ``-._`` inside.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def clique_label_value(clique: str) -> str:
    """The clique as a label value: itself when it is one (``<cluster uuid>.<clique id>`` is),
    else ``clique-`` and a digest of it, the same on every node of the clique."""
    if _LABEL_VALUE.match(clique):
        return clique
    return "clique-" + hashlib.sha256(clique.encode()).hexdigest()[:40]


def node_clique(gpus: Sequence[GpuFacts]) -> str | None:
    """The clique every GPU of the node is in and may be offered for, or None: no GPU, a
    GPU without a usable fabric (not registered, failed, lost, no fabric), a blocking fabric
    fault, or GPUs in different cliques."""
    cliques = set()
    for facts in gpus:
        fabric = facts.gpu.fabric
        clique = fabric.clique if fabric is not None else None
        if clique is None or facts.gpu.static.minor < 0:
            return None
        if any(f.kind == "fabric" for f in facts.faults):
            return None
        cliques.add(clique)
    return cliques.pop() if len(cliques) == 1 else None


def render_slot(gpus: Sequence[GpuFacts], *, driver: str, node_name: str) -> Json | None:
    """The node's slot slice, or None when the node offers none (:func:`node_clique`). Its
    generation is 0: the plugin writes one above the server's (a slot changes only with the
    clique, so its pool has a generation of its own, not the GPUs')."""
    clique = node_clique(gpus)
    if clique is None:
        return None
    selector = {"nodeSelectorTerms": [{"matchExpressions": [{
        "key": clique_label(driver), "operator": "In", "values": [clique_label_value(clique)]}]}]}
    return {
        "apiVersion": API_VERSION, "kind": "ResourceSlice",
        "metadata": {"name": slot_slice_name(node_name)},
        "spec": {
            "driver": driver,
            "pool": {"name": node_name + SLOT_POOL_SUFFIX, "generation": 0,
                     "resourceSliceCount": 1},
            "nodeSelector": selector,
            "devices": [{"name": SLOT_DEVICE, "attributes": {
                "type": {"string": SLOT_TYPE},
                # As the GPUs carry it (resource_slices._gpu_attributes).
                "fabricClique": {"string": clique[:64]}}}],
        },
    }
