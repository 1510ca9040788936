"""Every reason the plugin's ``/readyz`` gives, in one place.

A failing check's text starts with one of these (the details follow after ": "), so that an
operator, an alert rule or a test can tell the causes apart by the words before the first
colon. docs/kubernetes.md, "Reading the plugin's /readyz", explains each of them and what to
do; tests/kubeplugin/test_readiness_reasons.py holds the two together, so a reason added here
without its paragraph there fails the tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """One cause: the ``/readyz`` key it appears under (``checks.<key>`` or
    ``warnings.<key>``) and the words it starts with."""

    where: str
    text: str

    def __str__(self) -> str:
        return self.text

    def says(self, detail: str = "") -> str:
        """The reason with its details (``text: detail``)."""
        return f"{self.text}: {detail}" if detail else self.text


# -- checks.registered (servers.RegistrationState) ------------------------------------------
NOT_CALLED = Reason("checks.registered", "kubelet has not called GetInfo yet")
NOT_CONFIRMED = Reason("checks.registered",
                       "kubelet called GetInfo but has not confirmed the registration")
REGISTRATION_REFUSED = Reason("checks.registered", "kubelet refused the registration")

# -- checks.agent (agent_client.AgentClient.readiness) --------------------------------------
AGENT_UNREACHABLE = Reason("checks.agent", "agent unreachable")
AGENT_TOKEN_REFUSED = Reason("checks.agent", "agent token refused")
AGENT_TOKEN_FILE = Reason("checks.agent", "agent token file unusable")
AGENT_NOT_READY = Reason("checks.agent", "agent not ready")

# -- checks.api_server (health.Readiness, credentials.ApiCredential) ------------------------
API_UNREACHABLE = Reason("checks.api_server", "API server unreachable")
API_CREDENTIAL_REFUSED = Reason("checks.api_server", "API server credential refused")
NODE_CREDENTIAL_DEAD = Reason("checks.api_server", "Node-bound credential dead")
NODE_NOT_FOUND = Reason("checks.api_server", "Node not found on the API server")

# -- checks.slices (publisher.ResourceSlicePublisher.health) --------------------------------
SLICES_NOT_IN_SYNC = Reason("checks.slices", "slices not in sync")
POOL_DELETED = Reason("checks.slices", "agent unreachable for more than")
AGENT_NOT_ANSWERING = Reason("checks.slices", "agent not answering")
NO_SLICES_YET = Reason("checks.slices", "no slices from the agent yet")
NOT_PUBLISHED_YET = Reason("checks.slices", "slices not published yet")
FIELDS_DROPPED = Reason("checks.slices", "the API server dropped written fields")
AGENT_SLICES_UNUSABLE = Reason("checks.slices", "agent slices unusable")
#: The publisher's API server calls, each named in a failure that is being retried.
CALL_SERVER_VERSION = Reason("checks.slices", "server version")
CALL_WATCH = Reason("checks.slices", "watch resourceslices")
CALL_TAINT_PROBE = Reason("checks.slices", "probe device taints")
CALL_PUBLISH = Reason("checks.slices", "publish resourceslices")

# -- any check (health.Readiness) -----------------------------------------------------------
NO_ANSWER = Reason("checks.*", "no answer within")

# -- warnings: reported, never failing readiness --------------------------------------------
STATUS_UNSUPPORTED = Reason("warnings.claim_status",
                            "the API server does not keep ResourceClaim status.devices")
STATUS_PENDING = Reason("warnings.claim_status", "device status of")
TAINTS_UNKNOWN = Reason("warnings.taints",
                        "not known yet whether the API server keeps device taints")
TAINTS_BLOCKING_ONLY = Reason("warnings.taints",
                              "the API server refuses informational device taints")
TAINTS_NONE = Reason("warnings.taints", "the API server keeps no device taints")
SLOT_NOT_WRITTEN = Reason("warnings.compute_domain_slot", "compute-domain slot not written")

#: Every reason, in the order the docs list them.
ALL: tuple[Reason, ...] = tuple(value for value in dict(globals()).values()
                                if isinstance(value, Reason))


def classify(where: str, text: str) -> Reason | None:
    """The reason ``text`` (found under ``where``) is one of, or None: an undocumented one."""
    found = [r for r in ALL if r.where in (where, "checks.*") and text.startswith(r.text)]
    return max(found, key=lambda r: len(r.text)) if found else None
