"""The gateway's periodic jobs run at the cluster file's intervals; flags only override.

The installed unit passes no interval flag, so `gateway.discover_every`, `health_every`
and `flush_every` are what an operator changes them with.
"""

from __future__ import annotations

import pytest

from llmgw_cli.cli.gateway import interval_flags
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.errors import SpecError
from llmgw_cli.gateway.control.state import job_intervals

FILE = "cluster: {name: t}\ngateway: {discover_every: 1m, health_every: 500ms, flush_every: 30s}\n"


def test_the_cluster_file_sets_the_intervals_and_they_default_as_before() -> None:
    gateway = parse_cluster(FILE).gateway
    assert (gateway.discover_every, gateway.health_every, gateway.flush_every) == (60.0, 0.5, 30.0)
    defaults = parse_cluster("cluster: {name: t}\n").gateway
    assert (defaults.discover_every, defaults.health_every, defaults.flush_every) == (15.0, 2.0, 5.0)
    with pytest.raises(SpecError) as zero:
        parse_cluster("cluster: {name: t}\ngateway: {flush_every: 0s}\n")
    assert [str(p) for p in zero.value.problems] == [
        "cluster.yaml:2:24: gateway.flush_every: Input should be greater than 0 (got '0s')"
    ]


def test_a_gateway_started_without_flags_takes_the_files_intervals() -> None:
    """What `llmgw gateway run` gives the Gateway (interval_flags) and what the Gateway
    makes of it with the cluster file (job_intervals, at start and at every reload)."""
    gateway = parse_cluster(FILE).gateway
    no_flags = interval_flags(None, None, None, fixed_replicas=False)
    assert job_intervals(gateway, **no_flags) == {"discover": 60.0, "health": 0.5, "flush": 30.0}


def test_a_flag_overrides_its_interval_only() -> None:
    gateway = parse_cluster(FILE).gateway
    flags = interval_flags(None, 0.2, None, fixed_replicas=False)
    assert job_intervals(gateway, **flags) == {"discover": 60.0, "health": 0.2, "flush": 30.0}


def test_a_fixed_replica_list_is_probed_hourly_unless_a_flag_says_otherwise() -> None:
    gateway = parse_cluster(FILE).gateway
    assert (
        job_intervals(gateway, **interval_flags(None, None, None, fixed_replicas=True))["discover"] == 3600.0
    )
    assert job_intervals(gateway, **interval_flags(7.0, None, None, fixed_replicas=True))["discover"] == 7.0
