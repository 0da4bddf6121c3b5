"""Repository models fetched by llmgw: the revision pinned to a commit, the engine given
the snapshot folder with the Hub switched off; ``fetch: engine`` keeps the repo id (pure)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmgw_cli.cli.apply_steps import _choose
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import Member, engine_args, environment, model_path
from llmgw_cli.core.planning.plan import make_plan
from llmgw_cli.core.weights.pins import parse_pins, pin, pins_file, pins_text, unpinned, with_pins_file
from llmgw_cli.core.weights.snapshot import Selection
from llmgw_cli.errors import InputError, SpecError, Unpinned

C1, C2 = "a1" * 20, "2" * 40

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1, weights: [/data/w]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
  sglang: {engine: sglang, ports: 8200-8299}
models:
  - {name: fetched, source: org/big@main, profile: vllm, fetch: {exclude: ["original/*"]}}
  - {name: defaults, source: org/small, profile: sglang, fetch: {}}
  - {name: pinned, source: "org/fixed@COMMIT", profile: vllm, fetch: {}}
  - {name: engine, source: org/own@v2, profile: vllm, fetch: engine}
  - {name: engine-main, source: org/plain, profile: sglang, fetch: engine}
""".replace("COMMIT", C2)


def spec() -> ClusterSpec:
    return parse_cluster(CLUSTER)


def argv(s: ClusterSpec, name: str) -> list[str]:
    member = Member(s.node("a"), 0, ("GPU-0",))
    return engine_args(s, s.model(name), member, port=8100, head=member.node, dist_port=29500)


def test_only_fetched_repositories_at_a_branch_need_a_pin() -> None:
    assert unpinned(spec()) == ["fetched", "defaults"]


def test_a_repository_with_fetch_unset_is_fetched_like_fetch_braces() -> None:
    s = parse_cluster(CLUSTER + "  - {name: unset, source: org/plain, profile: sglang}\n")
    unset = s.model("unset")
    assert unset.fetch is None
    assert unset.selection == s.model("defaults").selection == Selection()
    assert unpinned(s) == ["fetched", "defaults", "unset"]
    with pytest.raises(Unpinned, match="unset: org/plain is not resolved"):
        model_path(unset, s.node("a"))
    s = pin(s, {"unset": C1})
    assert argv(s, "unset")[argv(s, "unset").index("--model-path") + 1] == f"/data/w/hf/org--plain/{C1}"
    member = Member(s.node("a"), 0, ("GPU-0",))
    assert environment(s, s.model("unset"), member)["HF_HUB_OFFLINE"] == "1"


def test_a_pinned_model_runs_from_its_snapshot_folder_with_the_hub_off() -> None:
    s = pin(spec(), {"fetched": C1, "defaults": C1})
    assert unpinned(s) == []
    assert s.model("fetched").source == f"org/big@{C1}"
    assert argv(s, "fetched")[2] == f"/data/w/hf/org--big/{C1}"
    assert argv(s, "defaults")[argv(s, "defaults").index("--model-path") + 1] == f"/data/w/hf/org--small/{C1}"
    member = Member(s.node("a"), 0, ("GPU-0",))
    assert environment(s, s.model("fetched"), member)["HF_HUB_OFFLINE"] == "1"
    assert "--revision" not in argv(s, "fetched")  # the folder is the commit's


def test_an_unresolved_model_has_no_path_rather_than_a_guessed_one() -> None:
    s = spec()
    with pytest.raises(Unpinned, match="fetched: org/big@main is not resolved"):
        model_path(s.model("fetched"), s.node("a"))
    assert model_path(s.model("pinned"), s.node("a")) == f"/data/w/hf/org--fixed/{C2}"


def test_an_engine_that_downloads_itself_gets_the_repo_id_and_its_revision() -> None:
    s = spec()
    args = argv(s, "engine")
    assert args[2] == "org/own"
    assert args[args.index("--revision") + 1] == "v2"
    assert "--revision" not in argv(s, "engine-main")  # main: the engine's own default
    member = Member(s.node("a"), 0, ("GPU-0",))
    assert "HF_HUB_OFFLINE" not in environment(s, s.model("engine"), member)


def test_a_pin_is_kept_only_while_the_source_is_the_one_it_was_made_for() -> None:
    s = spec()
    text = pins_text(s, {"fetched": C1, "defaults": C1})
    assert parse_pins(s, text) == {"fetched": C1, "defaults": C1}
    moved = parse_cluster(CLUSTER.replace("org/big@main", "org/big@v3"))
    assert parse_pins(moved, text) == {"defaults": C1}


