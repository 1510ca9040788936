"""What calling the agent can go wrong with, as the plugin tells kubelet apart: not ready yet
(retry soon), not there at all, or an answer refusing the request."""

from __future__ import annotations

from typing import Any


class AgentCallError(Exception):
    """Any failed call to the agent; ``retryable`` says whether the same call may succeed
    later without anything else changing."""

    retryable = False


class AgentNotReady(AgentCallError):
    """The agent answered 503 (starting, recovering, device nodes not there yet): ask again in
    ``retry_after_s`` seconds."""

    retryable = True

    def __init__(self, retry_after_s: float, detail: str = "agent not ready",
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s
        self.detail = detail
        self.problem = problem or {}

    @property
    def kind(self) -> str:
        """The problem type's last part (``not-ready``, ``device-nodes-missing``)."""
        return str(self.problem.get("type", "")).rstrip("/").rpartition("/")[2] or "not-ready"


class AgentUnreachable(AgentCallError):
    """No answer: the socket is missing, refused the connection, or the call timed out."""

    retryable = True

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AgentRefused(AgentCallError):
    """The agent answered with an error status other than 503; ``problem`` is its RFC 9457
    body (``type``, ``title``, ``detail`` and the error's fields)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        super().__init__(self.detail)

    @property
    def detail(self) -> str:
        return str(self.problem.get("detail") or self.problem.get("title")
                   or f"HTTP {self.status}")

    @property
    def kind(self) -> str:
        """The problem type's last part (``claim-unprepared``, ``device-busy``, ...)."""
        return str(self.problem.get("type", "")).rstrip("/").rpartition("/")[2] \
            or f"http-{self.status}"


class TokenFileError(AgentCallError):
    """The token file is missing, empty, or readable by group or others (a credential the
    plugin refuses to use)."""
