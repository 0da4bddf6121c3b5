"""Start-up checks of the simulated engines: GPUs and model sources.

Functions of their arguments (plus reading the model directory they are pointed at), so
they are unit-tested without starting a server. A failed check raises
``EngineStartError`` carrying the log line a real engine would die with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.errors import EngineStartError
from llmgw_cli.lab.engine_args import Kind

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HEALTHY = {"", "ok", "healthy", "good"}


@dataclass(frozen=True)
class SimGpu:
    """One line of the node's ``/etc/lab/gpus.csv``."""

    index: int
    name: str
    memory_mib: str
    uuid: str
    health: str = ""

    @property
    def healthy(self) -> bool:
        return self.health.strip().lower() in _HEALTHY


def parse_gpus_csv(text: str) -> list[SimGpu]:
    """``index,name,memory_MiB,uuid,driver_version[,health,...]``; blank and # lines skipped."""
    gpus = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        health = cells[5] if len(cells) > 5 else ""
        gpus.append(SimGpu(int(cells[0]), cells[1], cells[2], cells[3], health))
    return gpus


def _find_gpu(entry: str, gpus: list[SimGpu]) -> SimGpu | None:
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    # CUDA accepts full UUIDs and unique prefixes ("GPU-8932f937").
    wanted = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    matches = [
        g for g in gpus if (g.uuid if g.uuid.startswith("GPU-") else f"GPU-{g.uuid}").startswith(wanted)
    ]
    return matches[0] if len(matches) == 1 else None


def select_gpus(visible: str | None, gpus: list[SimGpu], needed: int | None) -> list[SimGpu]:
    """The GPUs a CUDA process would get, or the error a real engine dies with.

    Unset ``CUDA_VISIBLE_DEVICES`` means every GPU, of which the engine uses the first
    ``needed``. When it is set, llmgw chose the devices, so the count must equal the
    per-node share exactly: more would leave GPUs reserved but idle, a placement bug.
    ``needed=None`` (share unknown, Ray) checks only that the devices exist and are healthy.
    """
    if visible is None:
        chosen = gpus if needed is None else gpus[:needed]
    else:
        chosen = []
        for entry in (e.strip() for e in visible.split(",") if e.strip()):
            gpu = _find_gpu(entry, gpus)
            if gpu is None:
                raise EngineStartError(
                    f"RuntimeError: CUDA error: invalid device ordinal: CUDA_VISIBLE_DEVICES={visible} "
                    f"names {entry!r}, which this node does not have"
                )
            if gpu in chosen:
                raise EngineStartError(
                    f"RuntimeError: CUDA error: CUDA_VISIBLE_DEVICES={visible} lists GPU {gpu.index} twice"
                )
            chosen.append(gpu)
        if not chosen:
            raise EngineStartError("RuntimeError: No CUDA GPUs are available")
        if needed is not None and len(chosen) > needed:
            raise EngineStartError(
                f"ValueError: CUDA_VISIBLE_DEVICES={visible} exposes {len(chosen)} GPUs but this node's "
                f"share of the world is {needed} (lab check: GPUs would be reserved but idle)"
            )
    if needed is not None and len(chosen) < needed:
        raise EngineStartError(
            f"ValueError: World size ({needed}) is larger than the number of available GPUs ({len(chosen)}) "
            f"in this node. CUDA_VISIBLE_DEVICES={visible}"
        )
    for gpu in chosen:
        if not gpu.healthy:
            raise EngineStartError(
                f"RuntimeError: CUDA error: uncorrectable ECC error encountered on GPU {gpu.index} "
                f"({gpu.uuid}, health {gpu.health!r})"
            )
    return chosen


def check_model_source(model: str, kind: Kind, offline: bool) -> int | None:
    """Check a local model directory or accept a hub id; return its max context if known."""
    path = Path(model)
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return None
            raise EngineStartError(f"ValueError: {model} is a file, not a model directory")
        return _check_local_dir(path, kind)
    if model.startswith(("/", "./", "../", "~")) or not _REPO_ID.match(model):
        raise EngineStartError(
            f"huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
            f"'namespace/repo_name': '{model}'. Use `repo_type` argument if needed."
        )
    if offline:
        raise EngineStartError(
            f"OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't "
            f"find them in the cached files. Check your internet connection for {model}."
        )
    return None


def _check_local_dir(path: Path, kind: Kind) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        if kind == "sglang":
            raise EngineStartError(f"OSError: {path} does not appear to have a file named config.json.")
        raise EngineStartError(
            f"ValueError: Invalid repository ID or local directory specified: '{path}'. Please verify "
            "the following requirements: 1. Provide a valid Hugging Face repository ID. 2. Specify a "
            "local directory that contains a recognized configuration file."
        )
    partial = sorted(p.name for p in path.iterdir() if p.suffix in (".part", ".incomplete"))
    if partial:
        raise EngineStartError(
            f"safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer "
            f"(incomplete download in {path}: {', '.join(partial)})"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineStartError(f"json.decoder.JSONDecodeError: {index}: {exc}") from exc
        for shard in sorted(shards):
            if not (path / shard).is_file():
                raise EngineStartError(
                    f"FileNotFoundError: [Errno 2] No such file or directory: '{path / shard}'"
                )
    elif not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise EngineStartError(f"RuntimeError: Cannot find any model weights with `{path}`")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise EngineStartError(f"json.decoder.JSONDecodeError: {config}: {exc}") from exc
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if isinstance(value, int) else None
