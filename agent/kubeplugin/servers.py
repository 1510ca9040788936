"""The two gRPC servers kubelet talks to (grpc.aio): registration on
``<registry-dir>/<driver>-reg.sock``; the DRA service, v1 and v1beta1, and the DRA health
stream, v1 and v1alpha1 (:mod:`agent.kubeplugin.health_stream`), on
``<plugins-dir>/<driver>/dra.sock``.

The DRA socket is listening before the registration socket appears, because kubelet's plugin
watcher dials the endpoint as soon as it has called ``GetInfo``; at shutdown the registration
socket goes first, so kubelet deregisters the plugin before its endpoint closes, then the
health streams end cleanly, then the DRA service.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeAlias

import grpc

from agent.kubeplugin import reasons
from agent.kubeplugin.claims import KubeletClaim
from agent.kubeplugin.dra import DraService, arrival_ns
from agent.kubeplugin.health_stream import HealthStreams, as_messages
from agent.kubeplugin.metrics import PluginMetrics
from agent.kubeplugin.proto import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)

log = logging.getLogger("agent.kubeplugin.grpc")

#: The services on the DRA socket. Kubelet picks the first DRAPlugin entry it supports: v1
#: (1.34+), then v1beta1 (1.32-1.33 kubelets), and skips names it does not know. The health
#: service is optional: 1.37 streams the first of these two it supports (1.34 calls v1alpha1
#: whenever its gate is on, listed or not); a kubelet without it ignores both.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin",
                      "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
PLUGIN_TYPE = "DRAPlugin"
#: sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH = 107


class SocketPathError(Exception):
    """A socket path is taken by something that is not a socket, or cannot be created."""


def prepare_socket(path: Path) -> None:
    """Create the socket's directory and remove a stale socket a previous plugin left (its
    process is gone: nothing accepts on it). A socket something still accepts on (another
    plugin for the same driver), or anything that is not a socket, is refused, not removed."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketPathError(f"{path}: longer than the {MAX_SOCKET_PATH} bytes a Unix socket "
                              "path may have")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as err:
        raise SocketPathError(f"{path}: {err.strerror}") from err
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        pass  # refused: stale
    else:
        raise SocketPathError(f"{path}: another process is serving on it (a second plugin "
                              "for this driver?)")
    finally:
        probe.close()
    path.unlink()
    log.info("removed a stale socket", extra={"path": str(path)})


def remove_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except OSError:
        pass  # already gone


@dataclass
class RegistrationState:
    """What kubelet last said about the registration (``NotifyRegistrationStatus``)."""

    registered: bool = False
    error: str | None = None
    info_calls: int = 0
    notified_at: float | None = None

    @property
    def reason(self) -> str | None:
        """Why the plugin is not registered, or None."""
        if self.registered:
            return None
        if self.error:
            return reasons.REGISTRATION_REFUSED.says(self.error)
        if self.info_calls:
            return reasons.NOT_CONFIRMED.says()
        return reasons.NOT_CALLED.says()


class RegistrationServicer:
    """``pluginregistration.Registration``: who the plugin is, and kubelet's verdict."""

    def __init__(self, driver: str, endpoint: Path, state: RegistrationState,
                 metrics: PluginMetrics) -> None:
        self._info = registration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=str(endpoint),
            supported_versions=list(SUPPORTED_VERSIONS))
        self._state = state
        self._metrics = metrics

    async def GetInfo(self, request: registration_pb2.InfoRequest,
                      context: grpc.aio.ServicerContext) -> registration_pb2.PluginInfo:
        self._state.info_calls += 1
        return self._info

    async def NotifyRegistrationStatus(
            self, request: registration_pb2.RegistrationStatus,
            context: grpc.aio.ServicerContext,
    ) -> registration_pb2.RegistrationStatusResponse:
        self._state.registered = request.plugin_registered
        self._state.error = request.error or None
        self._state.notified_at = time.time()
        self._metrics.registered.set(1 if request.plugin_registered else 0)
        if request.plugin_registered:
            log.info("registered with kubelet", extra={"driver": self._info.name})
        else:
            log.error("kubelet refused the registration",
                      extra={"driver": self._info.name, "error": request.error})
        return registration_pb2.RegistrationStatusResponse()


class ClaimMessage(Protocol):
    """A ``Claim`` of either version's requests (the fields are the same)."""

    namespace: str
    uid: str
    name: str


class ClaimsRequest(Protocol):
    """``NodePrepareResourcesRequest`` or ``NodeUnprepareResourcesRequest``, v1 or v1beta1."""

    @property
    def claims(self) -> Iterable[ClaimMessage]: ...


PrepareResponse: TypeAlias = (dra_v1_pb2.NodePrepareResourcesResponse
                              | dra_v1beta1_pb2.NodePrepareResourcesResponse)
UnprepareResponse: TypeAlias = (dra_v1_pb2.NodeUnprepareResourcesResponse
                                | dra_v1beta1_pb2.NodeUnprepareResourcesResponse)


def _claims(messages: Iterable[ClaimMessage]) -> list[KubeletClaim]:
    return [KubeletClaim(namespace=c.namespace, uid=c.uid, name=c.name) for c in messages]


