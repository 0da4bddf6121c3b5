"""OpenAI-shaped bodies of the simulated engines: deterministic text, token counts, chunks.

Pure: the HTTP layer passes in the request body and the clock values; the same request
always yields the same text, so tests and benchmarks can compare outputs.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from llmgw_cli.errors import RequestError
from llmgw_cli.lab.engine_args import EngineConfig

_WORDS = (
    "the",
    "lab",
    "engine",
    "answers",
    "with",
    "simulated",
    "tokens",
    "so",
    "that",
    "gateway",
    "tests",
    "see",
    "real",
    "streaming",
    "shapes",
    "and",
    "usage",
    "numbers",
    "every",
    "time",
)
DEFAULT_REPLY_TOKENS = 16
EMBEDDING_DIM = 16


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def models_body(cfg: EngineConfig, max_model_len: int, created: int) -> dict[str, Any]:
    owner = "vllm" if cfg.kind == "vllm" else "sglang"
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owner,
                "root": cfg.model,
                "parent": None,
                "max_model_len": max_model_len,
            }
            for name in cfg.served_names
        ],
    }


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_of(body: dict[str, Any], chat: bool) -> str:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages: field required")
        return "\n".join(
            f"{m.get('role')}: {_text_of(m.get('content'))}" for m in messages if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    if not isinstance(prompt, str):
        raise RequestError(400, "prompt: field required")
    return prompt


def count_tokens(text: str) -> int:
    """About one token per word or punctuation run, never zero."""
    return max(1, len(text.split()) + text.count("\n"))


def max_tokens_of(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {value}.")
    return value


def reply_tokens(model: str, prompt: str, max_tokens: int | None) -> tuple[list[str], str]:
    """The tokens of the reply and the finish reason; same inputs, same reply."""
    seed = hashlib.sha256(f"{model}\0{prompt}".encode()).digest()
    limit = DEFAULT_REPLY_TOKENS if max_tokens is None else min(max_tokens, DEFAULT_REPLY_TOKENS)
    tokens = [("" if i == 0 else " ") + _WORDS[(seed[i % len(seed)] + i) % len(_WORDS)] for i in range(limit)]
    if tokens:
        tokens[0] = tokens[0].capitalize()
    finish = "length" if max_tokens is not None and max_tokens < DEFAULT_REPLY_TOKENS else "stop"
    if finish == "stop" and tokens:
        tokens[-1] += "."
    return tokens, finish


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Completion:
    """One generated reply, rendered either whole or as stream chunks."""

    chat: bool
    model: str
    tokens: list[str]
    finish: str
    prompt_tokens: int
    rid: str = ""
    created: int = 0

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def new_completion(chat: bool, model: str, tokens: list[str], finish: str, prompt_tokens: int) -> Completion:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return Completion(chat, model, tokens, finish, prompt_tokens, rid, int(time.time()))


def full_body(c: Completion) -> dict[str, Any]:
    text = "".join(c.tokens)
    choice: dict[str, Any]
    if c.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": c.finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": c.finish}
    return {
        "id": c.rid,
        "object": c.object,
        "created": c.created,
        "model": c.model,
        "choices": [choice],
        "usage": usage(c.prompt_tokens, len(c.tokens)),
    }


def chunk(c: Completion, piece: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk; ``piece=None`` with ``finish`` set is the closing chunk."""
    choice: dict[str, Any]
    if c.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if piece is not None:
            delta["content"] = piece
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
    return {
        "id": c.rid,
        "object": c.chunk_object,
        "created": c.created,
        "model": c.model,
        "choices": [choice],
    }


def usage_chunk(c: Completion) -> dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: no choices, just usage."""
    return {
        "id": c.rid,
        "object": c.chunk_object,
        "created": c.created,
        "model": c.model,
        "choices": [],
        "usage": usage(c.prompt_tokens, len(c.tokens)),
    }


def embeddings_body(model: str, body: dict[str, Any]) -> dict[str, Any]:
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(400, "input: field required")
    data = []
    total = 0
    for i, item in enumerate(inputs):
        text = (
            item
            if isinstance(item, str)
            else " ".join(str(t) for t in item)
            if isinstance(item, list)
            else str(item)
        )
        total += count_tokens(text)
        digest = hashlib.sha256(text.encode()).digest()
        vector = [round((b - 127.5) / 127.5, 6) for b in digest[:EMBEDDING_DIM]]
        data.append({"index": i, "object": "embedding", "embedding": vector})
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
    }
