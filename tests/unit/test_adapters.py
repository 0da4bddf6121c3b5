"""LoRA adapters: the cluster file's rules, the engine's flags, where the files are on a
node, what the gateway sends to load one, and the routing preference for replicas that
have it loaded (core/serving/adapters.py, core/engine/engines.py, core/serving/routing.py)."""

from __future__ import annotations

import json
from textwrap import dedent

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import (
    LORA_RUNTIME_VAR,
    Member,
    adapter_path,
    engine_args,
    environment,
    replica_unit,
    spec_hash,
)
from llmgw_cli.core.planning.plan import Action, Plan
from llmgw_cli.core.serving.adapters import adapter_needs, adapter_table, load_body, loaded_by_answer, node_at
from llmgw_cli.core.serving.affinity import Policy, Reason, Thresholds
from llmgw_cli.core.serving.engine_signals import Signals
from llmgw_cli.core.serving.routing import Health, Pool
from llmgw_cli.errors import SpecError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
BASE = f"""\
cluster: {{name: t}}
nodes:
  - {{name: n1, address: 10.0.0.1, weights: [/data/models]}}
  - {{name: n2, address: 10.0.0.2, engine_address: 10.1.0.2}}
profiles:
  vllm: {{engine: vllm}}
  cpp: {{engine: llama-server}}
  sgl: {{engine: sglang}}
models:
  - name: chat
    source: org/base@{COMMIT}
    profile: vllm
    scaling: {{min: 1, max: 1}}
"""
ADAPTERS = f"""\
    adapters:
      - {{name: chat-sql, source: org/sql-lora@{COMMIT}}}
      - {{name: chat-local, source: ./loras/local}}
"""


def load(text: str) -> ClusterSpec:
    return parse_cluster(dedent(text), "c.yaml")


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_cluster(dedent(text), "c.yaml")
    return [str(p) for p in info.value.problems]


# --- the cluster file ------------------------------------------------------------------


def test_a_model_lists_adapters_by_name_and_source() -> None:
    spec = load(BASE + ADAPTERS)
    chat = spec.model("chat")
    assert [a.name for a in chat.adapters] == ["chat-sql", "chat-local"]
    assert chat.adapters[0].repo_ref is not None and chat.adapters[0].repo_ref.revision == COMMIT
    assert chat.adapters[1].repo_ref is None
    assert chat.lora.max_loras == 4 and chat.lora.max_rank == 16


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("org/sql-lora", "names its commit"),
        ("org/sql-lora@main", "names its commit"),
        ("https://example.com/lora.safetensors", "not a URL"),
        ("./loras/../../etc", "`..`"),
        ("loras", "is not a source"),
    ],
)
def test_bad_adapter_sources_are_refused_with_their_line(source: str, why: str) -> None:
    (found,) = problems(BASE + f"    adapters: [{{name: x, source: '{source}'}}]\n")
    assert found.startswith("c.yaml:14:") and "models[0].adapters[0].source" in found, found
    assert why in found, found


@pytest.mark.parametrize(
    "name", ["-lead", "has space", "new\nline", "a" * 129, "x;rm", "../up", "semi%colon", "caf\u00e9"]
)
def test_hostile_adapter_names_are_refused_as_model_names_are(name: str) -> None:
    found = problems(BASE + f"    adapters: [{{name: {json.dumps(name)}, source: ./a}}]\n")
    assert found and all("models[0].adapters[0].name" in p for p in found), found
    assert any("not a model name" in p or "control character" in p for p in found), found


def test_an_adapter_name_that_is_a_model_an_alias_or_another_adapter_is_refused() -> None:
    text = (
        BASE
        + "    aliases: [small]\n"
        + "    adapters:\n"
        + "      - {name: chat, source: ./a}\n"
        + "      - {name: small, source: ./b}\n"
        + "      - {name: twice, source: ./c}\n"
        + "      - {name: twice, source: ./d}\n"
        + "      - {name: other, source: ./e}\n"
        + "  - {name: other, source: org/o@"
        + COMMIT
        + ", profile: vllm}\n"
    )
    found = problems(text)
    assert found == [
        "c.yaml:16:16: models[0].adapters[0].name: adapter 'chat' is the name of models[0]: a request "
        "for it would be that model; rename the adapter",
        "c.yaml:17:16: models[0].adapters[1].name: adapter 'small' is an alias of models[0]: one name "
        "answers as one model; rename the adapter or the alias",
        "c.yaml:19:16: models[0].adapters[3].name: adapter 'twice' is already an adapter of models[0]: "
        "rename one of them",
        "c.yaml:20:16: models[0].adapters[4].name: adapter 'other' is the name of models[1]: a request "
        "for it would be that model; rename the adapter",
    ]