class DraServicer:
    """``DRAPlugin`` for one version's messages (``pb2``: ``dra_v1_pb2`` or
    ``dra_v1beta1_pb2``; the wire is the same)."""

    def __init__(self, service: DraService, pb2: ModuleType,
                 streams: HealthStreams | None = None) -> None:
        self._service = service
        self._streams = streams
        self._prepare_response: type[PrepareResponse] = pb2.NodePrepareResourcesResponse
        self._unprepare_response: type[UnprepareResponse] = pb2.NodeUnprepareResourcesResponse

    async def NodePrepareResources(self, request: ClaimsRequest,
                                   context: grpc.aio.ServicerContext) -> PrepareResponse:
        issued_at_ns = arrival_ns()  # first, before any await: the call's ordering stamp
        try:
            results = await self._service.prepare(_claims(request.claims), issued_at_ns)
        finally:
            self._claims_changed()
        answer = self._prepare_response()
        for uid, result in results.items():
            entry = answer.claims[uid]
            if result.error is not None:
                entry.error = result.error
                continue
            for d in result.devices:
                device = entry.devices.add(
                    request_names=list(d.request_names), pool_name=d.pool_name,
                    device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids))
                # v1 has the share ID (field 5, from Kubernetes 1.35); v1beta1 has none.
                if d.share_id is not None and isinstance(device, dra_v1_pb2.Device):
                    device.share_id = d.share_id
        return answer

    async def NodeUnprepareResources(self, request: ClaimsRequest,
                                     context: grpc.aio.ServicerContext) -> UnprepareResponse:
        issued_at_ns = arrival_ns()  # first, before any await
        try:
            results = await self._service.unprepare(_claims(request.claims), issued_at_ns)
        finally:
            self._claims_changed()
        answer = self._unprepare_response()
        for uid, error in results.items():
            answer.claims[uid].error = error or ""
        return answer

    def _claims_changed(self) -> None:
        # Also when kubelet stopped waiting (the claims' work goes on): the next report
        # reads the agent's claims again either way.
        if self._streams is not None:
            self._streams.claims_changed()


HealthResponse: TypeAlias = (dra_health_v1_pb2.NodeWatchResourcesResponse
                             | dra_health_v1alpha1_pb2.NodeWatchResourcesResponse)


class HealthServicer:
    """``DRAResourceHealth`` for one version's messages (``pb2``: ``dra_health_v1_pb2`` or
    ``dra_health_v1alpha1_pb2``; the wire is the same)."""

    def __init__(self, streams: HealthStreams, pb2: ModuleType) -> None:
        self._streams = streams
        self._pb2 = pb2

    async def NodeWatchResources(self, request: object, context: grpc.aio.ServicerContext,
                                 ) -> AsyncIterator[HealthResponse]:
        async for reports in self._streams.reports():
            message: HealthResponse = as_messages(reports, self._pb2)
            yield message


class PluginServers:
    """Both gRPC servers, started and stopped in kubelet's order."""

    def __init__(self, service: DraService, *, driver: str, registry_dir: Path,
                 plugins_dir: Path, registration: RegistrationState,
                 metrics: PluginMetrics, health: HealthStreams) -> None:
        self.registration_socket = registry_dir / f"{driver}-reg.sock"
        self.dra_socket = plugins_dir / driver / "dra.sock"
        self.health = health
        self._dra = grpc.aio.server()
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(
            DraServicer(service, dra_v1_pb2, health), self._dra)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
            DraServicer(service, dra_v1beta1_pb2, health), self._dra)
        dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
            HealthServicer(health, dra_health_v1_pb2), self._dra)
        dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
            HealthServicer(health, dra_health_v1alpha1_pb2), self._dra)
        self._registration = grpc.aio.server()
        registration_pb2_grpc.add_RegistrationServicer_to_server(
            RegistrationServicer(driver, self.dra_socket, registration, metrics),
            self._registration)
        self._bound: list[Path] = []

    async def start(self) -> None:
        for path in (self.dra_socket, self.registration_socket):
            prepare_socket(path)
        self.health.start()
        await self._listen(self._dra, self.dra_socket)
        await self._listen(self._registration, self.registration_socket)
        log.info("serving kubelet", extra={"registration": str(self.registration_socket),
                                           "endpoint": str(self.dra_socket)})

    async def _listen(self, server: grpc.aio.Server, path: Path) -> None:
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as err:
            raise SocketPathError(f"cannot listen on {path}: {err}") from err
        self._bound.append(path)
        await server.start()

    async def stop(self, grace_s: float) -> None:
        """Stop registration first (kubelet deregisters), end the health streams, then stop
        the DRA service after letting calls in progress finish for up to ``grace_s``; both
        socket files are removed."""
        await self._registration.stop(None)
        if self.registration_socket in self._bound:
            remove_socket(self.registration_socket)
        await self.health.close()
        await self._dra.stop(grace_s)
        if self.dra_socket in self._bound:
            remove_socket(self.dra_socket)
        self._bound = []
