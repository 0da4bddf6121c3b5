"""Bodies of the simulated engines: deterministic replies, max_tokens, usage."""

from __future__ import annotations

import pytest

from llmgw_cli.errors import RequestError
from llmgw_cli.lab import engine_openai as oai
from llmgw_cli.lab.engine_args import parse_argv


def test_reply_is_deterministic_and_depends_on_the_prompt() -> None:
    a = oai.reply_tokens("m", "user: hi", None)
    assert a == oai.reply_tokens("m", "user: hi", None)
    assert a != oai.reply_tokens("m", "user: bye", None)
    tokens, finish = a
    assert len(tokens) == oai.DEFAULT_REPLY_TOKENS and finish == "stop"
    assert "".join(tokens).endswith(".")


def test_max_tokens_truncates_with_finish_length() -> None:
    tokens, finish = oai.reply_tokens("m", "p", 3)
    assert len(tokens) == 3 and finish == "length"
    assert oai.reply_tokens("m", "p", 100)[1] == "stop"


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_bad_max_tokens_is_a_400(bad: object) -> None:
    with pytest.raises(RequestError) as exc:
        oai.max_tokens_of({"max_tokens": bad})
    assert exc.value.status == 400


def test_max_completion_tokens_wins() -> None:
    assert oai.max_tokens_of({"max_completion_tokens": 4, "max_tokens": 9}) == 4


def test_stream_chunks_and_usage_chunk() -> None:
    c = oai.new_completion(True, "m", ["Hello", " world"], "stop", 5)
    first = oai.chunk(c, "", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = oai.usage_chunk(c)
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
    }
    body = oai.full_body(c)
    assert body["choices"][0]["message"]["content"] == "Hello world"


def test_models_body_matches_vllm_fixture_shape() -> None:
    cfg = parse_argv(["vllm", "serve", "/weights/Qwen3-1.7B", "--served-model-name", "prompt_model"])
    entry = oai.models_body(cfg, 16384, 1)["data"][0]
    assert {k: entry[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": "prompt_model",
        "object": "model",
        "owned_by": "vllm",
        "root": "/weights/Qwen3-1.7B",
        "parent": None,
        "max_model_len": 16384,
    }


def test_embeddings_are_deterministic() -> None:
    one = oai.embeddings_body("m", {"input": ["a b", "c"]})
    two = oai.embeddings_body("m", {"input": ["a b", "c"]})
    assert [d["embedding"] for d in one["data"]] == [d["embedding"] for d in two["data"]]
    assert len(one["data"][0]["embedding"]) == oai.EMBEDDING_DIM and one["usage"]["prompt_tokens"] == 3