@pytest.mark.parametrize(("profile", "engine"), [("cpp", "llama-server"), ("sgl", "sglang")])
def test_an_engine_that_cannot_serve_adapters_is_refused_with_the_reason(profile: str, engine: str) -> None:
    text = BASE.replace("profile: vllm", f"profile: {profile}").replace(
        f"org/base@{COMMIT}", "/data/models/base.gguf" if profile == "cpp" else f"org/base@{COMMIT}"
    )
    (found,) = problems(text + "    adapters: [{name: x, source: ./a}]\n")
    assert found.startswith("c.yaml:14:") and "models[0].adapters:" in found, found
    assert f"the profile's engine '{engine}' cannot serve adapters" in found, found
    assert "run the model with vLLM or remove its adapters" in found


def test_lora_limits_take_the_ranks_vllm_takes() -> None:
    (found,) = problems(BASE + ADAPTERS + "    lora: {max_rank: 12}\n")
    assert "models[0].lora.max_rank" in found and "16" in found and "512" in found, found


# --- the unit: LoRA on, no adapter at start --------------------------------------------


def _argv(spec: ClusterSpec) -> list[str]:
    node = spec.node("n1")
    member = Member(node, 0, ("GPU-0",))
    return engine_args(spec, spec.model("chat"), member, port=8100, head=node, dist_port=29500)


def test_vllm_with_adapters_starts_with_lora_on_and_runtime_loading_allowed() -> None:
    spec = load(BASE + ADAPTERS + "    lora: {max_loras: 2, max_rank: 64}\n")
    argv = _argv(spec)
    assert argv[argv.index("--enable-lora") :][:5] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "64",
    ]
    assert not any("lora-modules" in a or "sql-lora" in a for a in argv)  # the gateway loads them
    env = environment(spec, spec.model("chat"), Member(spec.node("n1"), 0, ("GPU-0",)))
    assert env[LORA_RUNTIME_VAR] == "True"
    unit = replica_unit(
        spec, spec.model("chat"), replica=0, member=Member(spec.node("n1"), 0, ("GPU-0",)), port=8100,
        members=(Member(spec.node("n1"), 0, ("GPU-0",)),), dist_port=29500,
    )  # fmt: skip
    assert f'Environment="{LORA_RUNTIME_VAR}=True"' in unit.text.splitlines()
    assert " --enable-lora --max-loras 2 --max-lora-rank 64" in unit.text


def test_without_adapters_nothing_changes_not_even_the_spec_hash() -> None:
    plain = load(BASE)
    argv = _argv(plain)
    assert "--enable-lora" not in argv
    env = environment(plain, plain.model("chat"), Member(plain.node("n1"), 0, ("GPU-0",)))
    assert LORA_RUNTIME_VAR not in env
    # limits written without adapters shape nothing: an upgrade replaces no replica
    limited = load(BASE + "    lora: {max_loras: 8}\n")
    assert spec_hash(limited, limited.model("chat")) == spec_hash(plain, plain.model("chat"))


def test_which_adapters_a_model_has_replaces_no_replica_once_it_has_one() -> None:
    one = load(BASE + f"    adapters: [{{name: a, source: org/a@{COMMIT}}}]\n")
    two = load(BASE + ADAPTERS)
    plain = load(BASE)
    assert spec_hash(one, one.model("chat")) == spec_hash(two, two.model("chat"))
    assert spec_hash(one, one.model("chat")) != spec_hash(plain, plain.model("chat"))  # LoRA on
    bigger = load(BASE + ADAPTERS + "    lora: {max_rank: 32}\n")
    assert spec_hash(bigger, bigger.model("chat")) != spec_hash(two, two.model("chat"))


# --- the files on a node and the load request ------------------------------------------


def test_an_adapters_path_is_built_from_the_nodes_weights_folder() -> None:
    spec = load(BASE + ADAPTERS + "      - {name: chat-abs, source: /srv/loras/abs}\n")
    sql, local, absolute = spec.model("chat").adapters
    n1, n2 = spec.node("n1"), spec.node("n2")
    assert adapter_path(sql, n1) == f"/data/models/hf/org--sql-lora/{COMMIT}"
    assert adapter_path(local, n1) == "/data/models/loras/local"
    assert adapter_path(absolute, n2) == "/srv/loras/abs"
    assert adapter_path(local, n2).endswith("/loras/local") and adapter_path(local, n2).startswith("/")


