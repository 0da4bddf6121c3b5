"""What the Grafana dashboard shows (pure): its rows and panels, each with its PromQL
(``core/views/grafana.py`` lays them out and writes the JSON).

Every expression reads a metric the gateway exports (``gateway/serving/metrics.py``,
``gateway/control/fleet.py``); a test scrapes a real gateway and checks each name. Several
gateway hosts are scraped as several instances: counters are summed over them, while
what every gateway reports alike (the fleet from the probe, a model's replica counts)
is taken once with ``max``. ``$model`` is the dashboard's model picker; its All (the
regular expression ``.*``) also matches ``-``, the requests that named no usable model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RATE = "$__rate_interval"
RANGE = "$__range"
M = 'model=~"$model"'  # the model picker

Json = dict[str, Any]


def ref_id(i: int) -> str:
    """The refId of a panel's ``i``-th query: A, B, C..."""
    return chr(ord("A") + i)


@dataclass(frozen=True)
class Query:
    """One query of a panel: a PromQL expression and its legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A panel before layout: Grafana panel type, size in grid cells, queries."""

    kind: str  # timeseries, stat, table, bargauge
    title: str
    queries: Sequence[Query]
    description: str = ""
    unit: str = "short"
    w: int = 12
    h: int = 8
    instant: bool = False  # the value now (or over the whole range), not a series in time
    bars: bool = False  # counts of events per interval
    transformations: Sequence[Json] = ()


def _quantiles(metric: str, by: str, label: str) -> list[Query]:
    return [
        Query(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{M}}}[{RATE}])))",
            f"{label} p{round(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def _increase(metric: str, by: str, window: str = RATE) -> str:
    return f"sum by ({by}) (increase({metric}{{{M}}}[{window}]))"


def _overview(job: str) -> list[Panel]:
    requests = f"sum(rate(llmgw_requests_total{{{M}}}[{RATE}]))"
    return [
        Panel(
            "stat",
            "Gateways up",
            [Query(f'sum(up{{job="{job}"}})')],
            "Gateway instances Prometheus scrapes successfully.",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "Requests/s",
            [Query(requests)],
            "Requests answered, every status.",
            unit="reqps",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "5xx share",
            [Query(f'sum(rate(llmgw_requests_total{{{M},status=~"5.."}}[{RATE}])) / {requests}')],
            "Share of answers with a 5xx status (no replica, engine errors, timeouts).",
            unit="percentunit",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "Tokens/s",
            [Query(f"sum(rate(llmgw_tokens_total{{{M}}}[{RATE}]))")],
            "Prompt and completion tokens, from the engines' usage.",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "p95 request time",
            [
                Query(
                    f"histogram_quantile(0.95, sum by (le) (rate(llmgw_request_seconds_bucket{{{M}}}[{RATE}])))"
                )
            ],
            "Request to the end of the answer (whole streams).",
            unit="s",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "Models ready",
            [Query(f'sum(max by (model) (llmgw_model_state{{{M},state="ready"}})) or vector(0)')],
            "Models whose controller phase is ready.",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "GPUs used",
            [
                Query(
                    'sum(max by (gpu_class) (llmgw_gpus{state="used"})) '
                    "/ sum(max by (gpu_class, state) (llmgw_gpus))"
                )
            ],
            "Used share of all GPUs (faulty ones count in the total, never as used).",
            unit="percentunit",
            w=3,
            h=4,
        ),
        Panel(
            "stat",
            "Free whole nodes",
            [Query("sum(max by (fabric) (llmgw_fabric_free_nodes))")],
            "Nodes with every card free, over all fabrics: where a multi-node replica can land.",
            w=3,
            h=4,
        ),
    ]


