"""`--nodes`: one parser for status, doctor and fetch, checked against the cluster file
before any node is probed."""

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.cli.common import chosen_nodes, read_cluster
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.errors import ExitCode, UsageError

ROOT = Path(__file__).resolve().parents[2]


def fleet(names: list[str], port: int = 22) -> str:
    nodes = "".join(f"  - {{name: {n}, address: 127.0.0.{i + 1}}}\n" for i, n in enumerate(names))
    return (
        f"cluster: {{name: t}}\nssh: {{port: {port}, connect_timeout: 10m, known_hosts: /dev/null}}\n"
        f"nodes:\n{nodes}profiles: {{vllm: {{engine: vllm}}}}\n"
        "models:\n  - {name: qwen-7b, source: https://example.org/q.gguf, profile: vllm}\n"
    )


def test_a_typo_names_the_node_meant() -> None:
    spec = parse_cluster(fleet(["node01", "node02", "gpu-a"]))
    with pytest.raises(UsageError) as typo:
        chosen_nodes(spec, "node01,nod02,zzz", Path("c.yaml"))
    assert str(typo.value) == (
        "--nodes: no node nod02 (did you mean node02?), zzz in c.yaml; its nodes are node01, node02, gpu-a"
    )
    assert typo.value.exit_code == ExitCode.bad_input == 2


def test_an_option_that_names_no_node_says_how_to_name_them() -> None:
    with pytest.raises(UsageError) as empty:
        chosen_nodes(parse_cluster(fleet(["ws"])), " , ", Path("c.yaml"))
    assert str(empty.value) == (
        "--nodes ' , ' names no node: give names separated by commas, from ws (or leave --nodes out for every node)"
    )


def test_a_large_fleet_is_not_listed_whole() -> None:
    names = [f"n{i:03}" for i in range(40)]
    with pytest.raises(UsageError) as unknown:
        chosen_nodes(parse_cluster(fleet(names)), "x", Path("c.yaml"))
    assert str(unknown.value).endswith("its nodes are n000, n001, n002, n003, n004, n005, n006, n007, "
                                       "n008, n009, n010, n011, ... (40 in all)")  # fmt: skip


def test_the_named_nodes_keep_their_order_once_each() -> None:
    file = ROOT / "inventories/hgx-two-fabrics.yaml"
    spec = read_cluster(file)
    assert chosen_nodes(spec, None, file) is None
    assert chosen_nodes(spec, " hgx-b01,hgx-a01,, hgx-b01", file) == ["hgx-b01", "hgx-a01"]


@pytest.fixture
def silent_ssh() -> Iterator[list[socket.socket]]:
    """The SSH port of 127.0.0.1, .2 and .3, accepting connections and never answering:
    whoever probes a node there shows up in its queue."""
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port = first.getsockname()[1]
        listeners = [first]
        listeners += [stack.enter_context(socket.create_server((f"127.0.0.{i}", port))) for i in (2, 3)]
        for listener in listeners:
            listener.setblocking(False)
        yield listeners


def nobody_connected(listeners: list[socket.socket]) -> bool:
    for listener in listeners:
        try:
            listener.accept()[0].close()
        except BlockingIOError:
            continue
        return False
    return True


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["status", "--nodes", "nod02"], "--nodes: no node nod02 (did you mean node02?)"),
        (["doctor", "--nodes", "node01,node3"], "--nodes: no node node3 (did you mean node03?)"),
        (["fetch", "--nodes", "node1"], "--nodes: no node node1 (did you mean node01?)"),
        (["fetch", "qwen7b"], "no model qwen7b (did you mean qwen-7b?)"),
    ],
)
def test_a_wrong_name_stops_the_command_before_any_node_is_probed(
    silent_ssh: list[socket.socket], tmp_path: Path, args: list[str], said: str
) -> None:
    file = tmp_path / "cluster.yaml"
    file.write_text(fleet(["node01", "node02", "node03"], port=silent_ssh[0].getsockname()[1]))
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", args[0], "-f", str(file), *args[1:]],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {said} in {file}" in done.stderr
    assert "Traceback" not in done.stderr
    assert nobody_connected(silent_ssh)
