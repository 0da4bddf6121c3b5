"""Attacks through text that comes back from nodes (journal lines, GPU names, folder names,
error messages): rich must show it literally, never read it as markup. A closing tag such
as ``[/x]`` raises MarkupError mid-command; ``[link=...]`` forges a hyperlink."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console, RenderableType

from llmgw_cli.cli import apply_steps as apply_cli
from llmgw_cli.cli.views import (
    doctor_view,
    fetch_results_view,
    problems_view,
    progress_view,
    spec_headline,
    spec_summary,
    status_view,
)
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.doctor.facts import Finding, Severity
from llmgw_cli.core.planning.plan import Plan
from llmgw_cli.core.planning.steps import HostStep
from llmgw_cli.core.views.summary import ClassRow, FabricRow, ModelRow, NodeRow, Summary
from llmgw_cli.core.weights.fetch import FetchPlan, Skip
from llmgw_cli.errors import Problem
from llmgw_cli.progress import Phase, Row
from llmgw_cli.remote import apply_host
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.fetch import FetchResult
from llmgw_cli.remote.gateway_install import GatewayPreviews
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import llmgw_units, reset, run
from tests.security.hostile_values import HOSTILE_ARGS, exec_argv, yaml_quoted

ROOT = Path(__file__).resolve().parents[2]
# Each is a markup error, a style that would hide what follows, or a forged link.
HOSTILE = ["[/x]", "[/]", "[bold red]boom", "[link=https://evil.example]click[/link]", "a [b] c [/b]"]


def rendered(view: RenderableType) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None, force_terminal=False)
    console.print(view)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def node_row(text: str, **changes: Any) -> NodeRow:
    row: dict[str, Any] = {
        "name": "node01",
        "address": "10.0.0.1",
        "reachable": True,
        "error": None,
        "gpu_class": text,
        "gpus": 1,
        "used": 0,
        "faulty": 1,
        "faulty_reasons": (f"GPU 0: {text}",),
        "expected": None,
        "topology": text,
        "nvlink_peers": None,
        "fabric": None,
        "fabric_ok": True,
        "fabric_reason": "",
        "rate_gbps": None,
        "memory_gib": None,
        "models": (),
        "warnings": (text,),
    }
    return NodeRow(**{**row, **changes})


@pytest.mark.parametrize("text", HOSTILE)
def test_status_shows_a_hostile_gpu_name_and_topology_literally(text: str) -> None:
    summary = Summary(
        nodes=(node_row(text), node_row(text, name="node02", reachable=False, error=f"ssh: {text}")),
        classes=(ClassRow(gpu_class=text, total=1, used=0, free=1, faulty=0),),
        fabrics=(
            FabricRow(
                name="f",
                kind="roce",
                nodes=1,
                advertising=1,
                free_nodes=1,
                rate_gbps=None,
                models_held=(text,),
            ),
        ),
        models=(ModelRow(name="m", mode="off", desired=0, maximum=0, running=0, where=(text,)),),
    )
    out = rendered(status_view(summary, 0.1))
    assert out.count(text) >= 6, out


@pytest.mark.parametrize("text", HOSTILE)
def test_doctor_shows_what_a_node_said_literally(text: str) -> None:
    findings = [
        Finding(
            node="node01", check="weights.folder", severity=Severity.error, message=f"{text} is bad", fix=text
        ),
        Finding(node=None, check="gateway", severity=Severity.warning, message=text, fix=text),
    ]
    out = rendered(doctor_view(findings, ["node01"], 0.1))
    assert out.count(text) >= 4, out


@pytest.mark.parametrize("text", HOSTILE)
def test_fetch_report_shows_a_remote_error_literally(text: str) -> None:
    results = [FetchResult(model="m", node="node01", ok=False, state="failed", source=text, message=text)]
    plan = FetchPlan(spreads=(), skipped=(Skip(model="m2", node="node02", reason=text),), checks=())
    out = rendered(fetch_results_view(plan, results))
    assert out.count(text) >= 3, out


@pytest.mark.parametrize("text", HOSTILE)
def test_apply_progress_table_shows_a_journal_line_literally(text: str) -> None:
    row = Row(f"failed: journal: {text}", Phase.failed, 0.0, 1.0)
    out = rendered(progress_view({f"llmgw-{text}.service": row}, 2.0))
    assert out.count(text) == 2, out


def test_problems_and_summary_show_file_text_literally() -> None:
    problem = Problem("c[/x].yaml", 1, 1, "models[0]", "unknown key '[/x]'")
    assert "c[/x].yaml:1:1: models[0]: unknown key '[/x]'" in rendered(problems_view([problem]))
    spec = parse_cluster((ROOT / "inventories/single-box.yaml").read_text())
    assert "[/x]/c.yaml: valid" in rendered(spec_headline(spec, "[/x]/c.yaml"))
    assert "1 always on" in rendered(spec_summary(spec))


@pytest.mark.parametrize("text", HOSTILE)
def test_apply_line_output_survives_a_journal_line_with_markup(
    text: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a terminal apply prints one line per event; an engine's journal tail in a
    failure message used to abort apply with MarkupError, leaving the other nodes half done."""
    console = Console(file=io.StringIO(), width=400, color_system=None, force_terminal=False)
    monkeypatch.setattr(apply_cli, "err", console)

    class Stop(Exception):
        pass

    async def prepare(spec: Any, conns: Any, nodes: Any, report: Any, facts: Any = None) -> list[Any]:
        report("llmgw-m-0.service on node01", f"failed: exited 1; journal: {text}")
        raise Stop

    monkeypatch.setattr(apply_host, "prepare", prepare)
    spec = parse_cluster((ROOT / "inventories/single-box.yaml").read_text())
    # a plan whose first step installs the node helper: the executor's first report
    helper = HostStep(kind="node_helper", target=spec.nodes[0].name, action="install", reason="no helper yet")
    run = apply_cli._execute_with_progress(
        spec,
        Connections(spec, tmp_path),
        Plan(actions=(), unplaced=(), warnings=(), facts_digest="", steps=(helper,)),
        wait=False,
        gateway=GatewayPreviews(()),
        unreachable=set(),
        facts={},
    )
    with pytest.raises(Stop):
        asyncio.run(run)
    assert f"llmgw-m-0.service on node01: failed: exited 1; journal: {text}" in console.file.getvalue()  # type: ignore[attr-defined]