def _traffic() -> list[Panel]:
    return [
        Panel(
            "timeseries",
            "Requests/s by model",
            [Query(f"sum by (model) (rate(llmgw_requests_total{{{M}}}[{RATE}]))", "{{model}}")],
            "`-`: requests that named no usable model or had no valid key.",
            unit="reqps",
        ),
        Panel(
            "timeseries",
            "Answers/s by status",
            [Query(f"sum by (status) (rate(llmgw_requests_total{{{M}}}[{RATE}]))", "{{status}}")],
            "HTTP status of the answers; 499: the client went away first.",
            unit="reqps",
        ),
        Panel(
            "timeseries",
            "Tokens/s by model",
            [Query(f"sum by (model, kind) (rate(llmgw_tokens_total{{{M}}}[{RATE}]))", "{{model}} {{kind}}")],
            "Prompt and completion tokens, from the engines' usage.",
        ),
        Panel(
            "timeseries",
            "Tokens/s by key (top 10)",
            [Query(f"topk(10, sum by (key) (rate(llmgw_tokens_total{{{M}}}[{RATE}])))", "{{key}}")],
            "The ten API keys using the most tokens.",
        ),
    ]


def _latency() -> list[Panel]:
    mean = (
        f"sum by (model) (rate(llmgw_request_seconds_sum{{{M}}}[{RATE}])) "
        f"/ sum by (model) (rate(llmgw_request_seconds_count{{{M}}}[{RATE}]))"
    )
    return [
        Panel(
            "timeseries",
            "Request time",
            [*_quantiles("llmgw_request_seconds", "model", "{{model}}"), Query(mean, "{{model}} mean")],
            "Request to the end of the answer (a stream: its last chunk), from the histogram.",
            unit="s",
        ),
        Panel(
            "timeseries",
            "Time to first token (streams)",
            _quantiles("llmgw_time_to_first_token_seconds", "model", "{{model}}"),
            "Request to the first chunk from the engine; includes waiting for a slot and a start.",
            unit="s",
        ),
        Panel(
            "timeseries",
            "In flight and queued",
            [
                Query(f"sum by (model) (llmgw_in_flight{{{M}}})", "{{model}} in flight"),
                Query(f"sum by (model) (llmgw_queued{{{M}}})", "{{model}} queued"),
            ],
            "Requests holding a slot of the model, and requests waiting for one.",
            w=8,
        ),
        Panel(
            "timeseries",
            "Upstream retries/s",
            [Query(f"sum by (model) (rate(llmgw_upstream_retries_total{{{M}}}[{RATE}]))", "{{model}}")],
            "Requests retried on another replica after a connection failure.",
            unit="reqps",
            w=8,
        ),
        Panel(
            "timeseries",
            "Access log lines dropped/s",
            [Query(f"sum by (instance) (rate(llmgw_access_log_dropped_total[{RATE}]))", "{{instance}}")],
            "Access log lines a gateway dropped: requests came faster than it could write its "
            "log (or stderr did not drain). Serving goes on; those requests have no log line.",
            unit="short",
            w=8,
        ),
    ]


