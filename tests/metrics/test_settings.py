"""The metrics settings: --collect-interval (fractions allowed, bounded), --metrics-listen and
--metrics-hostname-label, from flags, environment or the config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import InvalidRequest
from agent.settings import Listener, resolve


def test_defaults() -> None:
    settings = resolve({"simulate": "dgx-h100"}, env={})
    assert settings.collect_interval_s == 5.0
    assert settings.metrics_listen is None
    assert settings.metrics_hostname_label == "Hostname"


def test_flags_environment_and_config(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('collect-interval = 2.5\nmetrics-listen = "0.0.0.0:9400"\n')
    settings = resolve({"config": str(config)},
                       env={"GPU_AGENT_METRICS_HOSTNAME_LABEL": "hostname"})
    assert settings.collect_interval_s == 2.5
    assert settings.metrics_listen == Listener(host="0.0.0.0", port=9400)
    assert settings.metrics_hostname_label == "hostname"
    flags = resolve({"config": str(config), "collect_interval": 0.25}, env={})
    assert flags.collect_interval_s == 0.25


@pytest.mark.parametrize(("flags", "env", "field"), [
    ({"collect_interval": 0.0}, {}, "collect_interval"),
    ({"collect_interval": 7200.0}, {}, "collect_interval"),
    ({}, {"GPU_AGENT_COLLECT_INTERVAL": "fast"}, "collect_interval"),
    ({"metrics_listen": "9400"}, {}, "metrics_listen"),
    ({"metrics_hostname_label": "HOSTNAME"}, {}, "metrics_hostname_label"),
])
def test_bad_values_are_rejected_with_the_field(flags: dict[str, object], env: dict[str, str],
                                                field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        resolve(flags, env=env)
    assert raised.value.errors[0]["field"] == field
