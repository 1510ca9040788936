"""A client of kubelet's PodResources v1 API (``v1.PodResourcesLister``) on its Unix socket,
over grpc.aio with the stubs generated from ``proto/podresources_v1.proto``.

It needs the ``kubernetes`` extra (grpcio, protobuf); the agent imports this module only
when ``--pod-resources-socket`` is given, and settings refuse that flag without grpcio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from agent.podresources.holders import ContainerHolding, DraDevice
from agent.podresources.proto import podresources_v1_pb2 as pb
from agent.podresources.proto import podresources_v1_pb2_grpc as pb_grpc

#: Kubelet's own socket path (pkg/kubelet/apis/podresources: <root>/pod-resources/kubelet.sock).
DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
#: A node with many pods answers more than gRPC's 4 MiB default (dcgm-exporter #509 failed its
#: scrapes on a 4.75 MB answer); 64 MiB is far beyond any node's pod count.
MAX_MESSAGE_BYTES = 64 << 20


class PodResourcesError(Exception):
    """Kubelet did not answer in time, or answered an error."""


class PodResourcesClient:
    """One channel to kubelet, opened on first use and kept; every call has a deadline."""

    def __init__(self, socket: Path, *, timeout_s: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel: Any = None
        self._stub: Any = None

    def _lister(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket.absolute()}",
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                         # A kubelet restart (or a kubelet started after the agent) is seen
                         # within seconds, not after gRPC's default backoff of up to 2 min.
                         ("grpc.initial_reconnect_backoff_ms", 250),
                         ("grpc.min_reconnect_backoff_ms", 250),
                         ("grpc.max_reconnect_backoff_ms", 2000)])
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def list(self) -> list[ContainerHolding]:
        """Every container of every pod kubelet lists, with what it holds."""
        try:
            reply = await self._lister().List(pb.ListPodResourcesRequest(),
                                              timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise PodResourcesError(f"PodResources List on {self.socket}: "
                                    f"{err.code().name}: {err.details()}") from err
        return [holding for pod in reply.pod_resources for holding in _containers(pod)]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None


def _containers(pod: Any) -> list[ContainerHolding]:
    found = []
    for container in pod.containers:
        ids = tuple(i for devices in container.devices for i in devices.device_ids)
        dra = tuple(DraDevice(claim_namespace=resource.claim_namespace,
                              claim_name=resource.claim_name, driver=claimed.driver_name,
                              pool=claimed.pool_name, device=claimed.device_name)
                    for resource in container.dynamic_resources
                    for claimed in resource.claim_resources)
        found.append(ContainerHolding(namespace=pod.namespace, pod=pod.name,
                                      container=container.name, device_ids=ids, dra=dra))
    return found
