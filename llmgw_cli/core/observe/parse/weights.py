"""Which models a weights directory really holds.

The probe lists each directory two levels deep (``find -printf '%y\t%s\t%P\0'``) and the
shard names of each safetensors index, both as data (NUL-separated, base64-encoded): a name
may hold any byte but ``/`` and NUL, and is only ever compared and shown. A model counts only when complete: a non-empty
folder without ``.part``/``.incomplete`` files whose index shards are all present, or a
non-empty GGUF file. Half-downloaded or empty folders, and folders with a config but no
weight file, are not weights.

Repository snapshots live under the weights directory's ``hf/`` folder
(``hf/<org>--<name>/<commit>/...`` with ``hf/<org>--<name>/<commit>.manifest.json`` beside
each snapshot folder, written last). The probe lists that tree whole and sends each
manifest back; a snapshot counts, under the name ``hf/<org>--<name>/<commit>``, only when
its manifest reads as one of that repo and commit and every file it lists is on disk at
the size it records. Without a manifest (still fetching, or killed) or with a file missing
or of another size, it is listed with the reason and never counts as held.
"""

from __future__ import annotations

from collections import defaultdict

from llmgw_cli.core.observe.facts import ModelFiles
from llmgw_cli.core.weights.snapshot import (
    COMMIT,
    HF_FOLDER,
    MANIFEST_SUFFIX,
    OnDisk,
    complete_snapshot,
    parse_manifest,
    repo_folder_name,
)

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
        if name.startswith(".") or name == HF_FOLDER:
            continue  # hidden, or the snapshots' folder (``snapshots`` judges it)
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


def _snapshot_reason(folder: str, commit: str, manifest: str | None, files: dict[str, OnDisk]) -> str:
    """Why the snapshot ``hf/<folder>/<commit>`` is not complete ("" when it is)."""
    if manifest is None:
        return "partial snapshot: no manifest yet (still fetching, or stopped)"
    try:
        found = parse_manifest(manifest)
    except ValueError as e:
        return f"manifest unreadable: {e}"
    if found.commit != commit or repo_folder_name(found.repo) != folder:
        return f"manifest is of {found.repo}@{found.commit}"
    check = complete_snapshot(files, found)
    if check.missing:
        return f"{len(check.missing)} file(s) of the manifest missing (e.g. {check.missing[0]})"
    if check.wrong:
        path, what = check.wrong[0]
        return f"{len(check.wrong)} file(s) unlike the manifest (e.g. {path}: {what})"
    return ""


def snapshots(
    directory: str, shared: bool, entries: list[tuple[str, int, str]], manifests: dict[str, str]
) -> list[ModelFiles]:
    """The snapshots under ``directory``/hf from its ``(type, size, path under hf)`` entries
    and ``{"<org>--<name>/<commit>.manifest.json": text}``; names that are not a repo folder
    and a commit are not snapshots and are left out."""
    folders: set[tuple[str, str]] = set()
    files: dict[tuple[str, str], dict[str, OnDisk]] = defaultdict(dict)
    for kind, size, rel in entries:
        parts = rel.split("/", 2)
        if len(parts) < 2 or "--" not in parts[0]:
            continue
        folder, second = parts[0], parts[1]
        if len(parts) == 2:
            commit = second.removesuffix(MANIFEST_SUFFIX) if kind == "f" else second
            if COMMIT.fullmatch(commit):
                folders.add((folder, commit))
        elif kind == "f" and COMMIT.fullmatch(second):
            files[(folder, second)][parts[2]] = OnDisk(size)
    models = []
    for folder, commit in sorted(folders):
        on_disk = files.get((folder, commit), {})
        reason = _snapshot_reason(
            folder, commit, manifests.get(f"{folder}/{commit}{MANIFEST_SUFFIX}"), on_disk
        )
        models.append(
            ModelFiles(
                directory=directory,
                name=f"{HF_FOLDER}/{folder}/{commit}",
                shared=shared,
                size=sum(f.size for f in on_disk.values()),
                complete=not reason,
                reason=reason,
            )
        )
    return models
