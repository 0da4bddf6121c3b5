"""Renderables for the CLI. Views never print: they return something rich can render."""

from __future__ import annotations

from collections import Counter

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmgw_cli.core.spec import ClusterSpec, ScalingMode
from llmgw_cli.errors import Problem


def problems_view(problems: list[Problem]) -> RenderableType:
    """One line per problem, located, then a count."""
    lines = [Text(str(p), style="red") for p in problems]
    count = len(problems)
    lines.append(Text(f"{count} problem{'s' if count != 1 else ''}; nothing was changed.", style="bold"))
    return Group(*lines)


def spec_summary(spec: ClusterSpec, path: str) -> RenderableType:
    """What a valid cluster file declares, in one table."""
    modes = Counter(m.mode for m in spec.models)
    table = Table(
        title=f"{path}: valid (cluster {spec.cluster.name})", title_justify="left", show_header=False
    )
    table.add_column(style="bold")
    table.add_column()
    gpus = sum(n.gpus.count for n in spec.nodes if n.gpus)
    table.add_row("nodes", f"{len(spec.nodes)}" + (f" ({gpus} GPUs declared)" if gpus else ""))
    table.add_row("fabrics", ", ".join(f"{k} ({v.kind})" for k, v in spec.fabrics.items()) or "none")
    table.add_row(
        "profiles", ", ".join(f"{k} ({v.engine.value})" for k, v in spec.profiles.items()) or "none"
    )
    table.add_row(
        "models",
        f"{len(spec.models)}: {modes[ScalingMode.always]} always on, "
        f"{modes[ScalingMode.on_demand]} on demand, {modes[ScalingMode.off]} off",
    )
    table.add_row("gateway", f"{spec.gateway.host} listening on {spec.gateway.listen}")
    return table
