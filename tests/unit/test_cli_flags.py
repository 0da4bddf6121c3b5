"""The same flags mean the same everywhere: -f/--file and $LLMGW_CLUSTER wherever a command
reads the cluster file, --json wherever it reports, --dry-run and --yes wherever it
changes nodes, -o/--out wherever it writes a file."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from typer.core import TyperGroup

from llmgw_cli.cli.main import app
from llmgw_cli.core.planning.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


def commands() -> Iterator[tuple[str, typer.core.TyperCommand]]:
    """Every command of llmgw, by its full name ("keys list")."""

    def walk(prefix: str, group: TyperGroup) -> Iterator[tuple[str, typer.core.TyperCommand]]:
        for name, command in group.commands.items():
            if isinstance(command, TyperGroup):
                yield from walk(f"{prefix}{name} ", command)
            else:
                assert isinstance(command, typer.core.TyperCommand)
                yield f"{prefix}{name}", command

    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    yield from walk("", root)


def options(command: typer.core.TyperCommand) -> dict[str, set[str]]:
    """The command's parameters by name, each with the flags that set it."""
    return {p.name or "": set(p.opts) | set(p.secondary_opts) for p in command.params}


ALL = dict(commands())


def test_every_command_that_reads_the_cluster_file_takes_it_the_same_way() -> None:
    readers = {name for name, c in ALL.items() if "file" in options(c)}
    # every command but the lab's (its own state folder) and schema (no cluster at all)
    assert readers == {n for n in ALL if not n.startswith("lab ") and n != "schema"}
    for name in readers:
        [file] = [p for p in ALL[name].params if p.name == "file"]
        assert set(file.opts) == {"-f", "--file"}, name
        assert file.envvar == "LLMGW_CLUSTER", name


def test_every_command_that_reports_has_json() -> None:
    reporting = {"validate", "status", "doctor", "plan", "usage", "fetch", "keys list", "lab status"}
    for name in reporting:
        assert "--json" in set().union(*options(ALL[name]).values()), name


def test_every_command_that_changes_nodes_has_dry_run_and_yes() -> None:
    for name in ("apply", "fetch"):
        flags = set().union(*options(ALL[name]).values())
        assert {"--dry-run", "--yes", "-y"} <= flags, name


def test_every_option_that_names_a_file_to_write_is_o_and_out() -> None:
    writers = {name for name, c in ALL.items() if any("--out" in f for f in options(c).values())}
    assert writers == {"plan", "schema", "render monitoring"}
    for name in writers:
        assert any(flags == {"-o", "--out"} for flags in options(ALL[name]).values()), name


# --- what --json prints ----------------------------------------------------------------------


def llmgw(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )


def test_validate_json_says_what_the_file_declares() -> None:
    done = llmgw("validate", "--json", "-f", str(ROOT / "inventories/hgx-two-fabrics.yaml"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["valid"] is True
    assert report["cluster"] == "hgx-prod"
    assert len(report["nodes"]) == 18 and "hgx-a01" in report["nodes"]
    assert report["gpus"] == 136
    assert report["fabrics"] == {"ib-a": "infiniband", "ib-b": "infiniband"}
    assert report["models"] == {"off": 1, "on-demand": 4, "always": 5}
    assert report["gateway"]["store"] in ("sqlite", "postgresql")


def test_validate_json_lists_every_problem_with_its_place_and_exit_2() -> None:
    done = llmgw("validate", "--json", "-f", str(ROOT / "tests/data/five-mistakes.yaml"))
    assert done.returncode == 2
    report = json.loads(done.stdout)
    assert report["valid"] is False
    assert len(report["problems"]) == 7
    typo = next(p for p in report["problems"] if p["where"] == "models[1]")
    assert (typo["line"], typo["column"]) == (21, 5)
    assert "tensor_paralel" in typo["message"]
    assert "7 problems; nothing was changed." in done.stderr  # people read stderr


@pytest.fixture
def workstation(tmp_path: Path) -> Path:
    """This machine as a node (no SSH), with one model to download and one for the engine."""
    (tmp_path / "models").mkdir()
    file = tmp_path / "cluster.yaml"
    file.write_text(
        f"""cluster: {{name: t}}
gateway: {{host: localhost, listen: "127.0.0.1:8080", state_dir: {tmp_path / "state"}}}
nodes:
  - {{name: ws, address: localhost, connection: local, weights: [{tmp_path / "models"}]}}
profiles: {{llama: {{engine: llama-server}}, vllm: {{engine: vllm}}}}
models:
  - {{name: tiny, source: "https://example.invalid/tiny.gguf", profile: llama, scaling: {{min: 1, max: 1}}}}
  - {{name: hub, source: org/hub, fetch: engine, profile: vllm, scaling: {{min: 0, max: 1}}}}
"""
    )
    return file


def test_fetch_dry_run_json_says_what_would_be_fetched_and_fetches_nothing(workstation: Path) -> None:
    done = llmgw("fetch", "--dry-run", "--json", "-f", str(workstation))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [tiny] = report["fetches"]
    assert (tiny["model"], tiny["node"], tiny["from"]) == ("tiny", "ws", "origin")
    assert tiny["url"] == "https://example.invalid/tiny.gguf"
    assert tiny["path"] == str(workstation.parent / "models/tiny.gguf")
    assert report["skipped"] == [
        {"model": "hub", "node": "ws", "reason": "a Hugging Face repo id: the engine downloads it"}
    ]
    assert list((workstation.parent / "models").iterdir()) == []


def test_fetch_without_a_terminal_refuses_without_yes(workstation: Path) -> None:
    done = llmgw("fetch", "-f", str(workstation), stdin="y\n")
    assert done.returncode == 2
    assert "not a terminal: pass --yes to fetch without confirmation" in done.stderr
    assert "download" in done.stdout  # what it would have done, shown before it refused
    assert list((workstation.parent / "models").iterdir()) == []


def test_plan_json_is_the_plan_apply_takes(workstation: Path, tmp_path: Path) -> None:
    saved = tmp_path / "saved.json"
    done = llmgw("plan", "--json", "-f", str(workstation), "-o", str(saved))
    assert done.returncode == 0, done.stderr
    plan = Plan.model_validate_json(done.stdout)
    assert plan == Plan.model_validate_json(saved.read_text())
    # tiny is started or, on a machine without a free GPU, cannot be placed: either way named
    assert "tiny" in [a.model for a in plan.actions] + [model for model, _ in plan.unplaced]
    assert plan.facts_digest
    assert "Saved to" in done.stderr  # stdout holds the JSON only


def test_keys_list_and_usage_json_from_the_gateway_hosts_store(tmp_path: Path) -> None:
    # --store-dir: the SQLite store of this host, as the gateway host answers for itself
    store = ("--store-dir", str(tmp_path))
    made = llmgw("keys", "create", "--name", "team-a", "--models", "a,b", "--expires", "2030-01-31", *store)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("llmgw-")
    listed = llmgw("keys", "list", "--json", *store)
    assert listed.returncode == 0, listed.stderr
    [key] = json.loads(listed.stdout)
    assert (key["name"], key["models"], key["revoked"], key["admin"]) == ("team-a", ["a", "b"], False, False)
    assert key["expires"].startswith("2030-01-31")
    assert made.stdout.strip() not in listed.stdout  # never the key itself
    used = llmgw("usage", "--json", "--since", "2026-01-01", *store)
    assert used.returncode == 0, used.stderr
    assert json.loads(used.stdout) == []