def test_the_load_request_names_the_adapter_and_the_path_llmgw_built() -> None:
    spec = load(BASE + ADAPTERS)
    table = adapter_table(spec.models)
    assert {n: s.base for n, s in table.items()} == {"chat-sql": "chat", "chat-local": "chat"}
    node = node_at(spec, "10.1.0.2:8100")  # n2 serves on its engine address
    assert node is not None and node.name == "n2"
    assert node_at(spec, "10.9.9.9:8100") is None
    body = json.loads(load_body(table["chat-sql"].adapter, spec.node("n1")))
    assert body == {"lora_name": "chat-sql", "lora_path": f"/data/models/hf/org--sql-lora/{COMMIT}"}


def test_vllm_answers_that_mean_loaded() -> None:
    assert loaded_by_answer(200, b"Success: LoRA adapter 'x' added successfully.")
    assert loaded_by_answer(400, b'{"message": "The lora adapter \'x\' has already been loaded."}')
    assert not loaded_by_answer(400, b'{"message": "No adapter found for /x"}')
    assert not loaded_by_answer(404, b"Not Found")


def test_repo_adapters_are_fetched_onto_the_nodes_of_replicas_kept_or_started() -> None:
    spec = load(BASE + ADAPTERS)
    plan = Plan(
        actions=(
            Action(op="+", model="chat", replica=1, nodes=("n2",), reason="new"),
            Action(op="=", model="chat", replica=0, nodes=("n1",), reason="up to date"),
            Action(op="-", model="chat", replica=2, nodes=("n3",), reason="gone"),
        ),
        unplaced=(),
        warnings=(),
        facts_digest="",
    )
    needs = adapter_needs(spec, plan)
    assert list(needs) == ["chat-sql"]  # a path adapter is on the nodes already
    adapter, nodes = needs["chat-sql"]
    assert adapter.name == "chat-sql" and nodes == ["n2", "n1"]


# --- routing: replicas that have it loaded first ----------------------------------------


def _pool(*addresses: str) -> Pool:
    pool = Pool()
    pool.replace({"chat": list(addresses)}, 0.0)
    for r in pool.of("chat"):
        pool.checked(r, 200, 0.0)
    return pool


def _choose(pool: Pool, prefer: str | None, policy: Policy = Policy.least_load) -> str:
    found = pool.choose(
        "chat", 1.0, key=None, policy=policy, thresholds=Thresholds(), stale_after=10, prefer=prefer
    )
    assert found is not None
    return found[0].address


def test_a_replica_with_the_adapter_loaded_is_preferred_over_a_less_busy_one() -> None:
    pool = _pool("a:1", "b:1", "c:1")
    b = pool.replicas["chat"]["b:1"]
    b.adapters.add("chat-sql")
    b.outstanding = 1  # busier than a and c, within the bounded-load limit
    assert _choose(pool, None) != "b:1"  # the base model: least load
    assert {_choose(pool, "chat-sql", policy) for policy in Policy} == {"b:1"}
    assert _choose(pool, "chat-local") != "b:1"  # another adapter: loaded nowhere


def test_an_overloaded_replica_with_the_adapter_yields_to_another_which_will_load_it() -> None:
    pool = _pool("a:1", "b:1")
    b = pool.replicas["chat"]["b:1"]
    b.adapters.add("chat-sql")
    b.outstanding = 5  # past (1 + 0.25) x the mean (2.5), plus one
    assert _choose(pool, "chat-sql") == "a:1"
    b.outstanding = 0
    pool.scraped(b, Signals(running=1, waiting=9, kv_usage=0.1), 1.0)  # its engine's queue
    assert _choose(pool, "chat-sql") == "a:1"


def test_a_replica_whose_health_changes_forgets_its_adapters() -> None:
    pool = _pool("a:1", "b:1")
    b = pool.replicas["chat"]["b:1"]
    b.adapters.add("chat-sql")
    pool.checked(b, 503, 2.0)  # restarting: its engine holds no adapter
    assert b.health is Health.failing and not b.adapters
    pool.checked(b, 200, 3.0)
    assert not b.adapters
    assert Reason.least_load.value == _reason(pool)


def _reason(pool: Pool) -> str:
    found = pool.choose(
        "chat", 4.0, key=None, policy=Policy.least_load, thresholds=Thresholds(), stale_after=10, prefer="x"
    )
    assert found is not None
    return found[1].value
