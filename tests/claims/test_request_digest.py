"""A request's digest is what tells a retry from another prepare: fields added later stay out
of it while unset, so claims recorded by an older agent keep their digest after an upgrade."""

from __future__ import annotations

import pytest

from agent.claims.requests import DeviceRequest, digest


@pytest.mark.parametrize(("request_", "recorded"), [
    # Digests as the agent before IMEX channels recorded them.
    (DeviceRequest(request="gpu", kind="gpu", device="gpu-0"),
     "1ca4b4f9fe3acc56091b5ca640205639"),
    (DeviceRequest(request="s", kind="slice", profile="1g.10gb", gpu="0", start=2),
     "152842d83e9c8b2d4ca764093558a625"),
])
def test_requests_without_a_domain_keep_their_recorded_digest(request_: DeviceRequest,
                                                              recorded: str) -> None:
    assert digest([request_]) == recorded


def test_a_channel_of_another_domain_is_another_request() -> None:
    one = digest([DeviceRequest(request="c", kind="imex-channel", domain="job-1")])
    assert one == digest([DeviceRequest(request="c", kind="imex-channel", domain="job-1")])
    assert one != digest([DeviceRequest(request="c", kind="imex-channel", domain="job-2")])