def pins(form: int, name: str, source: str, commit: str) -> str:
    return json.dumps({"format": form, "models": {name: {"source": source, "commit": commit}}})


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        pins(2, "fetched", "org/big@main", C1),
        pins(1, "fetched", "org/big@main", "../../etc"),
        pins(1, "fetched", "org/big@main", C1.upper()),
        pins(1, "pinned", f"org/fixed@{C2}", C1),
        pins(1, "nope", "org/big@main", C1),
        '{"format": 1, "models": []}',
        " " * (1 << 21),
        "[" * 100_000,  # nested past the JSON parser's depth: no RecursionError escapes
        b'{"format": 1, "models": {"fetched": "\xff"}}',  # not UTF-8
    ],
)
def test_a_pins_file_is_hostile_data(text: str | bytes) -> None:
    assert parse_pins(spec(), text) == {}


def test_a_bad_commit_is_refused() -> None:
    with pytest.raises(ValueError, match="40-hex"):
        pin(spec(), {"fetched": "abc"})


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{name: m, source: https://e.org/m.gguf, profile: vllm, fetch: {}}", "is for a repo id source"),
        ("{name: m, source: /models/m, profile: vllm, fetch: engine}", "is for a repo id source"),
        ("{name: m, source: org/m@a..b, profile: vllm}", "no '..'"),
        ("{name: m, source: org/m@v1.lock, profile: vllm}", ".lock"),
        ("{name: m, source: org/m, profile: vllm, fetch: {include: ['']}}", "at least 1 character"),
        ("{name: m, source: org/m, profile: vllm, fetch: everything}", "fetch"),
    ],
)
def test_bad_fetch_settings_are_located_errors(model: str, message: str) -> None:
    head = CLUSTER.split("models:")[0]
    with pytest.raises(SpecError) as info:
        parse_cluster(head + "models:\n  - " + model + "\n", "c.yaml")
    (problem,) = info.value.problems
    assert message in str(problem)
    assert str(problem).startswith("c.yaml:")


# --- the gateway's load: the pins file beside the cluster file ---------------------------


def planted(where: Path, how: str) -> None:
    """A pins file at ``where`` that must pin nothing."""
    good = pins_text(spec(), {"fetched": C1})
    if how == "garbage":
        where.write_bytes(b"\x00\xff{not json")
    elif how == "nested":
        where.write_text('{"format": 1, "models": ' + "[" * 100_000)
    elif how == "too big":  # a valid file padded past the limit
        where.write_text(good[:-2] + " " * (1 << 20) + good[-2:])
    elif how == "other source":
        where.write_text(good.replace("org/big@main", "org/big@v3"))
    elif how == "directory":
        where.mkdir()
    elif how == "fifo":  # opened without waiting for a writer
        os.mkfifo(where)
    elif how == "device":
        where.symlink_to("/dev/zero")


def test_the_gateway_pins_from_the_file_beside_its_cluster_file(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    assert pins_file(cluster) == tmp_path / "pins.json"
    assert unpinned(with_pins_file(spec(), cluster)) == ["fetched", "defaults"]  # no file: no pins
    pins_file(cluster).write_text(pins_text(spec(), {"fetched": C1, "defaults": C1}))
    loaded = with_pins_file(spec(), cluster)
    assert unpinned(loaded) == [] and loaded.model("fetched").source == f"org/big@{C1}"


@pytest.mark.parametrize(
    "how", ["garbage", "nested", "too big", "other source", "directory", "fifo", "device"]
)
def test_a_hostile_pins_file_beside_the_cluster_file_pins_nothing(tmp_path: Path, how: str) -> None:
    cluster = tmp_path / "cluster.yaml"
    planted(pins_file(cluster), how)
    loaded = with_pins_file(spec(), cluster)
    assert unpinned(loaded) == ["fetched", "defaults"]
    assert loaded.model("fetched").source == "org/big@main"


def test_a_saved_plan_is_refused_once_a_repository_names_another_commit(tmp_path: Path) -> None:
    """`llmgw plan --out` then `llmgw apply PLAN`: the saved units name the commit resolved
    when the plan was made; if the branch moved meanwhile, apply would give the gateway the
    new commit's pins beside units of the old one, so it refuses and says to plan again."""
    then = pin(spec(), {"fetched": C1, "defaults": C1})
    saved = make_plan(then, {})
    assert saved.commits == (("defaults", C1), ("fetched", C1), ("pinned", C2))
    path = tmp_path / "plan.json"
    path.write_text(saved.model_dump_json())
    chosen, _ = _choose(then, {}, path, [])  # nothing moved: the saved plan goes ahead
    assert chosen == saved
    now = pin(spec(), {"fetched": C2, "defaults": C1})
    with pytest.raises(
        InputError, match=f"fetched: planned at commit {C1[:12]}, its revision names {C2[:12]} now"
    ):
        _choose(now, {}, path, [])
