"""Model weight directories on lab nodes: complete ones and half-downloaded ones.

Pure: ``node_weights(index)`` says which model is where and in what state, and
``model_files`` renders a directory as ``{relative path: bytes}``. Shards are valid
safetensors files holding no tensors (a few dozen bytes), so the layout looks real to
anything that lists or indexes it without costing memory.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import StrEnum

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Download(StrEnum):
    complete = "complete"
    part = "part"  # a shard still being fetched, as `<shard>.part` (curl/wget/llmgw style)
    incomplete = "incomplete"  # huggingface_hub style `<shard>.incomplete`


@dataclass(frozen=True)
class LabModel:
    directory: str
    architecture: str
    shards: int
    max_position_embeddings: int


MODELS = (
    LabModel("Llama-3.1-8B-Instruct", "LlamaForCausalLM", 4, 131072),
    LabModel("Qwen2.5-7B-Instruct", "Qwen2ForCausalLM", 4, 32768),
    LabModel("Mistral-7B-Instruct-v0.3", "MistralForCausalLM", 3, 32768),
    LabModel("Llama-3.1-405B-Instruct", "LlamaForCausalLM", 8, 131072),
)


def node_weights(index: int) -> dict[str, Download]:
    """What node ``index`` (1-based) holds under /data/models, by directory name.

    Llama-3.1-8B and Mistral are complete everywhere; Qwen2.5-7B is complete on odd
    nodes and half-downloaded (``.part``) on even ones; Llama-3.1-405B is complete on
    node01 and node02, half-downloaded (``.incomplete``) on node03 and absent elsewhere.
    """
    found = {
        "Llama-3.1-8B-Instruct": Download.complete,
        "Mistral-7B-Instruct-v0.3": Download.complete,
        "Qwen2.5-7B-Instruct": Download.complete if index % 2 else Download.part,
    }
    if index <= 2:
        found["Llama-3.1-405B-Instruct"] = Download.complete
    elif index == 3:
        found["Llama-3.1-405B-Instruct"] = Download.incomplete
    return found


def _empty_safetensors() -> bytes:
    header = json.dumps({"__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def model_files(model: LabModel, state: Download) -> dict[str, bytes]:
    """The files of one model directory; in a partial download the last shard is unfinished."""
    names = [f"model-{i:05d}-of-{model.shards:05d}.safetensors" for i in range(1, model.shards + 1)]
    config = {
        "architectures": [model.architecture],
        "max_position_embeddings": model.max_position_embeddings,
        "torch_dtype": "bfloat16",
    }
    shard = _empty_safetensors()
    index = {
        "metadata": {"total_size": len(shard) * model.shards},
        "weight_map": {f"model.layers.{i}.weight": name for i, name in enumerate(names)},
    }
    files = {
        "config.json": json.dumps(config, indent=2).encode() + b"\n",
        "model.safetensors.index.json": json.dumps(index, indent=2).encode() + b"\n",
        "tokenizer.json": b'{"version": "1.0"}\n',
    }
    for name in names[:-1]:
        files[name] = shard
    last = names[-1]
    if state is Download.complete:
        files[last] = shard
    else:
        files[f"{last}.{state.value}"] = shard[: len(shard) // 2]
    return files
