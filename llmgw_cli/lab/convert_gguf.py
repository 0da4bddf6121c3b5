"""Convert a GGUF model (SmolLM2-135M's) to the Hugging Face format vLLM's CPU build serves.

Run as a file by the vLLM venv's interpreter (``build-vllm-cpu --model GGUF``), which has
transformers, gguf and accelerate: ``python convert_gguf.py GGUF OUT``. The weights are
de-quantized to bfloat16 and saved as ``model.safetensors`` with the tokenizer and chat
template; every file is left readable by all, since the engines run as their own account.
"""

# The engine modules are imported where they are used: this file runs under the
# engine's interpreter, and llmgw's own never imports them.
# ruff: noqa: PLC0415
from __future__ import annotations

import os
import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found,import-untyped,unused-ignore]

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain bfloat16 now: saved with the GGUF's quantization marks, the
    # folder would claim a quantization no engine could load.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    for path in tmp.iterdir():
        path.chmod(0o644)  # save_pretrained may leave the weights readable by their owner only
    tmp.chmod(0o755)
    os.replace(tmp, out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: convert_gguf.py GGUF OUT")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
