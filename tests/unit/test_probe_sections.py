"""The probe as a list of facts (section, shell, parser), and the facts plan and apply used
to ask for in round trips of their own: is the node helper up to date, does the node hold
an engine key."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.engine.engine_access import ENGINE_ENV_FILE, engine_env_text
from llmgw_cli.core.hosts import node_access
from llmgw_cli.core.observe.facts import NodeAccess, NodeFacts
from llmgw_cli.core.observe.parse.probe import ENGINE_KEY_SH, SECTIONS, parse_probe, probe_script
from llmgw_cli.remote import engine_keys
from llmgw_cli.remote import node_access as remote_node_access
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.transport import CommandResult, Transport

SPEC = parse_cluster(
    """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1, weights: [/data/models]}
  - {name: b, address: 10.0.0.2}
profiles:
  vllm: {engine: vllm, command: [/opt/vllm/bin/vllm, serve], user: vllm}
models: []
"""
)
NODE = SPEC.nodes[0]
KEY = "c0ffee" * 10


def test_the_script_is_the_sections_in_order_each_once_then_end() -> None:
    names = [s.name for s in SECTIONS]
    assert len(names) == len(set(names))
    headers = [
        line.removeprefix('echo "@@ ')
        for line in probe_script(SPEC, NODE).split("\n")
        if line.startswith('echo "@@ ')
    ]
    assert headers == [f'{name}"' for name in [*names, "end"]]


def output(**sections: str) -> str:
    return "".join(f"@@ {name.replace('_', '-')}\n{body}\n" for name, body in sections.items()) + "@@ end\n"


def test_node_access_read_as_root() -> None:
    digest = "ab" * 32
    facts = parse_probe(
        NODE,
        output(
            node_access=f"@root\n{digest}  {node_access.HELPER}\n{digest}  {node_access.SUDOERS}\n@missing vllm"
        ),
    )
    assert facts.node_access == NodeAccess(
        digests={node_access.HELPER: digest, node_access.SUDOERS: digest}, missing_accounts=("vllm",)
    )


@pytest.mark.parametrize("body", ["@unprivileged", "", "nonsense"])
def test_node_access_not_read_is_unknown_not_missing(body: str) -> None:
    assert parse_probe(NODE, output(node_access=body)).node_access is None
    assert parse_probe(NODE, output(host="clock 1")).node_access is None  # no such section


@pytest.mark.parametrize(
    ("body", "present"), [("@present", True), ("@absent", False), ("@unprivileged", None)]
)
def test_engine_key_presence(body: str, present: bool | None) -> None:
    assert parse_probe(NODE, output(engine_key=body)).engine_key_present is present


def test_managed_paths_are_the_files_apply_keeps_and_the_sudo_rule() -> None:
    files = remote_node_access.wanted(SPEC, NODE, [])
    assert set(node_access.MANAGED_PATHS) == {f.path for f in files} | {node_access.SUDOERS}
    assert f"sha256sum {' '.join(node_access.MANAGED_PATHS)}" in probe_script(SPEC, NODE)


def test_helper_stale_compares_every_digest_and_account() -> None:
    files = remote_node_access.wanted(SPEC, NODE, ["ssh-ed25519 AAAA"])
    want = {f.path: f.digest for f in files}
    want[node_access.SUDOERS] = node_access.NodeFile(
        node_access.SUDOERS, node_access.sudoers_rule(), 0o440
    ).digest
    assert not node_access.helper_stale(files, NodeAccess(digests=want, missing_accounts=()))
    assert node_access.helper_stale(files, NodeAccess(digests=want, missing_accounts=("vllm",)))
    for path in want:
        assert node_access.helper_stale(
            files, NodeAccess(digests={**want, path: "0" * 64}, missing_accounts=())
        )
        rest = {p: d for p, d in want.items() if p != path}
        assert node_access.helper_stale(files, NodeAccess(digests=rest, missing_accounts=()))
    # another gateway key: the authorized_keys line differs
    other = remote_node_access.wanted(SPEC, NODE, ["ssh-ed25519 BBBB"])
    assert node_access.helper_stale(other, NodeAccess(digests=want, missing_accounts=()))


def test_the_engine_key_section_says_present_and_never_prints_the_key(tmp_path: Path) -> None:
    path = tmp_path / "engine.env"
    # as root, whoever runs the test
    script = ENGINE_KEY_SH.replace(ENGINE_ENV_FILE, str(path)).replace('"$(id -u)"', "0")
    assert "id -u" in ENGINE_KEY_SH and str(path) in script
    env = {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}
    assert subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env).stdout == "@absent\n"
    path.write_text(engine_env_text(KEY))
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env)
    assert result.stdout == "@present\n" and KEY not in result.stderr


def no_transport(*_args: object) -> Transport:
    raise AssertionError("asked a node over SSH although the probe's facts said")


def test_plan_uses_the_probes_facts_without_another_round_trip(tmp_path: Path) -> None:
    conns = Connections(SPEC, tmp_path, opener=no_transport)
    files = remote_node_access.wanted(SPEC, NODE, [])
    current = {f.path: f.digest for f in files}
    current[node_access.SUDOERS] = node_access.NodeFile(
        node_access.SUDOERS, node_access.sudoers_rule(), 0o440
    ).digest
    facts = {
        "a": NodeFacts(
            node="a",
            engine_key_present=True,
            node_access=NodeAccess(digests=current, missing_accounts=()),
        ),
        "b": NodeFacts(
            node="b", engine_key_present=False, node_access=NodeAccess(digests={}, missing_accounts=())
        ),
    }
    assert asyncio.run(engine_keys.nodes_without_key(SPEC, conns, ["a", "b"], facts)) == ["b"]
    assert asyncio.run(remote_node_access.check(SPEC, conns, ["a", "b"], [], facts)) == ["b"]


def test_a_node_the_probe_could_not_read_is_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[str] = []

    async def read_access(spec: object, conns: object, node: object) -> None:
        asked.append(getattr(node, "name", ""))

    monkeypatch.setattr(remote_node_access, "_read_access", read_access)
    facts = {"a": NodeFacts(node="a"), "b": NodeFacts(node="b")}
    conns = Connections(SPEC, tmp_path, opener=no_transport)
    assert asyncio.run(remote_node_access.check(SPEC, conns, ["a", "b"], [], facts)) == ["a", "b"]
    assert asked == ["a", "b"]


class Recorded:
    """A node that answers the engine-key section as ``answer`` and records what it ran."""

    def __init__(self, node: str, answer: str, runs: list[tuple[str, str, bool]]) -> None:
        self.node, self.answer, self.runs = node, answer, runs

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        self.runs.append((self.node, stdin or "", root))
        return CommandResult(0, f"@@ engine-key\n{self.answer}\n@@ end\n", "")

    async def close(self) -> None:
        return None


def test_a_node_the_probe_could_not_tell_is_asked_for_the_key_through_sudo_without_reading_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs: list[tuple[str, str, bool]] = []
    answers = {"a": "@present", "b": "@absent"}
    conns = Connections(
        SPEC,
        tmp_path,
        opener=lambda _spec, node, _base, _access: Recorded(node.name, answers[node.name], runs),
    )
    facts = {"a": NodeFacts(node="a"), "b": NodeFacts(node="b")}
    assert asyncio.run(engine_keys.nodes_without_key(SPEC, conns, ["a", "b"], facts)) == ["b"]
    assert {node for node, _, _ in runs} == {"a", "b"}
    for _, script, root in runs:
        assert root and "@@ engine-key" in script and "cat " not in script
