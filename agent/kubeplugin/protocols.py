"""What the plugin process needs from the Kubernetes side, as Protocols: the concrete classes
(``agent/kubeplugin/kube.py``'s ``KubeClient``, ``publisher.py``'s ``ResourceSlicePublisher``) are
plugged in by ``agent.kubeplugin.process.wire_kubernetes``, and the tests plug in fakes."""

from __future__ import annotations

from typing import Any, Protocol


class ClaimReader(Protocol):
    """Reads ResourceClaims from the API server."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim as the server's JSON (``metadata``, ``status.allocation``).
        A claim that does not exist raises :class:`LookupError` or an error whose ``status``
        attribute is 404 (kubernetes-asyncio's ``ApiException``); anything else raised is an
        API server failure."""
        ...


class ApiServer(Protocol):
    """Whether the API server answers (the plugin's readiness)."""

    async def server_version(self) -> tuple[int, int]:
        """The server's (major, minor); raises when it cannot be reached."""
        ...


class SyncState(Protocol):
    """The publisher's health (``PublisherHealth``): in sync, or why not."""

    @property
    def in_sync(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def withheld(self) -> str | None: ...


class Publisher(Protocol):
    """Keeps the API server's ResourceSlices of this node equal to the agent's."""

    async def run(self) -> None:
        """Publish until cancelled."""
        ...

    def health(self) -> SyncState:
        ...
