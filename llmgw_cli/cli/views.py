"""Renderables for the CLI. Views never print: they return something rich can render.

Every value that came from a node, a file name or the cluster file goes into a view as a
``Text``, never as a ``str``: rich reads a str cell as markup, so a GPU name or journal
line holding ``[/x]`` would raise MarkupError halfway through a command, and ``[link=...]``
would forge a hyperlink."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmgw_cli.core.clusterfile.quantities import clock
from llmgw_cli.core.clusterfile.spec import ClusterSpec, ScalingMode
from llmgw_cli.errors import Problem

if TYPE_CHECKING:  # what only one command shows is imported by that command (cli/common.py)
    from llmgw_cli.cli.store_access import KeyUse
    from llmgw_cli.core.doctor import Finding
    from llmgw_cli.core.planning.plan import Plan
    from llmgw_cli.core.serving.keys import ApiKey
    from llmgw_cli.core.serving.limits import Limits
    from llmgw_cli.core.views.summary import Summary
    from llmgw_cli.core.weights.fetch import FetchPlan
    from llmgw_cli.gateway.store.sqlite import Usage
    from llmgw_cli.lab.status import NodeStatus
    from llmgw_cli.progress import Row
    from llmgw_cli.remote.fetch import FetchResult


def plain(value: object) -> Text:
    """A cell or line that rich shows literally, whatever brackets it holds."""
    return Text(str(value))


def problems_view(problems: list[Problem]) -> RenderableType:
    """One line per problem, located, then a count."""
    lines = [Text(str(p), style="red") for p in problems]
    count = len(problems)
    lines.append(Text(f"{count} problem{'s' if count != 1 else ''}; nothing was changed.", style="bold"))
    return Group(*lines)


def spec_headline(spec: ClusterSpec, path: str) -> Text:
    """The line above the summary: which file, which cluster (printed unwrapped, so a long
    path stays one line a script can match)."""
    return plain(f"{path}: valid (cluster {spec.cluster.name})")


def spec_summary(spec: ClusterSpec) -> RenderableType:
    """What a valid cluster file declares, in one table."""
    modes = Counter(m.mode for m in spec.models)
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    gpus = sum(n.gpus.count for n in spec.nodes if n.gpus)
    table.add_row("nodes", plain(f"{len(spec.nodes)}" + (f" ({gpus} GPUs declared)" if gpus else "")))
    table.add_row("fabrics", plain(", ".join(f"{k} ({v.kind})" for k, v in spec.fabrics.items()) or "none"))
    table.add_row(
        "profiles", plain(", ".join(f"{k} ({v.engine.value})" for k, v in spec.profiles.items()) or "none")
    )
    table.add_row(
        "models",
        plain(
            f"{len(spec.models)}: {modes[ScalingMode.always]} always on, "
            f"{modes[ScalingMode.on_demand]} on demand, {modes[ScalingMode.off]} off"
        ),
    )
    store = "PostgreSQL" if spec.gateway.store else "SQLite"
    hosts = ", ".join(spec.gateway.all_hosts)
    table.add_row("gateway", plain(f"{hosts} listening on {spec.gateway.listen}, {store} store"))
    return table


def _rate(gbps: float | None) -> str:
    return f"{gbps:g} Gb/s" if gbps is not None else "-"


def status_view(summary: Summary, seconds: float) -> RenderableType:
    """Nodes, GPUs by class, fabrics and models; unreachable nodes are shown, never hidden."""
    nodes = Table(title=f"Nodes (probed in {seconds:.2f}s)", title_justify="left")
    for col in ("node", "address", "state", "GPUs", "topology", "fabric", "memory", "models", "engines"):
        nodes.add_column(col)
    findings = Table(title="Findings", title_justify="left")
    findings.add_column("node")
    findings.add_column("finding", overflow="fold")
    for r in summary.nodes:
        if not r.reachable:
            nodes.add_row(
                plain(r.name),
                plain(r.address),
                Text("unreachable", style="red"),
                "-",
                "-",
                plain(r.fabric or "-"),
                "-",
                "-",
                "-",
            )
            findings.add_row(plain(r.name), Text(r.error or "unreachable", style="red"))
            continue
        gpus = f"{r.gpus} x {r.gpu_class}" if r.gpus else "none"
        if r.faulty:
            gpus += f" ({r.faulty} faulty)"
        fabric = (
            "-"
            if r.fabric is None
            else (f"{r.fabric} {_rate(r.rate_gbps)}" if r.fabric_ok else f"{r.fabric}: {r.fabric_reason}")
        )
        notes = [*r.faulty_reasons, *([r.expected] if r.expected else []), *r.warnings]
        if r.fabric and not r.fabric_ok:
            notes.insert(0, f"fabric {r.fabric} not advertised: {r.fabric_reason}")
        for note in notes:
            findings.add_row(plain(r.name), Text(note, style="yellow"))
        nodes.add_row(
            plain(r.name),
            plain(r.address),
            Text("ok", style="green"),
            Text(gpus, style="yellow" if r.faulty else ""),
            plain(r.topology),
            Text(fabric, style="" if r.fabric_ok or r.fabric is None else "yellow"),
            f"{r.memory_gib:g} GiB" if r.memory_gib else "-",
            str(len(r.models)),
            plain(r.engine_versions(summary.programs) or "-"),
        )
    classes = Table(title="GPUs by class", title_justify="left")
    for col in ("class", "total", "used", "free", "faulty"):
        classes.add_column(col, justify="right" if col != "class" else "left")
    for c in summary.classes:
        classes.add_row(plain(c.gpu_class), str(c.total), str(c.used), str(c.free), str(c.faulty))
    fabrics = Table(title="Fabrics", title_justify="left")
    for col in ("fabric", "kind", "nodes", "advertising", "free whole nodes", "rate", "models held"):
        fabrics.add_column(col)
    for f in summary.fabrics:
        fabrics.add_row(
            plain(f.name),
            plain(f.kind),
            str(f.nodes),
            str(f.advertising),
            str(f.free_nodes),
            _rate(f.rate_gbps),
            plain(", ".join(f.models_held) or "-"),
        )
    scoped = summary.scope is not None
    title = f"Models with a unit on {', '.join(summary.scope)}" if summary.scope is not None else "Models"
    models = Table(title=plain(title), title_justify="left")
    for col in ("model", "mode", "running / min", "max", "where"):
        models.add_column(col)
    for m in summary.models:
        # `min` counts the whole fleet: on some nodes only, fewer is no shortfall
        style = "red" if m.short and not scoped else ""
        counts = "".join(f", {n} {state}" for state, n in m.not_ready.items())
        models.add_row(
            plain(m.name),
            plain(m.mode),
            Text(f"{m.running} / {m.desired} running{counts}", style=style),
            str(m.maximum),
            plain(", ".join(m.where) or "-"),
        )
    parts: list[RenderableType] = [nodes]
    if findings.row_count:
        parts.append(findings)
    parts += [t for t in (classes, fabrics) if t.row_count]
    replicas = _health_table(summary)
    return Group(*parts, models, *([replicas] if replicas.row_count else []))


_STATE_STYLE = {"ready": "green", "starting": "yellow"}


def _health_table(summary: Summary) -> Table:
    """Each replica's state as its units say (``core/observe/health.py``), its engine's queue
    and KV-cache use (— where not read), and the last journal line of one not ready."""
    from llmgw_cli.core.views.summary import count_text, share_text

    table = Table(title="Replicas", title_justify="left")
    for col in ("replica", "where", "state", "restarts", "queue", "KV cache", "last journal line"):
        table.add_column(col, overflow="fold", justify="right" if col in ("queue", "KV cache") else "left")
    for r in summary.health:
        table.add_row(
            plain(f"{r.model}#{r.replica}"),
            plain(f"{', '.join(r.nodes)}:{r.port}"),
            Text(r.state, style=_STATE_STYLE.get(r.state, "red")),
            str(r.restarts),
            plain(count_text(r.load.waiting)),
            plain(share_text(r.load.kv_usage)),
            plain(r.journal or "-"),
        )
    return table


_OP_STYLE = {"+": "green", "~": "yellow", "-": "red", "=": "dim"}


def plan_view(
    plan: Plan, *, show_unchanged: bool = True, journal: Mapping[tuple[str, int], str] | None = None
) -> RenderableType:
    """The plan terraform-style: one line per replica, then what could not be placed and
    what would leave a model with no serving replica (``apply`` refuses that unless told).
    A replica that is not ready nor starting gets a ``!`` line: its state and the last
    line of its journal (``journal``: (model, replica) -> line, when read)."""
    lines: list[RenderableType] = []
    for a in plan.actions:
        if a.unhealthy:
            last = (journal or {}).get((a.model, a.retire.replica if a.retire else a.replica), "")
            said = f"! {a.model}#{a.retire.replica if a.retire else a.replica} {a.unhealthy}"
            lines.append(Text(f"{said}: {last}" if last else said, style="bold red"))
        if a.op == "=" and not (show_unchanged or a.starting):
            continue
        where = ", ".join(a.nodes)
        port = f":{a.port}" if a.port else ""
        number = f"#{a.replica}"
        if a.retire is not None and a.retire.replica != a.replica:
            number = f"#{a.retire.replica} -> #{a.replica}"  # a successor beside the old one
        lines.append(Text(f"{a.op} {a.model} {number} on {where}{port}  ({a.reason})", style=_OP_STYLE[a.op]))
    for model, reason in plan.unplaced:
        lines.append(Text(f"! {model}: {reason}", style="bold red"))
    lines += [Text(f"warning: {w}", style="yellow") for w in plan.warnings]
    lines += [Text(f"downtime: {d}", style="red") for d in plan.downtime]
    counts = Counter(a.op for a in plan.actions)
    if plan.changes:
        summary = (
            f"Plan: {counts['+']} to create, {counts['~']} to replace, {counts['-']} to delete, "
            f"{counts['=']} unchanged."
        )
    else:
        starting = sum(1 for a in plan.actions if a.starting)
        summary = f"No changes. {counts['='] - starting} replica(s) as they should be."
        if starting:
            summary += f" {starting} starting: not seen ready yet."
    if plan.unplaced:
        summary += f" {len(plan.unplaced)} replica(s) cannot be placed (see !)."
    if plan.downtime:
        n = len(plan.downtime)
        summary += (
            f" {n} replacement{'s' if n != 1 else ''} leave{'s' if n == 1 else ''} a model with no "
            "serving replica (see downtime): apply refuses without --allow-downtime."
        )
    lines.append(Text(summary, style="bold"))
    return Group(*lines)


_PHASE_STYLE = {"working": "yellow", "done": "green", "failed": "red"}  # by Phase


def progress_view(rows: dict[str, Row], now: float) -> RenderableType:
    """What apply is doing now: one row per node and per replica, its latest state coloured
    by its phase, and how long it has taken (still counting while it is worked on)."""
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column()
    table.add_column(justify="right", style="dim", no_wrap=True)
    # A copy: the live view's redraw thread reads the rows while reports add to them.
    for subject, row in list(rows.items()):
        table.add_row(
            plain(subject), Text(row.message, style=_PHASE_STYLE[row.phase]), clock(row.elapsed(now))
        )
    return table


def progress_line(subject: str, row: Row) -> Text:
    """One report as a line, where there is no terminal to redraw: the time taken is added
    once the subject is done or failed."""
    took = "" if row.phase == "working" else f" ({clock(row.elapsed(row.changed))})"
    return Text(f"  {subject}: {row.message}{took}")


_SEVERITY_STYLE = {"error": "red", "warning": "yellow", "info": "cyan"}  # by Severity


def doctor_view(findings: list[Finding], nodes: list[str], seconds: float) -> RenderableType:
    """One row per finding (a node without any gets an "ok" row), then the counts."""
    from llmgw_cli.core.doctor import Severity

    table = Table(title=f"Doctor ({len(nodes)} nodes checked in {seconds:.2f}s)", title_justify="left")
    for col in ("node", "severity", "check"):
        table.add_column(col, no_wrap=True)
    table.add_column("finding", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for f in findings:
        if f.node is None:
            table.add_row(
                "(gateway)",
                Text(f.severity.value, _SEVERITY_STYLE[f.severity]),
                plain(f.check),
                plain(f.message),
                plain(f.fix),
            )
    for node in nodes:
        mine = [f for f in findings if f.node == node]
        if not mine:
            table.add_row(plain(node), Text("ok", "green"), "", "", "")
        for f in mine:
            # Findings quote what the node said (folder names, process names): text, not markup.
            table.add_row(
                plain(node),
                Text(f.severity.value, _SEVERITY_STYLE[f.severity]),
                plain(f.check),
                plain(f.message),
                plain(f.fix),
            )
    errors = sum(1 for f in findings if f.severity is Severity.error)
    warnings = sum(1 for f in findings if f.severity is Severity.warning)
    verdict = (
        Text(f"{errors} error(s), {warnings} warning(s): serving would break", "bold red")
        if errors
        else Text(f"no errors, {warnings} warning(s)", "bold green" if not warnings else "bold yellow")
    )
    return Group(table, verdict)


def fetch_plan_view(plan: FetchPlan) -> RenderableType:
    """What ``fetch`` is about to do (``--dry-run`` stops here): one row per model and node
    it brings, checks or leaves out, then the counts."""
    table = Table("model", "node", "does", "from", box=None)
    downloads = copies = 0
    for s in plan.spreads:
        for node in s.nodes:
            if node == s.origin:
                downloads += 1
                table.add_row(plain(s.model), plain(node), Text("download", style="green"), plain(s.url))
            else:
                copies += 1
                peers = ", ".join(s.seeds) or f"{s.origin} once it has it"
                table.add_row(
                    plain(s.model), plain(node), Text("copy", style="green"), plain(f"a peer: {peers}")
                )
    for r in plan.repos:
        for node in r.nodes:
            table.add_row(
                plain(r.model),
                plain(node),
                Text("snapshot", style="green"),
                plain(f"{r.source} (Hub or a peer)"),
            )
    for model, node, path in plan.checks:
        table.add_row(plain(model), plain(node), Text("check", style="dim"), plain(path))
    for skip in plan.skipped:
        table.add_row(plain(skip.model), plain(skip.node), Text(skip.reason, style="dim"), "")
    snapshots = sum(len(r.nodes) for r in plan.repos)
    said = (
        f"Fetch: {downloads} download(s) from the origin, {copies} copy(ies) from peers, "
        + (f"{snapshots} repository snapshot(s) (one Hub download per fabric), " if snapshots else "")
        + f"{len(plan.checks)} path(s) to check, {len(plan.skipped)} left out."
    )
    return Group(table, Text(said, style="bold"))


def fetch_results_view(plan: FetchPlan, results: list[FetchResult]) -> Table:
    """One row per model and node: fetched, present or failed (with why), and the rate;
    then the pairs left out, with the reason."""
    table = Table("model", "node", "result", "from", "size", "time", "rate", box=None)
    for r in results:
        rate = f"{r.bytes / r.seconds / 2**20:.0f} MiB/s" if r.state == "done" and r.seconds > 0 else ""
        style = "green" if r.ok else "red"
        result = Text(r.state if r.ok else f"failed: {r.message}", style=style)
        size = f"{r.bytes / 2**30:.2f} GiB" if r.bytes else ""
        table.add_row(plain(r.model), plain(r.node), result, plain(r.source), size, f"{r.seconds:.1f}s", rate)
    for s in plan.skipped:
        table.add_row(plain(s.model), plain(s.node), Text(s.reason, style="dim"), "", "", "", "")
    return table


def _ports_cell(ports: dict[str, str]) -> str:
    """``3 ACTIVE, mlx5_1:1 DOWN``: the odd ones out by name."""
    active = sum(1 for v in ports.values() if v == "ACTIVE")
    odd = [f"{k} {v}" for k, v in ports.items() if v != "ACTIVE"]
    return ", ".join(([f"{active} ACTIVE"] if active else []) + odd)


def lab_nodes_view(rows: list[NodeStatus]) -> Table:
    """``llmgw lab status``: one row per simulated node."""
    table = Table(title="lab nodes")
    for col in ("node", "address", "shape", "running", "link", "sshd", "GPUs", "IB ports"):
        table.add_column(col, no_wrap=col not in ("GPUs", "IB ports"))
    for s in rows:
        gpus = f"{s.gpu_count}" + (f", unhealthy: {', '.join(s.gpus_bad)}" if s.gpus_bad else " ok")
        table.add_row(plain(s.name), plain(s.ip), plain(s.shape), "yes" if s.alive else "no", plain(s.link),
                      "up" if s.ssh else "down", plain(gpus if s.alive else ""), plain(_ports_cell(s.ports)))  # fmt: skip
    return table


def _against(used: int, limit: int | None) -> str:
    """``12/60``: the use against a limit; "" without one."""
    return "" if limit is None else f"{used}/{limit}"


def keys_view(keys: list[ApiKey], now: datetime, use: Mapping[str, KeyUse] | None = None) -> Table:
    """``llmgw keys list``: one row per key, its state at ``now`` (never the key itself), its
    limits and its use against them (``rpm`` and ``tpm``: the last minute's requests and
    tokens; ``budget``: this day's or month's tokens), one limit a line. The name is never
    cut (it is what ``keys set`` and ``revoke`` take); the other columns fold to fit the
    terminal (80 columns when it is not one). The creation time is in ``--json``."""
    table = Table("name", "state", "models", "expires", "limits")
    table.columns[0].no_wrap = True
    for column in table.columns[1:]:
        column.overflow = "fold"
    for k in keys:
        state = "revoked" if k.revoked else ("expired" if not k.valid(now) else "active")
        table.add_row(  # names come from whoever made the key (the admin API too): not markup
            Text(k.name),
            state + (", admin" if k.admin else ""),
            Text(",".join(k.models) or "all"),
            k.expires.strftime("%Y-%m-%d %H:%M") if k.expires else "never",
            "\n".join(_limit_lines(k.limits, (use or {}).get(k.name))) or "none",
        )
    return table


def _limit_lines(limits: Limits, used: KeyUse | None) -> list[str]:
    lines = []
    if limits.rpm is not None:
        lines.append(f"rpm {_against(used.requests if used else 0, limits.rpm)}")
    if limits.tpm is not None:
        lines.append(f"tpm {_against(used.tokens if used else 0, limits.tpm)}")
    if (budget := limits.budget) is not None:
        lines.append(f"budget {_against(used.budget if used else 0, budget.tokens)} per {budget.period}")
    if limits.max_parallel is not None:
        lines.append(f"parallel {limits.max_parallel}")
    if limits.priority != "normal":  # (a StrEnum: the limits module loads only with its commands)
        lines.append(f"priority {limits.priority}")
    return lines


def usage_view(rows: list[Usage], limits: Mapping[str, Limits] | None = None) -> RenderableType:
    """``llmgw usage``: one row per day, key and model, then the totals; with ``limits``,
    then each key's totals beside its limits."""
    table = _usage_table(rows)
    if limits is None or not rows:
        return table
    from llmgw_cli.core.serving.limits import describe

    keys = Table("key", "requests", "tokens", "limits", title="by key")
    for key in sorted({u.key for u in rows}):
        mine = [u for u in rows if u.key == key]
        keys.add_row(
            Text(key),
            str(sum(u.requests for u in mine)),
            str(sum(u.prompt_tokens + u.completion_tokens for u in mine)),
            describe(limits[key]) if key in limits else "(no such key)",
        )
    return Group(table, keys)


def _usage_table(rows: list[Usage]) -> Table:
    table = Table(
        "day", "key", "model", "requests", "prompt tokens", "completion tokens", "errors", "mean ms"
    )
    for u in rows:  # key and model names come from the store: not markup
        mean = u.latency_ms / u.requests if u.requests else 0.0
        table.add_row(
            u.day,
            Text(u.key),
            Text(u.model),
            str(u.requests),
            str(u.prompt_tokens),
            str(u.completion_tokens),
            str(u.errors),
            f"{mean:.0f}",
        )
    if len(rows) > 1:
        requests = sum(u.requests for u in rows)
        mean = sum(u.latency_ms for u in rows) / requests if requests else 0.0
        table.add_row(
            "total",
            "",
            "",
            str(requests),
            str(sum(u.prompt_tokens for u in rows)),
            str(sum(u.completion_tokens for u in rows)),
            str(sum(u.errors for u in rows)),
            f"{mean:.0f}",
            style="bold",
        )
    return table
