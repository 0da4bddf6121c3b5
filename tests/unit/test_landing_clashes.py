"""Two models whose files would land on one path of a node are refused by the loader, at
the later model's ``source``, naming the earlier model and the path."""

import time
from textwrap import dedent

import pytest

from llmgw_cli.core.clusterfile import refs
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.errors import SpecError

SHA_A, SHA_B = "a" * 64, "b" * 64

BASE = """\
cluster: {name: t}
nodes:
  - {name: n1, address: 10.0.0.1, weights: [/data/models, /srv/more]}
  - {name: n2, address: 10.0.0.2}
profiles:
  cpp: {engine: llama-server}
  vllm: {engine: vllm}
models:
"""
FIRST_MODEL_LINE = BASE.count("\n") + 1


def problems(models: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_cluster(BASE + dedent(models), "c.yaml")
    return [str(p) for p in info.value.problems]


def accepted(models: str) -> None:
    parse_cluster(BASE + dedent(models), "c.yaml")


def test_two_urls_of_one_file_name_are_refused_at_the_second_source() -> None:
    (message,) = problems(
        """\
        - {name: a, source: "https://a.example/x/m.gguf", profile: cpp}
        - {name: b, source: "https://b.example/y/m.gguf", profile: cpp}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 1}:21: models[1].source: downloads to ")
    assert "<first weights folder>/m.gguf, as models[0] ('a') does from https://a.example/x/m.gguf" in message
    assert "first weights folder under the URL's last path segment" in message
    assert "give both models the same URL" in message


def test_the_same_url_with_another_sha256_is_refused() -> None:
    (message,) = problems(
        f"""\
        - {{name: a, source: "https://a.example/m.gguf", profile: cpp, sha256: {SHA_A}}}
        - {{name: b, profile: cpp, sha256: {SHA_B},
            source: "https://a.example/m.gguf"}}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 2}:13: models[1].source: ")
    assert "is also the source of models[0] ('a'), with another sha256" in message
    assert "give both models the same sha256" in message


def test_a_url_over_the_file_a_relative_path_source_runs_from_is_refused_either_way() -> None:
    (message,) = problems(
        """\
        - {name: a, source: ./m.gguf, profile: cpp}
        - {name: b, source: "https://b.example/y/m.gguf", profile: cpp}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 1}:21: models[1].source: ")
    assert (
        "downloads to <first weights folder>/m.gguf, the path models[0] ('a') runs from (./m.gguf)" in message
    )
    (message,) = problems(
        """\
        - {name: a, source: "https://b.example/y/Qwen-7B", profile: cpp}
        - {name: b, source: ./Qwen-7B/model.gguf, profile: cpp}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 1}:21: models[1].source: ")
    assert "runs from <first weights folder>/Qwen-7B, where models[0] ('a') downloads" in message


def test_an_absolute_path_in_a_nodes_first_weights_folder_counts_as_that_folder() -> None:
    (message,) = problems(
        """\
        - {name: a, source: "https://b.example/y/m.gguf", profile: cpp}
        - {name: b, source: /data/models/m.gguf, profile: cpp}
        """
    )
    assert "runs from /data/models/m.gguf (in the first weights folder of node n1)" in message
    # n2 declares no folder: it downloads into the default one
    (message,) = problems(
        """\
        - {name: a, source: /var/lib/llmgw/models/m.gguf, profile: cpp}
        - {name: b, source: "https://b.example/y/m.gguf", profile: cpp}
        """
    )
    assert "downloads to /var/lib/llmgw/models/m.gguf (in the first weights folder of node n2)" in message
    # a second weights folder, or one elsewhere, is never downloaded into
    accepted(
        """\
        - {name: a, source: "https://b.example/y/m.gguf", profile: cpp}
        - {name: b, source: /srv/more/m.gguf, profile: cpp}
        - {name: c, source: /elsewhere/m.gguf, profile: cpp}
        """
    )


def test_one_repository_revision_with_two_selections_is_refused() -> None:
    (message,) = problems(
        """\
        - {name: a, source: org/r, profile: vllm, fetch: {}}
        - {name: b, source: org/r@main, profile: vllm, fetch: {exclude: ["*.pt"]}}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 1}:21: models[1].source: ")
    assert "fetches org/r@main as models[0] ('a') does, with other files" in message
    assert "<first weights folder>/hf/org--r/<commit> and its manifest" in message
    assert "give both models the same `fetch`" in message
    # `fetch` unset is the default selection: llmgw fetches that repository too
    (message,) = problems(
        """\
        - {name: a, source: org/r, profile: vllm, fetch: {include: ["*.json"]}}
        - {name: b, source: org/r, profile: vllm}
        """
    )
    assert "fetches org/r@main as models[0] ('a') does, with other files" in message
    accepted(
        """\
        - {name: a, source: org/r, profile: vllm, fetch: {}}
        - {name: b, source: org/r, profile: vllm}
        """
    )


def test_a_url_named_like_the_repositories_folder_is_refused_beside_a_fetched_repository() -> None:
    (message,) = problems(
        """\
        - {name: a, source: "https://h.example/hf", profile: cpp}
        - {name: b, source: org/r, profile: vllm, fetch: {}}
        """
    )
    assert message.startswith(f"c.yaml:{FIRST_MODEL_LINE + 1}:21: models[1].source: ")
    assert "fetches its repository into <first weights folder>/hf, where models[0] ('a') downloads" in message


def test_what_shares_files_harmlessly_is_accepted() -> None:
    accepted(
        f"""\
        - {{name: a, source: org/r, profile: vllm, fetch: {{include: ["*.json", "*.safetensors"]}}}}
        - {{name: b, source: org/r, profile: vllm, fetch: {{include: ["*.safetensors", "*.json"]}}}}
        - {{name: c, source: org/r@v1, profile: vllm, fetch: {{}}}}
        - {{name: d, source: org/r, profile: vllm, fetch: engine}}
        - {{name: f, source: "https://a.example/m.gguf", profile: cpp, sha256: {SHA_A}}}
        - {{name: g, source: "https://a.example/m.gguf", profile: cpp, sha256: {SHA_A}}}
        - {{name: h, source: "https://a.example/m.gguf", profile: cpp}}
        - {{name: i, source: ./m.gguf.d/x.gguf, profile: cpp}}
        - {{name: j, source: ./hf/org--r, profile: cpp}}
        - {{name: k, source: ./x.gguf, profile: cpp}}
        - {{name: l, source: /data/models/x.gguf, profile: cpp}}
        """
    )


def test_only_the_first_clash_of_a_model_is_reported_and_each_later_model_gets_its_own() -> None:
    found = problems(
        """\
        - {name: a, source: ./m.gguf, profile: cpp}
        - {name: b, source: "https://b.example/m.gguf", profile: cpp}
        - {name: c, source: "https://c.example/m.gguf", profile: cpp}
        """
    )
    assert [m.split(": ", 2)[1] for m in found] == ["models[1].source", "models[2].source"]
    assert "the path models[0] ('a') runs from" in found[0]
    assert "the path models[0] ('a') runs from" in found[1]


def test_hostile_or_broken_values_are_left_to_validation() -> None:
    """The check reads the raw data: values of the wrong type are skipped, not raised on."""
    data = {
        "nodes": [{"name": "n", "weights": "nope"}, {"weights": [{"path": 3}]}, "x"],
        "models": [
            {"source": 3},
            {"source": "https://a/m\ngguf"},
            {"source": "org/r", "fetch": {"include": "x"}},
            {"source": "org/r", "fetch": {"include": ["*"]}},
            {"source": "org/r@..", "fetch": {}},
            {"source": "http://a/m.gguf"},
            "not a model",
        ],
    }
    assert list(refs._landing_clashes(data)) == []


def test_a_file_of_many_models_is_checked_in_linear_time() -> None:
    """Each model is compared with what is indexed of the earlier ones, never with each of
    them: forty thousand models whose URLs all end in one name take a moment, not minutes."""
    count = 40_000
    data = {
        "models": [{"name": f"m{i}", "source": f"https://h{i}.example/m.gguf"} for i in range(count)]
        + [{"name": "r", "source": "org/r", "fetch": {"include": [str(i)]}} for i in range(count)]
    }
    started = time.monotonic()
    found = list(refs._landing_clashes(data))
    assert len(found) == 2 * count - 2
    assert time.monotonic() - started < 20
