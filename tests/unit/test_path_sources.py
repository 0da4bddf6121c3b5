"""Path sources before a replica starts, the pure part: which paths each node is asked
about, the shape a path must have, how a node's answer (hostile data) is judged, and
which models of a plan need which kind of weights."""

from __future__ import annotations

import json

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts import node_access
from llmgw_cli.core.planning.plan import Action, Plan, UnitFile
from llmgw_cli.core.weights import path_sources
from llmgw_cli.core.weights.fetch import plan_weights
from llmgw_cli.core.weights.path_sources import (
    by_node,
    checks_for,
    judge,
    node_paths,
    not_there,
    parse_answer,
    plain_path,
)
from llmgw_cli.node import helper as node_helper

URL = "https://huggingface.co/org/repo/resolve/0123456789abcdef0123456789abcdef01234567/m.gguf"


def spec() -> ClusterSpec:
    return parse_cluster(
        "cluster: {name: t}\nnodes:\n"
        "  - {name: a, address: 10.0.0.1, weights: [/w/a, /w/other]}\n"
        "  - {name: b, address: 10.0.0.2, weights: ['/w/b/']}\n"
        "  - {name: c, address: 10.0.0.3}\n"
        "profiles: {p: {engine: llama-server}, v: {engine: vllm}}\nmodels:\n"
        "  - {name: abs, source: /data/models/Qwen2.5-7B-Instruct/, profile: v}\n"
        "  - {name: rel, source: ./smol.gguf, profile: p}\n"
        f"  - {{name: url, source: '{URL}', profile: p}}\n"
        "  - {name: hub, source: org/engine-downloads, profile: v, fetch: engine}\n"
        "  - {name: snap, source: org/snap@0123456789abcdef0123456789abcdef01234567, profile: v, fetch: {}}\n"
    )


def test_each_node_may_be_asked_about_the_path_sources_as_it_sees_them() -> None:
    s = spec()
    assert node_paths(s, s.node("a")) == ["/data/models/Qwen2.5-7B-Instruct", "/w/a/smol.gguf"]
    assert node_paths(s, s.node("b")) == ["/data/models/Qwen2.5-7B-Instruct", "/w/b/smol.gguf"]
    assert node_paths(s, s.node("c")) == [
        "/data/models/Qwen2.5-7B-Instruct",
        "/var/lib/llmgw/models/smol.gguf",
    ]
    # the helper's configuration, as apply writes it, carries that list
    config = json.loads(node_access.helper_config(s, s.node("a")))
    assert config["paths"] == node_paths(s, s.node("a"))
    assert config["weights"] == ["/w/a", "/w/other"]


def test_only_path_sources_are_checked_on_each_of_their_nodes() -> None:
    s = spec()
    wanted = {"abs": ["a", "b"], "rel": ["c"], "url": ["a"], "hub": ["a"], "snap": ["b"]}
    assert checks_for(s, wanted) == (
        ("abs", "a", "/data/models/Qwen2.5-7B-Instruct"),
        ("abs", "b", "/data/models/Qwen2.5-7B-Instruct"),
        ("rel", "c", "/var/lib/llmgw/models/smol.gguf"),
    )


def test_a_plan_sorts_its_started_replicas_by_what_their_weights_need() -> None:
    s = spec()
    unit = UnitFile(node="a", name="llmgw-x-0.service", text="")

    def act(op: str, model: str, nodes: tuple[str, ...], write: bool = True) -> Action:
        return Action(op=op, model=model, replica=0, nodes=nodes, reason="", write=(unit,) if write else ())

    plan = Plan(
        actions=(
            act("+", "abs", ("a", "b")),  # a replica of two nodes: both are asked
            act("~", "abs", ("b", "c")),
            act("+", "url", ("a",)),
            act("+", "snap", ("c",)),
            act("+", "hub", ("a",)),  # the engine downloads it: nothing to bring or check
            act("=", "rel", ("a",)),  # running: nothing starts
            act("-", "rel", ("b",), write=False),  # a stop writes nothing
        ),
        unplaced=(),
        warnings=(),
        facts_digest="",
    )
    need = plan_weights(s, plan)
    assert need.paths == {"abs": ["a", "b", "c"]}
    assert need.files == {"url": ["a"]}
    assert need.repos == {"snap": ["c"]}


