"""Which models a weights directory really holds.

The probe lists each directory two levels deep (``find -printf '%y\t%s\t%P'``) and the
shard names of each safetensors index. A model counts only when complete: a non-empty
folder without ``.part``/``.incomplete`` files whose index shards are all present, or a
non-empty GGUF file. Half-downloaded or empty folders, and folders with a config but no
weight file, are not weights.
"""

from __future__ import annotations

from collections import defaultdict

from llmgw_cli.core.facts import ModelFiles

PARTIAL_SUFFIXES = (".part", ".incomplete", ".llmgw-tmp")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def judge(
    directory: str, shared: bool, entries: list[tuple[str, int, str]], shards: dict[str, set[str]]
) -> list[ModelFiles]:
    """Models found in one directory from its ``(type, size, relative path)`` entries and
    ``{model folder: shard names listed in its index}``."""
    children: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    tops: dict[str, tuple[str, int]] = {}
    for kind, size, rel in entries:
        top, _, rest = rel.partition("/")
        if rest:
            children[top].append((kind, size, rest))
        else:
            tops[top] = (kind, size)
    models = []
    for name, (kind, size) in sorted(tops.items()):
        if name.startswith("."):
            continue
        if kind == "f":
            if name.endswith(PARTIAL_SUFFIXES):
                reason = "partial download"
            elif size == 0:
                reason = "empty file"
            elif not name.endswith(".gguf"):
                continue  # a stray file, not a model
            else:
                reason = ""
            models.append(
                ModelFiles(
                    directory=directory,
                    name=name,
                    shared=shared,
                    size=size,
                    complete=not reason,
                    reason=reason,
                )
            )
            continue
        files = [(s, rel) for k, s, rel in children.get(name, []) if k == "f"]
        names = {rel for _, rel in files}
        missing = sorted(shards.get(name, set()) - names)
        partial = sorted(rel for rel in names if rel.endswith(PARTIAL_SUFFIXES))
        if not files:
            reason = "empty folder"
        elif partial:
            reason = f"partial download ({partial[0]})"
        elif not any(rel.endswith(WEIGHT_SUFFIXES) for rel in names):
            reason = "no weight files (*.safetensors, *.bin, *.gguf)"
        elif missing:
            reason = f"{len(missing)} shard(s) named in the index are missing (e.g. {missing[0]})"
        else:
            reason = ""
        models.append(
            ModelFiles(
                directory=directory,
                name=name,
                shared=shared,
                size=sum(s for s, _ in files),
                complete=not reason,
                reason=reason,
            )
        )
    return models
