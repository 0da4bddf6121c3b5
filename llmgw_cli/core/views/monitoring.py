"""Monitoring files for a cluster (pure): a Prometheus configuration that scrapes the
gateway, alert rules on the gateway's metrics (``gateway/serving/metrics.py``, ``fleet.py``),
and a Grafana dashboard over them with its provisioning files (``core/views/grafana.py``).

The alerts:
- ``LlmgwGatewayDown``: Prometheus cannot scrape the gateway;
- ``LlmgwNodeNotReporting``: a node's last probe failed, or its last good probe is old;
- ``LlmgwModelNotServing``: a model with ``scaling.min >= 1`` has no replica in rotation;
- ``LlmgwGpuFaulty``: a card is kept out of placement by a fault (one alert per card and
  cause: nvidia-smi's health fields, a fatal XID in the kernel log, a card off the bus);
- ``LlmgwReplicaIdle``: a replica holds GPUs nobody has asked for (its model's
  ``idle_timeout``, or 30 minutes without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.views.grafana import DEFAULT_PROMETHEUS_URL, grafana_files

PROMETHEUS_FILE = "prometheus.yml"
RULES_FILE = "llmgw-alerts.yml"
JOB = "llmgw"
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True)
class Thresholds:
    """How long a condition must hold before it alerts, in seconds."""

    probe_stale: float = 120.0  # a node's last good probe older than this (it probes every 15 s)
    node_for: float = 300.0
    model_for: float = 300.0
    fault_for: float = 60.0  # a fatal fault does not heal itself: the operator acts
    idle_for: float = 900.0  # on top of the idle time that makes a replica idle
    scrape_interval: float = 15.0


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m" if s % 60 == 0 and s >= 60 else f"{s}s"


def scrape_target(spec: ClusterSpec, gateway_host: str | None = None) -> tuple[str, bool]:
    """``host:port`` Prometheus scrapes on ``gateway_host`` (None: ``gateway.host``), and
    whether it is the admin listener (needs a key).

    ``metrics_listen`` when set, else the admin listener. A wildcard listen address is
    reached at the gateway host (a node's address when it names a node)."""
    settings = spec.gateway
    gateway_host = gateway_host or settings.host
    listen, admin = (
        (settings.metrics_listen, False) if settings.metrics_listen else (settings.admin_listen, True)
    )
    host, _, port = listen.rpartition(":")
    if host in WILDCARD_HOSTS:
        node = next((n for n in spec.nodes if n.name == gateway_host), None)
        host = node.address if node else gateway_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
    return f"{host}:{port}", admin


def scrape_targets(spec: ClusterSpec) -> list[str]:
    """``scrape_target`` of every gateway host (``gateway.all_hosts``), each once."""
    return list(dict.fromkeys(scrape_target(spec, h)[0] for h in spec.gateway.all_hosts))


def prometheus_config(
    spec: ClusterSpec, admin_key_file: str, thresholds: Thresholds = Thresholds()
) -> dict[str, object]:
    """``prometheus.yml``: scrape the gateway on every gateway host, load the alert rules
    beside it."""
    _, admin = scrape_target(spec)
    job: dict[str, object] = {
        "job_name": JOB,
        "metrics_path": "/metrics",
        "static_configs": [{"targets": scrape_targets(spec)}],
    }
    if admin:
        # No metrics_listen: the admin listener serves /metrics, behind an admin key.
        job["authorization"] = {"type": "Bearer", "credentials_file": admin_key_file}
    interval = _duration(thresholds.scrape_interval)
    return {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "external_labels": {"cluster": spec.cluster.name},
        },
        "rule_files": [RULES_FILE],
        "scrape_configs": [job],
    }


def _alert(
    name: str, expr: str, hold: float, severity: str, *, summary: str, description: str
) -> dict[str, object]:
    return {
        "alert": name,
        "expr": expr,
        "for": _duration(hold),
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def alert_rules(thresholds: Thresholds = Thresholds()) -> dict[str, object]:
    """The alert rules file (one group)."""
    t = thresholds
    rules = [
        _alert(
            "LlmgwGatewayDown",
            f'up{{job="{JOB}"}} == 0',
            120,
            "critical",
            summary="The llmgw gateway cannot be scraped",
            description="Prometheus cannot scrape {{ $labels.instance }}: the gateway is down, still starting "
            "(503 until its first probe), or the address is wrong.",
        ),
        _alert(
            "LlmgwNodeNotReporting",
            f"llmgw_node_up == 0 or llmgw_node_last_probe_age_seconds > {t.probe_stale:g}",
            t.node_for,
            "warning",
            summary="Node {{ $labels.node }} has stopped reporting",
            description="The gateway's probes of {{ $labels.node }} fail or are stale; `llmgw status` shows why.",
        ),
        _alert(
            "LlmgwModelNotServing",
            "llmgw_model_min_replicas >= 1 and on (model) llmgw_model_ready_replicas == 0",
            t.model_for,
            "critical",
            summary="Model {{ $labels.model }} should be serving and is not",
            description="{{ $labels.model }} promises scaling.min >= 1 but no replica is in rotation.",
        ),
        _alert(
            "LlmgwGpuFaulty",
            "llmgw_gpu_fault == 1",
            t.fault_for,
            "warning",
            summary="GPU {{ $labels.gpu }} on {{ $labels.node }} is out of placement: {{ $labels.cause }}",
            description="The gateway's probe finds GPU {{ $labels.gpu }} on {{ $labels.node }} faulty "
            "({{ $labels.cause }}) and replaces the replicas on it; `llmgw doctor` says what the fault "
            "means and what to do (drain and reset the GPU, reboot the node, or replace the card).",
        ),
        _alert(
            "LlmgwReplicaIdle",
            "llmgw_replica_idle == 1",
            t.idle_for,
            "info",
            summary="A replica of {{ $labels.model }} holds GPUs nobody is asking for",
            description="{{ $labels.model }} at {{ $labels.address }} has had no request for its idle time; "
            "consider a lower scaling.min or an idle_timeout.",
        ),
    ]
    return {"groups": [{"name": "llmgw", "rules": rules}]}


def monitoring_files(
    spec: ClusterSpec,
    admin_key_file: str = "/etc/prometheus/llmgw-admin.key",
    thresholds: Thresholds = Thresholds(),
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
) -> dict[str, str]:
    """Relative path -> text: the Prometheus configuration, the alert rules, and under
    ``grafana/`` the dashboard and its provisioning (a datasource at ``prometheus_url``)."""
    header = f"# Generated by `llmgw render monitoring` for cluster {spec.cluster.name}.\n"

    def dump(data: dict[str, object]) -> str:
        return header + yaml.safe_dump(data, sort_keys=False, width=1000)

    return {
        PROMETHEUS_FILE: dump(prometheus_config(spec, admin_key_file, thresholds)),
        RULES_FILE: dump(alert_rules(thresholds)),
        **grafana_files(spec.cluster.name, JOB, _duration(thresholds.scrape_interval), prometheus_url),
    }