def _models() -> list[Panel]:
    return [
        Panel(
            "table",
            "Model states",
            [Query(f"max by (model, state) (llmgw_model_state{{{M}}})")],
            "The model controller's phase: off, stopped, starting, ready, degraded, failed.",
            w=8,
            instant=True,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
        ),
        Panel(
            "timeseries",
            "Replicas: ready, minimum, running",
            [
                Query(f"max by (model) (llmgw_model_ready_replicas{{{M}}})", "{{model}} ready"),
                Query(f"max by (model) (llmgw_model_min_replicas{{{M}}})", "{{model}} min"),
                Query(f"max by (model) (llmgw_model_running_replicas{{{M}}})", "{{model}} running"),
            ],
            "In rotation; promised by scaling.min; with active units on the nodes (from the probe).",
            w=16,
        ),
        Panel(
            "timeseries",
            "Model loads",
            [Query(_increase("llmgw_model_loads_total", "model, result"), "{{model}} {{result}}")],
            "Starts by the model controller, ended ready (ok) or given up (failed).",
            w=8,
            bars=True,
        ),
        Panel(
            "bargauge",
            "Load time over the range",
            [
                Query(
                    "histogram_quantile(0.95, sum by (model, le) "
                    f"(increase(llmgw_model_load_seconds_bucket{{{M}}}[{RANGE}])))",
                    "{{model}} p95",
                ),
                Query(
                    f"{_increase('llmgw_model_load_seconds_sum', 'model', RANGE)} "
                    f"/ {_increase('llmgw_model_load_seconds_count', 'model', RANGE)}",
                    "{{model}} mean",
                ),
            ],
            "Start to ready (or to giving up), over the dashboard's time range.",
            unit="s",
            w=8,
            instant=True,
        ),
        Panel(
            "bargauge",
            "Controller actions over the range",
            [
                Query(
                    f"sort_desc({_increase('llmgw_controller_actions_total', 'model, action, reason', RANGE)} > 0)",
                    "{{model}} {{action}} ({{reason}})",
                )
            ],
            "Starts, stops, restarts, replacements, evictions and failed starts, by reason.",
            w=8,
            instant=True,
        ),
        Panel(
            "timeseries",
            "Evictions",
            [Query(_increase("llmgw_evictions_total", "model"), "{{model}}")],
            "Idle replicas stopped to make room for another model.",
            w=8,
            bars=True,
        ),
        Panel(
            "timeseries",
            "Scale-outs",
            [Query(_increase("llmgw_scale_outs_total", "model"), "{{model}}")],
            "Extra replicas started because requests waited in the model's queue.",
            w=8,
            bars=True,
        ),
        Panel(
            "timeseries",
            "Idle stops",
            [Query(_increase("llmgw_idle_stops_total", "model"), "{{model}}")],
            "Replicas stopped after their model's idle_timeout.",
            w=8,
            bars=True,
        ),
    ]


def _replicas() -> list[Panel]:
    idle = (
        f"min by (model, address) (llmgw_replica_idle_seconds{{{M}}}) "
        f"and on (model, address) (max by (model, address) (llmgw_replica_idle{{{M}}}) == 1)"
    )
    return [
        Panel(
            "timeseries",
            "Replicas in rotation",
            [Query(f"sum by (model) (max by (model, address) (llmgw_replica_up{{{M}}}))", "{{model}}")],
            "Replicas whose health check passes.",
            w=8,
        ),
        Panel(
            "timeseries",
            "Requests in flight per replica",
            [Query(f"sum by (model, address) (llmgw_replica_outstanding{{{M}}})", "{{model}} {{address}}")],
            "Requests forwarded to the replica and not answered yet.",
            w=8,
        ),
        Panel(
            "table",
            "Idle replicas",
            [Query(idle)],
            "Replicas holding hardware nobody asked for within the model's idle_timeout (or 30 min), "
            "with the time since their last request.",
            unit="s",
            w=8,
            instant=True,
            transformations=[
                {
                    "id": "organize",
                    "options": {"excludeByName": {"Time": True}, "renameByName": {"Value": "idle for"}},
                }
            ],
        ),
    ]


def _routing() -> list[Panel]:
    # Each gateway process reads the engines for itself: the engines' figures are taken
    # once per replica with max, their age with min (the freshest reading).
    def engine(metric: str) -> Query:
        return Query(f"max by (model, address) ({metric}{{{M}}})", "{{model}} {{address}}")

    return [
        Panel(
            "timeseries",
            "Route decisions by reason",
            [Query(_increase("llmgw_route_decisions_total", "model, reason"), "{{model}} {{reason}}")],
            "Why each request went to its replica: affinity (its key's own replica), overloaded "
            "(that one was past a threshold), no_prefix (no key: least loaded), least_load, round_robin.",
            w=8,
            bars=True,
        ),
        Panel(
            "timeseries",
            "Engine queue per replica",
            [engine("llmgw_replica_engine_waiting")],
            "Requests waiting inside each engine, from its /metrics; routing keys move off a "
            "replica past the model's routing.max_waiting.",
            w=8,
        ),
        Panel(
            "timeseries",
            "Engine running per replica",
            [engine("llmgw_replica_engine_running")],
            "Requests each engine is computing, from its /metrics.",
            w=8,
        ),
        Panel(
            "timeseries",
            "Engine KV cache per replica",
            [engine("llmgw_replica_engine_kv_usage")],
            "Share of each engine's KV cache in use (engines that report it).",
            unit="percentunit",
            w=12,
        ),
        Panel(
            "timeseries",
            "Age of the engines' signals",
            [
                Query(
                    f"min by (model, address) (llmgw_replica_signals_age_seconds{{{M}}})",
                    "{{model}} {{address}}",
                )
            ],
            "Since a gateway last read the replica's /metrics; readings older than three "
            "rounds are not used for routing.",
            unit="s",
            w=12,
        ),
    ]