@pytest.mark.parametrize(
    ("path", "plain"),
    [
        ("/data/models/x", True),
        ("/", True),
        ("data/models/x", False),
        ("./x", False),
        ("/data/../etc/shadow", False),
        ("/data/./x", False),
        ("/data//x", False),
        ("//data/x", False),  # POSIX normpath keeps a leading //
        ("/data/x/", False),
        ("/data/x\x00y", False),
        ("/data/x\ny", False),
        ("/data/x\ty", False),
        ("/" + "a" * 4095, True),
        ("/" + "a" * 4096, False),
        ("/data/..x/y", True),  # a name that starts with dots is a name
    ],
)
def test_plain_paths_the_same_for_llmgw_and_the_node_helper(path: str, plain: bool) -> None:
    assert plain_path(path) is plain
    assert node_helper.plain_path(path) is plain
    assert node_helper.MAX_PATHS == path_sources.MAX_PATHS
    assert node_helper.MAX_PATH_CHARS == path_sources.MAX_PATH_CHARS


def test_each_node_is_asked_each_plain_path_once() -> None:
    checks = [
        ("m", "a", "/p/x"),
        ("n", "a", "/p/x"),  # two models from one folder: one question
        ("m", "b", "/p/x"),
        ("bad", "a", "/p/../etc/shadow"),  # never sent
    ]
    assert by_node(checks) == {"a": ["/p/x"], "b": ["/p/x"]}


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"kind": "file", "empty": False}, ""),
        ({"kind": "dir", "empty": False}, ""),
        ({"kind": "missing", "empty": True}, "missing"),
        ({"kind": "file", "empty": True}, "an empty file"),
        ({"kind": "dir", "empty": True}, "an empty folder"),
        ({"kind": "other", "empty": True}, "neither a file nor a folder"),
        ({"kind": "unreadable", "empty": True}, "unreadable"),
        # hostile or broken answers never count as present
        ({"kind": "file"}, "the node gave no answer for it"),
        ({"kind": "file", "empty": 0}, "the node gave no answer for it"),
        ({"kind": "dir", "empty": "no"}, "the node gave no answer for it"),
        ({"kind": "symlink", "empty": False}, "the node gave no answer for it"),
        ({"kind": ["file"], "empty": False}, "the node gave no answer for it"),
        ("file", "the node gave no answer for it"),
        (None, "the node gave no answer for it"),
    ],
)
def test_an_answer_counts_only_a_non_empty_file_or_folder_as_there(entry: object, why: str) -> None:
    assert judge({"/p/x": entry}, "/p/x") == why


def test_a_folder_the_engine_account_cannot_read_whole_is_refused_with_the_file() -> None:
    blocked = {"path": "/p/x/w.bin\x1b[2J", "owner": "root", "mode": "0600"}
    entry = {"kind": "dir", "empty": False, "unreadable": {"llmgw": blocked, "other": None}}
    why = judge({"/p/x": entry}, "/p/x", "llmgw")
    assert why == "not readable by llmgw, the engine's account: /p/x/w.bin?[2J (owner root, mode 0600)"
    assert not_there("/p/x", "node03", why) == f"/p/x on node03 is {why}"
    assert judge({"/p/x": entry}, "/p/x", "other") == ""
    assert judge({"/p/x": entry}, "/p/x", "not-asked") == ""  # an account the node did not check
    assert judge({"/p/x": entry}, "/p/x") == ""


def test_an_answer_about_another_path_says_nothing_about_this_one() -> None:
    assert judge({"/p/y": {"kind": "file", "empty": False}}, "/p/x") == "the node gave no answer for it"
    assert judge({}, "/p/x") == "the node gave no answer for it"
    assert judge({"/p/../x": {"kind": "file", "empty": False}}, "/p/../x") == "not a plain absolute path"


@pytest.mark.parametrize(
    ("stdout", "parsed"),
    [
        ('{"/p": {"kind": "file", "empty": false}}\n', {"/p": {"kind": "file", "empty": False}}),
        (
            'motd line\n{"/p": {"kind": "missing", "empty": true}}\n',
            {"/p": {"kind": "missing", "empty": True}},
        ),
        ("", {}),
        ("not json\n", {}),
        ('["/p"]\n', {}),
        ('{"/p": {"kind": "file", "empty": false}}\ntrailing\n', {}),
    ],
)
def test_the_answer_is_the_last_line_as_a_json_object_or_nothing(
    stdout: str, parsed: dict[str, object]
) -> None:
    assert parse_answer(stdout) == parsed


def test_the_message_names_the_path_the_node_and_why() -> None:
    assert (
        not_there("/data/models/Qwen2.5-7B-Instruct", "node03", "missing")
        == "/data/models/Qwen2.5-7B-Instruct is not on node03 (missing)"
    )
