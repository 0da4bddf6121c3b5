"""Which models a weights directory really holds.

The probe lists each directory two levels deep (``find -printf '%y\t%s\t%P\0'``) and the
shard names of each safetensors index, both as data (NUL-separated, base64-encoded): a name
may hold any byte but ``/`` and NUL, and is only ever compared and shown. A model counts only when complete: a non-empty
folder without ``.part``/``.incomplete`` files whose index shards are all present, or a
non-empty GGUF file. Half-downloaded or empty folders, and folders with a config but no
weight file, are not weights.
"""

from __future__ import annotations

from collections import defaultdict

from llmgw_cli.core.facts import ModelFiles

PARTIAL_SUFFIXES = (".part", ".incomplete", ".llmgw-tmp")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _file_reason(name: str, size: int) -> str | None:
    """Why a top-level file is not usable weights ("" when it is); None: not a model at all."""
    if name.endswith(PARTIAL_SUFFIXES):
        return "partial download"
    if not name.endswith(".gguf"):
        return None  # a stray file (README, checksum list...)
    return "empty file" if size == 0 else ""


def _folder_reason(names: set[str], shards: set[str]) -> str:
    """Why a model folder is not usable weights ("" when it is)."""
    missing = sorted(shards - names)
    partial = sorted(rel for rel in names if rel.endswith(PARTIAL_SUFFIXES))
    if not names:
        return "empty folder"
    if partial:
        return f"partial download ({partial[0]})"
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel in names):
        return "no weight files (*.safetensors, *.bin, *.gguf)"
    if missing:
        return f"{len(missing)} shard(s) named in the index are missing (e.g. {missing[0]})"
    return ""


def judge(
    directory: str, shared: bool, entries: list[tuple[str, int, str]], shards: dict[str, set[str]]
) -> list[ModelFiles]:
    """Models found in one directory from its ``(type, size, relative path)`` entries and
    ``{model folder: shard names listed in its index}``."""
    children: dict[str, list[tuple[int, str]]] = defaultdict(list)
    tops: dict[str, tuple[str, int]] = {}
    for kind, size, rel in entries:
        top, _, rest = rel.partition("/")
        if not rest:
            tops[top] = (kind, size)
        elif kind == "f":
            children[top].append((size, rest))
    models = []
    for name, (kind, file_size) in sorted(tops.items()):
        if name.startswith("."):
            continue
        if kind == "f":
            reason, size = _file_reason(name, file_size), file_size
            if reason is None:
                continue
        else:
            files = children.get(name, [])
            reason = _folder_reason({rel for _, rel in files}, shards.get(name, set()))
            size = sum(s for s, _ in files)
        models.append(
            ModelFiles(
                directory=directory, name=name, shared=shared, size=size, complete=not reason, reason=reason
            )
        )
    return models
