"""The aiohttp application: the route table and the middleware stack."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

import agent
from agent.api import admin, claims, domains, dra, gpus, identity, mig, node, sim, topology
from agent.api.context import AGENT, MAX_BODY_BYTES, AgentContext
from agent.api.mig_models import (
    ApplyModel,
    ApplyRequest,
    ExportedConfig,
    MigChange,
    MigGeometryModel,
    MigRequest,
    ProfileList,
    TransitionList,
    TransitionModel,
)
from agent.api.models import (
    EventList,
    GpuList,
    GpuModel,
    NodeModel,
    SimFabricRequest,
    SimFault,
    SimFaultRequest,
    SimGpuRequest,
    SimLatencyRequest,
    SimProcess,
    SimProcessRequest,
    SimState,
    SimXidRequest,
    Status,
)
from agent.api.openapi import build_openapi
from agent.api.problems import problem_middleware
from agent.api.routing import (
    QueryParam,
    Route,
    auth_middleware,
    query_middleware,
    register,
    request_middleware,
)

CORE_ROUTES = [
    Route("GET", "/healthz", node.healthz, "Liveness: the process and its event loop answer",
          Status, public=True, tag="probes"),
    Route("GET", "/readyz", node.readyz, "Readiness: NVML up, inventory loaded, state reconciled",
          Status, public=True, tag="probes", extra_responses={503: Status}),
    Route("GET", "/metrics", node.metrics, "Prometheus exposition", None, public=True,
          tag="probes", content_type="text/plain"),
    Route("GET", "/openapi.json", node.openapi, "This document", None, public=True,
          tag="probes"),
    Route("GET", "/v1/whoami", identity.whoami,
          "The caller's token: its name and scopes (always authenticated, changes nothing)",
          identity.Identity, identifies=True, errors=(401, 403)),
    # The kubelet plugin reads this node's IMEX address here for compute domains.
    Route("GET", "/v1/node", node.get_node, "Node identity, driver/CUDA/NVML versions, backend",
          NodeModel, errors=(503,), read_by=("claims",)),
    Route("GET", "/v1/gpus", gpus.list_gpus, "Inventory of every GPU", GpuList, tag="gpus",
          errors=(503,)),
    Route("GET", "/v1/gpus/{gpu}", gpus.get_gpu, "One GPU, by index or UUID", GpuModel,
          tag="gpus", errors=(503,)),
    Route("GET", "/v1/gpus/{gpu}/mig/profiles", mig.get_profiles,
          "MIG profiles of a GPU with placements and the capacity still free", ProfileList,
          tag="mig", errors=(409, 503)),
    Route("GET", "/v1/gpus/{gpu}/mig", mig.get_geometry,
          "Current MIG geometry from a fresh NVML walk, drain marks, drift", MigGeometryModel,
          tag="mig", errors=(409, 503), reconciled=True),
    Route("PUT", "/v1/gpus/{gpu}/mig", mig.put_geometry,
          "Desired MIG geometry: 202 and a transition, or 200 when already applied "
          "(?dry_run=true: the plan only)", MigChange, body=MigRequest, status=200,
          scope="geometry", tag="mig", errors=(409, 503),
          extra_responses={202: MigChange},
          query=(QueryParam("dry_run", {"type": "boolean"}, "Only plan"),)),
    Route("GET", "/v1/transitions", mig.list_transitions, "MIG transitions, newest first",
          TransitionList, tag="mig", errors=(503,), reconciled=True),
    Route("GET", "/v1/transitions/{id}", mig.get_transition,
          "One transition: state, steps with timings, blockers, error", TransitionModel,
          tag="mig", errors=(503,), reconciled=True),
    Route("POST", "/v1/transitions/{id}/cancel", mig.cancel_transition,
          "Cancel a transition that is still draining (ends aborted, nothing changed)",
          TransitionModel, scope="geometry", tag="mig", errors=(409, 503)),
    Route("POST", "/v1/mig/apply", mig.apply_config,
          "Apply a mig-parted v1 config (JSON or YAML) by label to the matching GPUs, by "
          "mig-parted's rules (GPUs without MIG skipped, missing indices ignored); "
          "?dry_run=true: 200 with every GPU's plan, nothing changed",
          ApplyModel, body=ApplyRequest, status=202, scope="geometry", tag="mig",
          errors=(409, 503), extra_responses={200: ApplyModel},
          query=(QueryParam("dry_run", {"type": "boolean"}, "Only plan"),)),
    Route("GET", "/v1/mig/export", mig.export_config,
          "The current layout of every GPU as a mig-parted v1 config (label 'current')",
          ExportedConfig, tag="mig", errors=(503,), reconciled=True),
    Route("GET", "/v1/mig/apply/{apply_id}", mig.get_apply,
          "A node-wide apply: each GPU's transition and the overall state", ApplyModel,
          tag="mig", errors=(503,), reconciled=True),
    Route("PUT", "/v1/claims/{uid}", claims.prepare_claim,
          "Prepare a claim: existing GPUs/MIG devices or MIG slices made on demand; "
          "idempotent", claims.ClaimModel, body=claims.ClaimRequest, scope="claims",
          tag="claims", errors=(409, 422, 503)),
    Route("DELETE", "/v1/claims/{uid}", claims.unprepare_claim,
          "Unprepare a claim (an unknown claim is a success; one stamped before the claim's "
          "newest stamped prepare changes nothing)", None, status=204,
          scope="claims", tag="claims", errors=(422, 503),
          query=(QueryParam("issued_at_ns", {"type": "integer", "minimum": 0},
                            claims.STAMP_DESCRIPTION),)),
    Route("GET", "/v1/claims", claims.list_claims, "Prepared claims", claims.ClaimList,
          tag="claims", errors=(503,), reconciled=True, read_by=("claims",)),
    Route("GET", "/v1/claims/{uid}", claims.get_claim, "One claim", claims.ClaimModel,
          tag="claims", errors=(422, 503), reconciled=True, read_by=("claims",)),
    Route("GET", "/v1/cdi", claims.list_cdi, "The CDI specs the agent maintains",
          claims.CdiList, tag="claims", errors=(503,), reconciled=True),
    Route("GET", "/v1/events", node.list_events,
          "Recent events (bounded, kept across restarts); the epoch changes on every start",
          EventList,
          query=(QueryParam("since", {"type": "integer", "minimum": 0},
                            "Only events after this sequence number (of ?epoch=)"),
                 QueryParam("epoch", {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                            "The epoch the since cursor came from (default: the current "
                            "one)")), errors=(422,)),
]

SIM_ROUTES = [
    Route("GET", "/v1/sim", sim.sim_state,
          "Simulator: presets, processes, faults, latencies, call counters", SimState,
          tag="simulation"),
    Route("POST", "/v1/sim/processes", sim.add_process,
          "Simulator: attach a fake process to a GPU or MIG device", SimProcess,
          body=SimProcessRequest, status=201, scope="admin", tag="simulation",
          errors=(404, 409)),
    Route("DELETE", "/v1/sim/processes/{pid}", sim.remove_process,
          "Simulator: end a fake process", None, status=204, scope="admin", tag="simulation",
          errors=(422,)),
    Route("POST", "/v1/sim/faults", sim.add_fault,
          "Simulator: make the (skip+1)-th matching NVML call fail (or CRASH the agent)",
          SimFault, body=SimFaultRequest, status=201, scope="admin", tag="simulation"),
    Route("DELETE", "/v1/sim/faults", sim.clear_faults, "Simulator: remove every fault", None,
          status=204, scope="admin", tag="simulation"),
    Route("PUT", "/v1/sim/latency", sim.set_latency,
          "Simulator: seconds added to each call of the named NVML functions", SimState,
          body=SimLatencyRequest, scope="admin", tag="simulation"),
    Route("POST", "/v1/sim/xid", sim.inject_xid, "Simulator: raise an XID event on a GPU", None,
          body=SimXidRequest, status=202, scope="admin", tag="simulation", errors=(404,)),
    Route("POST", "/v1/sim/fabric", sim.set_fabric,
          "Simulator: what a GPU's NVLink fabric reports (state, status, health)", None,
          body=SimFabricRequest, status=204, scope="admin", tag="simulation",
          errors=(404, 409)),
    Route("POST", "/v1/sim/reset", sim.reset_gpu,
          "Simulator: reset one GPU as nvidia-smi -r does", None, body=SimGpuRequest,
          status=204, scope="admin", tag="simulation", errors=(404, 409)),
    Route("POST", "/v1/sim/reload-driver", sim.reload_driver,
          "Simulator: reload the driver (instances gone; Hopper forgets MIG mode)", None,
          status=204, scope="admin", tag="simulation"),
]


def all_routes(*, simulated: bool) -> list[Route]:
    """Every route the agent serves (the simulation controls only when simulated)."""
    return (CORE_ROUTES + topology.ROUTES + dra.ROUTES + admin.ROUTES + domains.ROUTES
            + (SIM_ROUTES if simulated else []))


@functools.cache
def openapi_document(*, simulated: bool) -> dict[str, Any]:
    """The OpenAPI document of :func:`all_routes`, built on first use: the routes are constants
    and rendering every model's schema costs about half a second of CPU."""
    return build_openapi(all_routes(simulated=simulated), version=agent.__version__)


def build_app(ctx: AgentContext) -> web.Application:
    """The application for one agent; ``/v1/sim`` exists only when ``ctx.node.sim`` is set."""
    app = web.Application(
        client_max_size=ctx.node.settings.max_body_bytes,
        middlewares=[request_middleware, problem_middleware, auth_middleware, query_middleware],
    )
    app[AGENT] = ctx
    app[MAX_BODY_BYTES] = ctx.node.settings.max_body_bytes
    simulated = ctx.node.sim is not None
    register(app, all_routes(simulated=simulated))
    app[node.OPENAPI] = lambda: openapi_document(simulated=simulated)
    app.on_shutdown.append(dra.release_waiters)  # before in-flight requests are awaited
    return app