# --- on the lab: an engine whose journal holds markup, and whose argv systemd built -----

ENGINE = "/usr/local/bin/llmgw-hostile-engine"
# The engine records the argv systemd gave it, prints markup to its journal and fails.
ENGINE_SCRIPT = """#!/bin/sh
printf '%s\\0' "$@" > /tmp/llmgw-hostile-argv
echo '[/x] [bold red]boom[/bold red] [link=https://evil.example]click[/link]'
exit 3
"""
JOURNAL_LINE = "[/x] [bold red]boom[/bold red] [link=https://evil.example]click[/link]"
# A lone ";" word is left to the unit verify test: the node helper refuses it in any form.
LAB_ARGS = [a for a in HOSTILE_ARGS if a != ";"]


@pytest.fixture(scope="module")
def hostile_apply(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Any, str]]:
    """`llmgw apply` of one model run by the hostile engine, with hostile but legal args."""
    reset(lab)
    for node in lab.nodes:
        lab.ssh(
            node.name,
            f"cat > {ENGINE} <<'EOF'\n{ENGINE_SCRIPT}EOF\nchmod 755 {ENGINE}; rm -f /tmp/llmgw-hostile-argv",
        )
    folder = tmp_path_factory.mktemp("hostile")
    head = lab.cluster_file.read_text().split("\nmodels:\n")[0]
    head = head.replace("state_dir: /var/lib/llmgw-lab/gateway", f"state_dir: {folder / 'state'}")
    args = "[" + ", ".join(yaml_quoted(a) for a in LAB_ARGS) + "]"
    cluster = folder / "cluster.yaml"
    cluster.write_text(
        head.replace(
            "profiles:\n",
            f"profiles:\n  hostile:\n    engine: llama-server\n    command: [{ENGINE}]\n"
            "    readiness: {start_timeout: 30s}\n    ports: 8400-8499\n",
            1,
        )
        + "\nmodels:\n  - name: hostile-args\n    source: /data/models/SmolLM2-135M-Instruct.Q4_1.gguf\n"
        f"    profile: hostile\n    args: {args}\n    scaling: {{min: 1, max: 1}}\n"
    )
    done = run("apply", "-f", str(cluster), "--yes", timeout=240)
    try:
        yield lab, done, "llmgw-hostile-args-0.service"
    finally:
        for node in lab.nodes:
            lab.ssh(node.name, f"rm -f {ENGINE} /tmp/llmgw-hostile-argv")
        reset(lab)


@pytest.mark.integration
def test_apply_reports_an_engine_journal_line_holding_markup_literally(
    hostile_apply: tuple[Lab, Any, str],
) -> None:
    _, done, unit = hostile_apply
    output = done.stdout + done.stderr
    assert "MarkupError" not in output and "Traceback" not in output, output
    assert done.returncode == 1, output  # the replica failed; apply said so and finished
    assert "1 replica not ready (hostile-args#0), stopped; fix them and run apply again" in output, output
    assert JOURNAL_LINE in output, output
    assert unit in output


@pytest.mark.integration
def test_systemd_runs_hostile_args_exactly_as_written(hostile_apply: tuple[Lab, Any, str]) -> None:
    """What systemd really passed the engine: every hostile arg verbatim and in order, and
    the same argv a strict re-reading of the unit's ExecStart= gives."""
    lab, done, unit = hostile_apply
    where = [node for node, units in llmgw_units(lab).items() if unit in units]
    assert len(where) == 1, (where, done.stdout + done.stderr)
    dumped = lab.ssh(where[0], "cat /tmp/llmgw-hostile-argv").stdout
    argv = dumped.split("\0")[:-1]
    start = argv.index(LAB_ARGS[0])
    assert argv[start : start + len(LAB_ARGS)] == LAB_ARGS
    text = lab.ssh(where[0], f"cat /etc/systemd/system/{unit}").stdout
    (exec_line,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert exec_argv(exec_line.removeprefix("ExecStart=")) == [ENGINE, *argv]