NODE_COLUMNS = (
    ("up", "max by (node) (llmgw_node_up)"),
    ("used", 'max by (node) (llmgw_node_gpus{state="used"})'),
    ("free", 'max by (node) (llmgw_node_gpus{state="free"})'),
    ("faulty", 'max by (node) (llmgw_node_gpus{state="faulty"})'),
    ("NVLink peers", "max by (node) (llmgw_gpu_nvlink_peers)"),
    ("topology known", "max by (node) (llmgw_node_topology_known)"),
    ("model files", "max by (node) (llmgw_node_model_files)"),
    ("last good probe (s)", "min by (node) (llmgw_node_last_probe_age_seconds)"),
)


def _fleet() -> list[Panel]:
    return [
        Panel(
            "timeseries",
            "GPUs by class",
            [Query("max by (gpu_class, state) (llmgw_gpus)", "{{gpu_class}} {{state}}")],
            "Used, free and faulty cards of each GPU class; a faulty card is neither used nor free.",
        ),
        Panel(
            "timeseries",
            "Free whole nodes per fabric",
            [
                Query("max by (fabric) (llmgw_fabric_free_nodes)", "{{fabric}} free"),
                Query("max by (fabric) (llmgw_fabric_nodes)", "{{fabric}} nodes"),
            ],
            "Nodes of the fabric with every card free, and all its nodes.",
        ),
        Panel(
            "table",
            "Nodes",
            [Query(expr) for _, expr in NODE_COLUMNS],
            "From the gateway's probe: reachable, GPUs by state, NVLink peers (0: PCIe only), "
            "model files in the weights directories, seconds since the last good probe.",
            w=24,
            instant=True,
            transformations=[
                {"id": "merge", "options": {}},
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True},
                        "renameByName": {
                            f"Value #{ref_id(i)}": name for i, (name, _) in enumerate(NODE_COLUMNS)
                        },
                    },
                },
            ],
        ),
        Panel(
            "timeseries",
            "Time since the last good probe",
            [Query("min by (node) (llmgw_node_last_probe_age_seconds)", "{{node}}")],
            "The gateway probes every node every 15 s; an old age is a node that stopped answering.",
            unit="s",
        ),
        Panel(
            "timeseries",
            "GPUs used per node",
            [Query('max by (node) (llmgw_node_gpus{state="used"})', "{{node}}")],
            "Cards held by replicas on each reachable node.",
        ),
        Panel(
            "timeseries",
            "Faulty cards",
            [Query("max by (node, gpu, cause) (llmgw_gpu_fault)", "{{node}} GPU {{gpu}}: {{cause}}")],
            "Each card out of placement and why: a fatal XID in the kernel log, uncorrected ECC "
            "errors, a pending or failed row remap, a reset required, or lost from the bus. "
            "`llmgw doctor` says what each means and what to do.",
        ),
    ]


def sections(job: str) -> list[tuple[str, list[Panel]]]:
    """The dashboard's rows, each with its panels in order, for gateways Prometheus
    scrapes in job ``job``."""
    return [
        ("Overview", _overview(job)),
        ("Traffic", _traffic()),
        ("Latency and load", _latency()),
        ("Models", _models()),
        ("Replicas", _replicas()),
        ("Routing", _routing()),
        ("Fleet (from the probe)", _fleet()),
    ]
