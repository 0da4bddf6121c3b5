"""`llmgw cordon`, `uncordon` and the hidden `cordons`, run for real against the SQLite
store of a gateway host that is this machine, and as the gateway host runs them when
forwarded (``--store-dir``, ``--by``, ``--draining``): what they record, what they print,
and their refusals of bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmgw_cli.cli import cordon_steps
from llmgw_cli.cli.cordon_steps import cordons_view, parse_cordons
from llmgw_cli.cli.main import app
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.errors import InputError, LlmgwError

CLUSTER = """\
cluster: {{name: t}}
nodes:
  - {{name: node01, address: 10.0.0.1}}
  - {{name: node02, address: 10.0.0.2, cordoned: true, cordon_reason: rack move}}
profiles: {{llama: {{engine: llama-server}}}}
gateway: {{host: localhost, state_dir: {state}}}
models:
  - {{name: a, source: "https://example.invalid/a.gguf", profile: llama}}
"""


def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
        timeout=120,
        check=False,
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    file = tmp_path / "cluster.yaml"
    file.write_text(CLUSTER.format(state=tmp_path / "state"))
    return file


def test_cordon_records_who_when_why_and_uncordon_lifts_it(cluster: Path) -> None:
    before = time.time()
    done = llmgw("cordon", "node01", "--reason", "GPU 3 reseat", "-f", str(cluster), "--json")
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert made["node"] == "node01" and made["reason"] == "GPU 3 reseat" and not made["draining"]
    assert "@" in made["by"] and before <= made["since"] <= time.time()
    said = llmgw("cordon", "node01", "-f", str(cluster))  # again: the reason is kept
    assert said.returncode == 0 and said.stdout.strip() == "cordoned node01: no new replica goes there"
    (stored,) = json.loads(llmgw("cordons", "--json", "-f", str(cluster)).stdout)
    assert (stored["reason"], stored["since"]) == ("GPU 3 reseat", made["since"])

    lifted = llmgw("uncordon", "node01", "-f", str(cluster), "--json")
    assert json.loads(lifted.stdout) == {"node": "node01", "uncordoned": True, "note": "uncordoned node01"}
    again = llmgw("uncordon", "node01", "-f", str(cluster))
    assert again.returncode == 0 and again.stdout.strip() == "node01 was not cordoned"
    file_one = llmgw("uncordon", "node02", "-f", str(cluster))
    assert "cordoned by the cluster file (cordoned: true)" in file_one.stdout
    assert json.loads(llmgw("cordons", "--json", "-f", str(cluster)).stdout) == []


def test_the_gateway_hosts_side_takes_who_and_the_draining_mark(tmp_path: Path) -> None:
    store = str(tmp_path / "state")
    done = llmgw(
        "cordon", "--store-dir", store, "--by", "ops@desk", "--draining", "yes", "--json", "--", "node01"
    )
    assert done.returncode == 0, done.stderr
    (found,) = parse_cordons(llmgw("cordons", "--store-dir", store, "--json").stdout)
    assert (found.node, found.by, found.draining) == ("node01", "ops@desk", True)
    llmgw("cordon", "--store-dir", store, "--by", "ops@desk", "--draining", "no", "--", "node01")
    (found,) = parse_cordons(llmgw("cordons", "--store-dir", store, "--json").stdout)
    assert not found.draining


def test_bad_names_and_reasons_are_refused_before_anything_is_written(cluster: Path) -> None:
    unknown = llmgw("cordon", "node9", "-f", str(cluster))
    assert unknown.returncode == 2
    assert "no node named 'node9' in the cluster file; its nodes: node01, node02" in unknown.stderr
    drained = llmgw("drain", "node9", "-f", str(cluster), "--dry-run")
    assert drained.returncode == 2 and "its nodes: node01, node02" in drained.stderr
    for reason in ("a\x1b[2Jb", "x" * 201):
        bad = llmgw("cordon", "node01", "--reason", reason, "-f", str(cluster))
        assert bad.returncode == 2 and "--reason" in bad.stderr, bad.stderr
    assert json.loads(llmgw("cordons", "--json", "-f", str(cluster)).stdout) == []


def test_an_answer_from_the_gateway_host_is_checked() -> None:
    with pytest.raises(LlmgwError, match="not a list of cordons"):
        parse_cordons('{"node": "x"}')
    with pytest.raises(LlmgwError, match="bad cordon"):
        parse_cordons('[{"node": "a\\u001b[2J", "reason": "", "by": "", "since": 1, "draining": false}]')
    with pytest.raises(LlmgwError, match="bad cordon"):
        parse_cordons('[{"node": "a", "reason": "", "by": "", "since": "now", "draining": false}]')


def test_status_shows_each_cordon_with_its_state_reason_who_and_since() -> None:
    now = 1_796_515_200.0  # 2026-12-06 00:00 UTC
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(
        cordons_view(
            [
                Cordon("node01", "[red]PSU[/red] swap", "ops@desk", now - 300, draining=True),
                Cordon("node02", "rack move", source="file"),
            ],
            now,
        )
    )
    lines = [" ".join(x.split()) for x in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]
    assert "│ node01 │ draining │ [red]PSU[/red] swap │ ops@desk │ 2026-12-05 23:55 UTC (5m ago) │" in lines
    assert "│ node02 │ cordoned │ rack move │ cluster file │ — │" in lines


def test_through_the_gateway_host_the_command_runs_there_with_who_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite on another host: the command runs there (here standing in for SSH: the same
    llmgw with ``--store-dir`` and the forwarded arguments, as ``remote_command`` builds it),
    carrying the caller's user@host and the reason; its JSON answer is read back."""
    state = tmp_path / "state"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.format(state=state).replace("host: localhost", "host: far.invalid"))
    sent: list[tuple[list[str], list[str]]] = []

    def on_host(spec: ClusterSpec, file: Path, host: str, command: list[str], args: list[str]) -> str:
        assert host == "far.invalid"
        sent.append((command, args))
        done = llmgw(*command, "--store-dir", str(state), *args)
        if done.returncode:
            raise (InputError if done.returncode == 2 else LlmgwError)(f"{args}: {done.stderr[-600:]}")
        return done.stdout

    monkeypatch.setattr(cordon_steps, "forward", on_host)
    monkeypatch.setattr(cordon_steps, "caller", lambda: "ops@desk")
    runner = CliRunner()

    def cli(*args: str) -> str:
        done = runner.invoke(app, [*args, "-f", str(cluster)])
        assert done.exit_code == 0, (done.output, done.exception)
        return done.output

    assert cli("cordon", "node01", "--reason", "fans").strip() == "cordoned node01: no new replica goes there"
    assert sent[-1] == (["cordon"], ["--by=ops@desk", "--reason=fans", "--json", "--", "node01"])
    (found,) = json.loads(cli("cordons", "--json"))
    assert (found["node"], found["reason"], found["by"]) == ("node01", "fans", "ops@desk")
    assert cli("uncordon", "node01").strip() == "uncordoned node01"
    assert sent[-1] == (["uncordon"], ["--json", "--", "node01"])
    assert json.loads(cli("cordons", "--json")) == []
