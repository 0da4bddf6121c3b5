"""Findings that need more than one node (clock skew) or only the cluster file (the
gateway's upstream timeouts), and ``diagnose``, which runs every check."""

from __future__ import annotations

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.doctor.checks import check_node
from llmgw_cli.core.doctor.facts import SEVERITY_ORDER, Collected, Finding, Severity

SKEW_WARNING = 2.0  # seconds: logs and usage records of nodes and gateway stop lining up
SKEW_ERROR = 300.0  # TLS certificates and signed download URLs are judged by the node's clock
FIRST_BYTE_ERROR = 120.0  # a non-streamed 4k-token answer at ~35 tokens/s takes ~2 minutes
FIRST_BYTE_WARNING = 300.0
IDLE_WARNING = 30.0  # a stream's first chunk waits for the whole prefill of a long prompt


def offset_bounds(c: Collected) -> tuple[float, float] | None:
    """Bounds of (node clock - this host's clock): the node read its clock at some moment
    between sending and receiving, so a node in sync reads a time inside that window."""
    if c.doctor.clock_end is None:
        return None
    return c.doctor.clock_end - c.received_at, c.doctor.clock_end - c.sent_at


def skew(bounds: tuple[float, float]) -> float:
    """The smallest skew consistent with the bounds: 0 when the window contains no skew."""
    low, high = bounds
    if low > 0:
        return low
    if high < 0:
        return high
    return 0.0


def check_clocks(spec: ClusterSpec, collected: list[Collected]) -> list[Finding]:
    """Each node's clock against the gateway's: the gateway node when ``gateway.host`` is a
    node that was checked, else this host (run doctor on the gateway host)."""
    bounds = {c.facts.node: b for c in collected if c.facts.reachable and (b := offset_bounds(c))}
    reference = "this host"
    ref_low = ref_high = 0.0
    if spec.gateway.host in bounds:
        reference = f"gateway node {spec.gateway.host}"
        ref_low, ref_high = bounds[spec.gateway.host]
    findings = []
    for node, (low, high) in bounds.items():
        if node == spec.gateway.host:
            continue
        seconds = skew((low - ref_high, high - ref_low))
        if abs(seconds) < SKEW_WARNING:
            continue
        way = "ahead of" if seconds > 0 else "behind"
        findings.append(
            Finding(
                node=node,
                check="clock.skew",
                severity=Severity.error if abs(seconds) >= SKEW_ERROR else Severity.warning,
                message=f"clock is at least {abs(seconds):.1f} s {way} {reference}",
                fix="run a time daemon on every node and the gateway host "
                "(`timedatectl set-ntp true`, chrony or systemd-timesyncd)",
            )
        )
    return findings


def check_gateway_timeouts(spec: ClusterSpec) -> list[Finding]:
    """The 60-second trap: a non-streamed answer arrives whole, so the gateway's
    ``timeouts.first_byte`` is the longest non-streamed generation; a short one cuts long
    answers with a 504 while the engine keeps generating."""
    t = spec.gateway.timeouts
    findings = []
    if t.first_byte < FIRST_BYTE_WARNING:
        findings.append(
            Finding(
                node=None,
                check="gateway.first-byte-timeout",
                severity=Severity.error if t.first_byte < FIRST_BYTE_ERROR else Severity.warning,
                message=f"gateway.timeouts.first_byte is {t.first_byte:g} s: a non-streamed generation "
                "longer than that is cut (504) while the engine keeps working",
                fix="set gateway.timeouts.first_byte to 600 (the default) or more; a proxy in front of "
                "the gateway needs the same (nginx proxy_read_timeout defaults to 60 s)",
            )
        )
    if t.idle < IDLE_WARNING:
        findings.append(
            Finding(
                node=None,
                check="gateway.idle-timeout",
                severity=Severity.warning,
                message=f"gateway.timeouts.idle is {t.idle:g} s: a stream whose first chunk waits for a "
                "long prompt's prefill, or for a busy engine, is cut",
                fix="set gateway.timeouts.idle to 120 (the default) or more",
            )
        )
    return findings


def diagnose(spec: ClusterSpec, collected: list[Collected]) -> list[Finding]:
    """Every finding for the collected nodes and the cluster file, by node (in the file's
    order, the gateway's first) and severity."""
    nodes = {n.name: n for n in spec.nodes}
    findings = check_gateway_timeouts(spec)
    for c in collected:
        findings += check_node(spec, nodes[c.facts.node], c)
    findings += check_clocks(spec, collected)
    order = {name: i for i, name in enumerate(nodes)}
    return sorted(
        findings, key=lambda f: (-1 if f.node is None else order.get(f.node, 0), SEVERITY_ORDER[f.severity])
    )
