"""The plugin's health listener (``--health-listen``): ``/healthz`` (the process answers),
``/readyz`` (registered with kubelet, agent reachable and ready, API server reachable, slices
in sync; 503 naming every failing check; under ``warnings``, what it reports without failing:
``claim_status``, since prepares work without device status and a server that does not keep
it is a cluster's setting, not a node to take out, and ``compute_domain_slot``, since the
node's GPUs work without it) and ``/metrics`` (the plugin's and the
publisher's series, one registry). No tokens: nothing here changes anything or shows a secret."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from agent.kubeplugin import reasons
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.claim_status import ClaimStatusWriter
from agent.kubeplugin.credentials import CredentialProbe
from agent.kubeplugin.domain_slots import DomainSlots
from agent.kubeplugin.kube import KubeForbidden
from agent.kubeplugin.metrics import PluginMetrics
from agent.kubeplugin.protocols import ApiServer, Publisher
from agent.kubeplugin.servers import RegistrationState

log = logging.getLogger("agent.kubeplugin.health")

#: Each check's bound, so that one slow dependency cannot hang the probe (give the probe a
#: timeoutSeconds above it).
CHECK_TIMEOUT_S = 3.0

Check = Callable[[], Awaitable[str | None]]


@dataclass
class Readiness:
    """The checks behind ``/readyz``, each answering None (fine) or the reason it fails."""

    registration: RegistrationState
    agent: AgentClient
    api: ApiServer | None = None
    publisher: Publisher | None = None
    #: ``gpu_agent_plugin_ready``: set from every round of checks.
    metrics: PluginMetrics | None = None
    #: Reported under ``warnings``, never failing readiness (nor the ready metric).
    claim_status: ClaimStatusWriter | None = None
    #: The API server credential's check: a refusal is the ``api_server`` check's reason,
    #: checked again by each round while it stands (a renewed credential shows at once).
    credential: CredentialProbe | None = None
    #: Why the node's compute-domain slot is not as the agent wants it (a warning: the
    #: node's GPUs work without it).
    domain_slots: DomainSlots | None = None

    def warnings(self) -> dict[str, str]:
        """What ``/readyz`` reports without failing: why claim device status is not written,
        and which faulty devices a server without taints has withdrawn (the node works, and a
        node taken out for a bad GPU would stall every rolling update)."""
        found = {}
        problem = None if self.claim_status is None else self.claim_status.problem
        if problem is not None:
            found["claim_status"] = problem
        withheld = None if self.publisher is None else self.publisher.health().withheld
        if withheld is not None:
            found["taints"] = withheld
        slot = None if self.domain_slots is None else self.domain_slots.problem
        if slot is not None:
            found["compute_domain_slot"] = slot
        return found

    async def _registered(self) -> str | None:
        return self.registration.reason

    async def _api(self) -> str | None:
        if self.api is None:
            return None
        credential = None if self.credential is None else self.credential.credential
        if credential is not None and credential.problem is not None:
            assert self.credential is not None
            try:
                await self.credential.check_credential()
            except Exception as err:  # no answer to the check
                return reasons.API_UNREACHABLE.says(f"{type(err).__name__}: {err}")
            if credential.problem is not None:
                return credential.problem
        try:
            await self.api.server_version()
        except KubeForbidden as err:  # a 401: the credential (recorded by the client)
            if credential is not None and credential.problem is not None:
                return credential.problem
            return reasons.API_CREDENTIAL_REFUSED.says(str(err))
        except Exception as err:  # any other failure means "not reachable"
            return reasons.API_UNREACHABLE.says(f"{type(err).__name__}: {err}")
        return None

    async def _slices(self) -> str | None:
        if self.publisher is None:
            return None
        health = self.publisher.health()
        return None if health.in_sync else reasons.SLICES_NOT_IN_SYNC.says(
            health.reason or "unknown")

    async def checks(self) -> dict[str, str | None]:
        """Every check's result, run concurrently, each bounded by ``CHECK_TIMEOUT_S``."""
        named: dict[str, Check] = {"registered": self._registered,
                                   "agent": self.agent.readiness, "api_server": self._api,
                                   "slices": self._slices}

        async def bounded(check: Check) -> str | None:
            try:
                return await asyncio.wait_for(check(), CHECK_TIMEOUT_S)
            except TimeoutError:
                return f"{reasons.NO_ANSWER} {CHECK_TIMEOUT_S:g} s"

        results = await asyncio.gather(*(bounded(c) for c in named.values()))
        checks = dict(zip(named, results, strict=True))
        if self.metrics is not None:
            self.metrics.set_readiness(checks)
        return checks


def health_app(readiness: Readiness, registry: CollectorRegistry) -> web.Application:
    """The aiohttp application of the health listener."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        checks = await readiness.checks()
        failing = {name: reason for name, reason in checks.items() if reason is not None}
        body: dict[str, object] = {"status": "not ready" if failing else "ready",
                "checks": {name: reason or "ok" for name, reason in checks.items()}}
        if failing:
            body["reason"] = "; ".join(f"{name}: {why}" for name, why in failing.items())
        if warnings := readiness.warnings():
            body["warnings"] = warnings
        return web.json_response(body, status=503 if failing else 200)

    async def metrics(request: web.Request) -> web.Response:
        # The checks run first, so gpu_agent_plugin_ready is what /readyz answers now, even
        # where nothing probes /readyz (the checks are bounded: a scrape waits at most
        # CHECK_TIMEOUT_S for them).
        await readiness.checks()
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks one) as (host, port);
    :class:`ValueError` saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--health-listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9478")
    return host.strip("[]"), int(port)


class HealthServer:
    """Runs :func:`health_app` on one TCP address."""

    def __init__(self, listen: str, readiness: Readiness, registry: CollectorRegistry) -> None:
        self._host, self._port = parse_listen(listen)
        self._runner = web.AppRunner(health_app(readiness, registry), access_log=None)
        self.address: tuple[str, int] | None = None

    async def start(self) -> None:
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        await web.SockSite(self._runner, sock).start()
        host, port = sock.getsockname()[:2]
        self.address = (str(host), int(port))
        log.info("health listener up", extra={"listen": f"{host}:{port}"})

    async def stop(self) -> None:
        await self._runner.cleanup()
