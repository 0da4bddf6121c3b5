"""A model's `aliases` and `fallbacks` in the cluster file: what the loader accepts, and
each mistake at its file, line and column, with what to do."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import spec_hash
from llmgw_cli.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
cluster: {name: t}
nodes:
  - {name: n1, address: 10.0.0.1}
profiles:
  vllm: {engine: vllm}
models:
"""


def problems(models: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_cluster(BASE + dedent(models), "c.yaml")
    return [str(p) for p in info.value.problems]


def load(models: str) -> ClusterSpec:
    return parse_cluster(BASE + dedent(models), "c.yaml")


def test_aliases_and_fallbacks_load_and_default_to_none() -> None:
    spec = load(
        """\
        - {name: a, source: org/a, profile: vllm, aliases: [gpt-4o-mini, org/a], fallbacks: [b, c]}
        - {name: b, source: org/b, profile: vllm, fallbacks: [c]}
        - {name: c, source: org/c, profile: vllm}
        """
    )
    assert spec.model("a").aliases == ["gpt-4o-mini", "org/a"]
    assert spec.model("a").fallbacks == ["b", "c"]
    assert spec.model("c").aliases == [] and spec.model("c").fallbacks == []


def test_each_alias_mistake_is_located_with_what_to_do() -> None:
    assert problems(
        """\
        - {name: a, source: org/a, profile: vllm, aliases: [x, b, a, x]}
        - {name: b, source: org/b, profile: vllm, aliases: [x, "gpt 4o", 7]}
        """
    ) == [
        "c.yaml:7:56: models[0].aliases[1]: alias 'b' is the name of models[1]: a request for it "
        "would be that model; remove the alias or rename one of the models",
        "c.yaml:7:59: models[0].aliases[2]: alias 'a' is the name of models[0]: a request for it "
        "would be that model; remove the alias",
        "c.yaml:7:62: models[0].aliases[3]: alias 'x' is given twice: remove one",
        "c.yaml:8:53: models[1].aliases[0]: alias 'x' is already an alias of models[0]: one name "
        "answers as one model; remove it from one of them",
        "c.yaml:8:56: models[1].aliases[1]: 'gpt 4o' is not a model name: letters, digits and "
        ". _ : / -, beginning with a letter or a digit, at most 128 characters",
        "c.yaml:8:66: models[1].aliases[2]: Input should be a valid string (got 7)",
    ]


def test_each_fallback_mistake_is_located_with_what_to_do() -> None:
    assert problems(
        """\
        - {name: a, source: org/a, profile: vllm, aliases: [mini], fallbacks: [a, qwen-7, mini, qwen-7b, qwen-7b]}
        - {name: qwen-7b, source: org/q, profile: vllm, fallbacks: [elsewhere]}
        """
    ) == [
        "c.yaml:7:72: models[0].fallbacks[0]: the model falls back to itself: remove 'a'",
        "c.yaml:7:75: models[0].fallbacks[1]: unknown model 'qwen-7' (did you mean 'qwen-7b'?): "
        "a fallback names a model of `models`",
        "c.yaml:7:83: models[0].fallbacks[2]: 'mini' is an alias of 'a': name the model itself ('a')",
        "c.yaml:7:98: models[0].fallbacks[4]: fallback 'qwen-7b' is given twice: remove one",
        "c.yaml:8:61: models[1].fallbacks[0]: unknown model 'elsewhere': a fallback names a model "
        "of `models`",
    ]


def test_a_cycle_is_refused_at_its_earliest_model_whatever_its_length() -> None:
    two = problems(
        """\
        - {name: a, source: org/a, profile: vllm, fallbacks: [b]}
        - {name: b, source: org/b, profile: vllm, fallbacks: [a]}
        """
    )
    assert two == [
        "c.yaml:7:55: models[0].fallbacks[0]: fallbacks form a cycle: a -> b -> a; remove one of "
        "these fallbacks (a model's fallbacks must never lead back to it)"
    ]
    # Walked from c (the first with fallbacks), reported at a, the earliest model of it.
    longer = problems(
        """\
        - {name: x, source: org/x, profile: vllm, fallbacks: [c]}
        - name: a
          source: org/a
          profile: vllm
          fallbacks: [x, b]
        - {name: b, source: org/b, profile: vllm, fallbacks: [c]}
        - {name: c, source: org/c, profile: vllm, fallbacks: [d]}
        - {name: d, source: org/d, profile: vllm, fallbacks: [a]}
        """
    )
    assert longer == [
        "c.yaml:7:55: models[0].fallbacks[0]: fallbacks form a cycle: x -> c -> d -> a -> x; "
        "remove one of these fallbacks (a model's fallbacks must never lead back to it)",
        "c.yaml:11:18: models[1].fallbacks[1]: fallbacks form a cycle: a -> b -> c -> d -> a; "
        "remove one of these fallbacks (a model's fallbacks must never lead back to it)",
    ]


def test_a_chain_that_meets_itself_without_a_cycle_is_fine() -> None:
    spec = load(
        """\
        - {name: a, source: org/a, profile: vllm, fallbacks: [b, c]}
        - {name: b, source: org/b, profile: vllm, fallbacks: [c]}
        - {name: c, source: org/c, profile: vllm}
        """
    )
    assert [m.name for m in spec.models] == ["a", "b", "c"]


def test_names_and_fallbacks_shape_no_unit() -> None:
    """The gateway's alone: adding them replaces no replica."""
    base = (ROOT / "inventories/single-box.yaml").read_text()
    spec = parse_cluster(base)
    name = spec.models[0].name
    named = parse_cluster(base.replace(f"name: {name}", f"name: {name}\n    aliases: [gpt-4o-mini]", 1))
    assert named.model(name).aliases == ["gpt-4o-mini"]
    assert spec_hash(named, named.model(name)) == spec_hash(spec, spec.model(name))


def test_a_hostile_catalog_is_checked_quickly_and_said_briefly() -> None:
    """Thousands of models in one cycle, each also naming an unknown model: one problem
    per mistake, the cycle's message naming a dozen models, not all of them."""
    n = 3000
    lines = [
        f"  - {{name: m{i}, source: org/m, profile: vllm, fallbacks: [m{(i + 1) % n}, ghost{i}]}}"
        for i in range(n)
    ]
    with pytest.raises(SpecError) as info:
        parse_cluster(BASE + "\n".join(lines) + "\n", "c.yaml")
    found = [str(p) for p in info.value.problems]
    assert len(found) == n + 1
    (cycle,) = [f for f in found if "cycle" in f]
    assert cycle.startswith("c.yaml:7:58: models[0].fallbacks[0]: fallbacks form a cycle: m0 -> m1 -> ")
    assert f"... ({n} models in all) -> m0;" in cycle and len(cycle) < 400
    assert "unknown model 'ghost5': a fallback names a model of `models`" in found[6]
