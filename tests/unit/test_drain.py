"""The drain marker and the gateway's routing view: what apply and the gateway share."""

from __future__ import annotations

import pytest

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import spec_hash
from llmgw_cli.core.planning.drain import (
    DRAIN_GRACE,
    Routes,
    abandoned,
    drain_seconds,
    marker_path,
    marker_text,
    parse_marker,
    parse_markers,
    parse_routes,
    routes_dir,
    routes_text,
)

from .test_plan import spec as cluster


def test_marker_round_trips_its_deadline() -> None:
    assert parse_marker(marker_text(1764567890.25)) == pytest.approx(1764567890.25)


@pytest.mark.parametrize("text", ["", "nan", "inf", "1 2", "-- 5", "12abc", "1e400"])
def test_a_marker_that_is_not_one_finite_number_is_no_deadline(text: str) -> None:
    assert parse_marker(text) is None


def test_only_replica_unit_names_with_a_deadline_are_read() -> None:
    found = parse_markers(
        [
            ("llmgw-m-0.service", "100\n"),
            ("llmgw-gateway.service", "100\n"),  # not a replica unit
            ("../etc/passwd", "100\n"),
            ("llmgw-m-1.service", "soon"),
            ("llmgw-m-2.service\nInjected=1", "100"),
        ]
    )
    assert found == {"llmgw-m-0.service": 100.0}


def test_marker_path_refuses_what_is_not_a_replica_unit() -> None:
    assert marker_path("llmgw-m-0.service").endswith("/llmgw-m-0.service")
    with pytest.raises(ValueError):
        marker_path("../x-0.service")


def test_abandoned_only_after_the_grace() -> None:
    assert not abandoned(100.0, 100.0 + DRAIN_GRACE)
    assert abandoned(100.0, 100.0 + DRAIN_GRACE + 1)


def test_routes_round_trip() -> None:
    r = Routes(pid=42, written=5.5, ready={"m": frozenset({"10.0.0.1:8100"})}, draining=frozenset({"x:1"}))
    back = parse_routes(routes_text(r))
    assert back == r
    assert back is not None and back.routes("m", "10.0.0.1:8100") and not back.routes("m", "x:1")
    assert routes_dir("/var/lib/llmgw/") == "/var/lib/llmgw/routes"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[]",
        '{"pid": true, "written": 1, "ready": {}, "draining": []}',
        '{"pid": 0, "written": 1, "ready": {}, "draining": []}',
        '{"pid": 3, "written": 1, "ready": {"m": "a"}, "draining": []}',
        '{"pid": 3, "written": 1, "ready": {}, "draining": [1]}',
    ],
)
def test_a_broken_routes_file_is_none(text: str) -> None:
    assert parse_routes(text) is None


def test_drain_bound_per_model_overrides_the_gateway_s_and_replaces_nothing() -> None:
    spec = cluster()
    data = spec.model_dump(mode="json")
    model = spec.models[0]
    assert drain_seconds(spec, model) == spec.gateway.drain_timeout
    data["models"][0]["drain_timeout"] = "5s"
    changed = ClusterSpec.model_validate(data)
    assert drain_seconds(changed, changed.models[0]) == 5.0
    assert spec_hash(changed, changed.models[0]) == spec_hash(spec, model)
