"""Path sources checked on their nodes before a replica's units start (pure).

A model whose ``source`` is an absolute path or ``./name`` (in the node's first weights
folder, ``engines.model_path``) is used as is: llmgw brings nothing. Before its units are
started, each node of the replica is asked (the node helper's ``exists`` verb) whether
the path is there, a non-empty file or a non-empty folder; a node where it is not fails
its start, naming the path, instead of starting an engine that would crash-loop.

Here: which paths each node is asked about (``node_paths``, ``by_node``), the shape a
path must have to be asked about at all (``plain_path``, the helper's own rule), and how
a node's answer, hostile data, is judged (``parse_answer``, ``judge``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, Node, SourceKind
from llmgw_cli.core.engine.engines import model_path

MAX_PATHS = 64  # paths in one question to a node (the helper refuses more)
MAX_PATH_CHARS = 4096  # PATH_MAX: a longer path names nothing on the node
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

Check = tuple[str, str, str]  # (model, node, path), as in core/fetch.FetchPlan.checks


def is_path_source(model: Model) -> bool:
    return model.source_kind is SourceKind.path


def source_path(model: Model, node: Node) -> str:
    """The path a path-source model names on ``node`` (``engines.model_path``), without a
    trailing ``/``, which names the same folder."""
    return model_path(model, node).rstrip("/") or "/"


def node_paths(spec: ClusterSpec, node: Node) -> list[str]:
    """Every path source of the cluster as ``node`` sees it (sorted, each once): what the
    node helper may be asked about besides its weights folders."""
    return sorted({source_path(m, node) for m in spec.models if is_path_source(m)})


def checks_for(spec: ClusterSpec, wanted: Mapping[str, Iterable[str]]) -> tuple[Check, ...]:
    """``(model, node, path)`` for each path-source model of ``wanted`` (model -> nodes)
    on each of its nodes; other models are not checked here."""
    out: list[Check] = []
    for name, nodes in wanted.items():
        model = spec.model(name)
        if is_path_source(model):
            out += [(name, n, source_path(model, spec.node(n))) for n in nodes]
    return tuple(out)


def plain_path(path: str) -> bool:
    """An absolute, normalised path (no ``.``, ``..``, ``//``, trailing ``/``), without
    control characters or NUL, at most ``MAX_PATH_CHARS`` long: the only shape the node
    helper answers about."""
    return (
        path.startswith("/")
        and len(path) <= MAX_PATH_CHARS
        and not _CONTROL.search(path)
        and "//" not in path
        and (path == "/" or not path.endswith("/"))
        and all(part not in (".", "..") for part in path.split("/"))
    )


def by_node(checks: Iterable[Check]) -> dict[str, list[str]]:
    """node -> the distinct plain paths it is asked about, in the order first met. A path
    that is not plain is never sent (``judge`` of an empty answer names it)."""
    out: dict[str, list[str]] = {}
    for _model, node, path in checks:
        paths = out.setdefault(node, [])
        if plain_path(path) and path not in paths:
            paths.append(path)
    return out


def parse_answer(stdout: str) -> dict[str, object]:
    """The helper's answer: its last line, a JSON object of path -> what is there; ``{}``
    for anything else."""
    lines = stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def judge(answer: Mapping[str, object], path: str, user: str | None = None) -> str:
    """Why ``path`` cannot serve as weights, from a node's parsed answer; ``""`` when it
    is a non-empty file or a non-empty folder that ``user`` (the engine's account; None:
    not asked) may read whole. Whatever the answer holds besides the expected shape counts
    as no answer; a node that did not say what ``user`` may read is not held against."""
    if not plain_path(path):
        return "not a plain absolute path"
    entry = answer.get(path)
    if not isinstance(entry, dict):
        return "the node gave no answer for it"
    kind, empty = entry.get("kind"), entry.get("empty")
    if kind == "missing":
        return "missing"
    if kind in ("file", "dir") and isinstance(empty, bool):
        if empty:
            return "an empty file" if kind == "file" else "an empty folder"
        return _unreadable(entry, user) if user else ""
    if kind == "other":
        return "neither a file nor a folder"
    if kind == "unreadable":
        return "unreadable"
    return "the node gave no answer for it"


def _unreadable(entry: Mapping[str, object], user: str) -> str:
    """``not readable by llmgw: /w/m/model.gguf (owner root, mode 0600)`` when the node
    names a file or folder ``user`` cannot read; ``""`` otherwise."""
    by_user = entry.get("unreadable")
    found = by_user.get(user) if isinstance(by_user, dict) else None
    if not isinstance(found, dict):
        return ""
    # names from the node: one printable line each, bounded
    where, owner, mode = (_CONTROL.sub("?", str(found.get(k, "?")))[:500] for k in ("path", "owner", "mode"))
    return f"not readable by {user}, the engine's account: {where} (owner {owner}, mode {mode})"


def not_there(path: str, node: str, why: str) -> str:
    """The message of a failed check: ``/data/models/x is not on node03 (missing)``, or
    ``/data/models/x on node03 is not readable by llmgw, ...``."""
    if why.startswith("not readable"):
        return f"{path} on {node} is {why}"
    return f"{path} is not on {node} ({why})"
