"""`llmgw validate` and `llmgw schema`: the cluster file checked, and its JSON Schema."""

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster

if TYPE_CHECKING:
    from llmgw_cli.core.clusterfile.spec import ClusterSpec


def validate(
    file: ClusterFile = DEFAULT_FILE,
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print what the file declares, or its problems, as JSON for scripts."),
    ] = False,
) -> None:
    """Check a cluster file: every problem is reported at once, with line and column.

    Exit code 0 when valid, 2 when it has problems.
    """
    from llmgw_cli.errors import SpecError

    if json_out:
        try:
            spec = read_cluster(file)
        except SpecError as exc:
            problems = [dataclasses.asdict(p) for p in exc.problems]
            _write({"file": str(file), "valid": False, "problems": problems})
            raise  # the problems on stderr too, and exit code 2
        _write({"file": str(file), "valid": True, **_declared(spec)})
        return

    from rich.console import Console

    from llmgw_cli.cli.views import spec_headline, spec_summary

    spec = read_cluster(file)
    out = Console()
    out.print(spec_headline(spec, str(file)), soft_wrap=True)
    out.print(spec_summary(spec))


def _declared(spec: "ClusterSpec") -> dict[str, Any]:
    """What ``validate --json`` says a valid file declares (the table ``validate`` shows)."""
    from llmgw_cli.core.clusterfile.spec import ScalingMode

    modes = Counter(m.mode for m in spec.models)
    return {
        "cluster": spec.cluster.name,
        "nodes": [n.name for n in spec.nodes],
        "gpus": sum(n.gpus.count for n in spec.nodes if n.gpus),
        "fabrics": {name: f.kind for name, f in spec.fabrics.items()},
        "profiles": {name: p.engine.value for name, p in spec.profiles.items()},
        "models": {mode.value: modes[mode] for mode in ScalingMode},
        "gateway": {
            "hosts": list(spec.gateway.all_hosts),
            "listen": spec.gateway.listen,
            "store": "postgresql" if spec.gateway.store else "sqlite",
        },
    }


def _write(report: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


def schema(
    output: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of the cluster file (for editors and CI)."""
    from llmgw_cli.core.clusterfile.docgen import json_schema

    text = json_schema()
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
