"""Checks across objects of a cluster file: references, uniqueness, feasibility, the
names models answer to and fall back on, and files of two models that would land on one
path.

They run on the plain data the YAML gave, not on a validated ClusterSpec, so that a
file with a type error in one model still gets its unknown profile reported in the same
run. Each check therefore reads defensively: a value of the wrong type is skipped here,
because the schema validation already reports it.
"""

from __future__ import annotations

import difflib
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmgw_cli.core.clusterfile.spec import (
    HF_REPO_PATTERN,
    SourceKind,
    classify_source,
    download_name,
    is_address,
)
from llmgw_cli.core.hosts.paths import DEFAULT_WEIGHTS
from llmgw_cli.core.serving.aliases import cycles
from llmgw_cli.core.weights.snapshot import HF_FOLDER, RepoRef, parse_repo_ref, repo_folder_name

Loc = tuple[str | int, ...]
Finding = tuple[Loc, str]
SHOWN_OF_A_CYCLE = 12  # models a cycle's message names at most
SUGGEST_AMONG = 1000  # most model names an unknown fallback is compared with, for a "did you mean"


def _items(data: dict[str, Any], key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, mapping) for each mapping in the list ``data[key]``."""
    value = data.get(key)
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict):
                yield i, item


def _keys(data: dict[str, Any], key: str) -> set[str]:
    value = data.get(key)
    return {k for k in value if isinstance(k, str)} if isinstance(value, dict) else set()


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _choices(names: set[str]) -> str:
    return ", ".join(sorted(names)) if names else "none is defined"


def _duplicates(data: dict[str, Any], section: str, key: str) -> Iterator[Finding]:
    seen: dict[str, int] = {}
    for i, item in _items(data, section):
        value = item.get(key)
        if not isinstance(value, str):
            continue
        if value in seen:
            yield (section, i, key), f"{key} {value!r} is already used by {section}[{seen[value]}]"
        else:
            seen[value] = i


def _references(data: dict[str, Any]) -> Iterator[Finding]:
    profiles, fabrics = _keys(data, "profiles"), _keys(data, "fabrics")
    for i, node in _items(data, "nodes"):
        fabric = node.get("fabric")
        if isinstance(fabric, str) and fabric not in fabrics:
            yield ("nodes", i, "fabric"), f"unknown fabric {fabric!r} (fabrics: {_choices(fabrics)})"
    for i, model in _items(data, "models"):
        profile = model.get("profile")
        if isinstance(profile, str) and profile not in profiles:
            yield ("models", i, "profile"), f"unknown profile {profile!r} (profiles: {_choices(profiles)})"
    gateway = data.get("gateway")
    host = gateway.get("host") if isinstance(gateway, dict) else None
    node_names = {n.get("name") for _, n in _items(data, "nodes")}
    if isinstance(host, str) and host != "localhost" and host not in node_names and not is_address(host):
        yield (
            ("gateway", "host"),
            (
                f"{host!r} is neither a node name, localhost, nor an address "
                f"(nodes: {_choices({str(n) for n in node_names})})"
            ),
        )


def _strings(model: dict[str, Any], key: str) -> Iterator[tuple[int, str]]:
    """(index, text) for each text item of the list ``model[key]``."""
    value = model.get(key)
    if isinstance(value, list):
        for j, item in enumerate(value):
            if isinstance(item, str):
                yield j, item


def _aliases(data: dict[str, Any], names: dict[str, int]) -> Iterator[Finding]:
    """Each alias answers as one model: no model's name, no other alias."""
    given: dict[str, int] = {}  # alias -> the model it was first given for
    for i, model in _items(data, "models"):
        for j, alias in _strings(model, "aliases"):
            at = ("models", i, "aliases", j)
            if alias in names:
                k = names[alias]
                yield (
                    at,
                    (
                        f"alias {alias!r} is the name of models[{k}]: a request for it would be that "
                        "model; remove the alias" + ("" if k == i else " or rename one of the models")
                    ),
                )
            elif alias in given:
                k = given[alias]
                yield (
                    at,
                    (
                        f"alias {alias!r} is given twice: remove one"
                        if k == i
                        else f"alias {alias!r} is already an alias of models[{k}]: one name answers as "
                        "one model; remove it from one of them"
                    ),
                )
            else:
                given[alias] = i


def _fallbacks(data: dict[str, Any], names: dict[str, int]) -> Iterator[Finding]:
    """Fallbacks name other models of the catalog, each once, and lead to no cycle."""
    aliases: dict[str, int] = {}  # alias -> the model it was first given for
    for i, model in _items(data, "models"):
        for _, alias in _strings(model, "aliases"):
            aliases.setdefault(alias, i)
    graph: dict[str, list[str]] = {}
    for i, model in _items(data, "models"):
        name = model.get("name")
        seen: set[str] = set()
        for j, fallback in _strings(model, "fallbacks"):
            at = ("models", i, "fallbacks", j)
            if fallback == name:
                yield at, f"the model falls back to itself: remove {fallback!r}"
            elif fallback in seen:
                yield at, f"fallback {fallback!r} is given twice: remove one"
            elif fallback not in names:
                yield at, _unknown_model(fallback, aliases, data, names)
            elif isinstance(name, str) and names.get(name) == i:
                graph.setdefault(name, []).append(fallback)
            seen.add(fallback)
    for cycle in cycles(graph):
        first = min(cycle[:-1], key=names.__getitem__)  # reported at its earliest model
        k = cycle.index(first)
        after = cycle[k + 1]
        i = names[first]
        j = next(j for j, f in _strings(_model_at(data, i), "fallbacks") if f == after)
        around = (*cycle[k:-1], *cycle[:k])
        if len(around) > SHOWN_OF_A_CYCLE:  # a hostile file's cycle may hold every model
            around = (*around[: SHOWN_OF_A_CYCLE - 1], f"... ({len(around)} models in all)")
        path = " -> ".join((*around, first))
        yield (
            ("models", i, "fallbacks", j),
            (
                f"fallbacks form a cycle: {path}; remove one of these fallbacks (a model's fallbacks "
                "must never lead back to it)"
            ),
        )


def _model_at(data: dict[str, Any], i: int) -> dict[str, Any]:
    model: dict[str, Any] = data["models"][i]
    return model


def _unknown_model(name: str, aliases: dict[str, int], data: dict[str, Any], names: dict[str, int]) -> str:
    if name in aliases:
        owner = _model_at(data, aliases[name]).get("name")
        return f"{name!r} is an alias of {owner!r}: name the model itself ({owner!r})"
    # a suggestion costs a comparison with every name: only for a catalog of sensible size
    close = (
        difflib.get_close_matches(name, list(names), n=1, cutoff=0.6) if len(names) <= SUGGEST_AMONG else []
    )
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown model {name!r}{hint}: a fallback names a model of `models`"


def _names(data: dict[str, Any]) -> Iterator[Finding]:
    names: dict[str, int] = {}  # each model's name -> the first model of that name
    for i, model in _items(data, "models"):
        name = model.get("name")
        if isinstance(name, str):
            names.setdefault(name, i)
    yield from _aliases(data, names)
    yield from _fallbacks(data, names)
    yield from _adapters(data, names)


# --- adapters (LoRA) ------------------------------------------------------------------

ADAPTER_ENGINES = {"vllm"}
NO_ADAPTERS = {
    "llama-server": "llama-server loads adapters only at its start, as GGUF files selected by "
    "a per-request `lora` list of indices under the one model name it serves, which llmgw does "
    "not drive",
    "sglang": "llmgw loads adapters at run time through vLLM's `/v1/load_lora_adapter` only; "
    "SGLang's adapter API is not driven by llmgw",
}


def _adapters(data: dict[str, Any], names: dict[str, int]) -> Iterator[Finding]:
    """Each adapter's name answers as that adapter only (no model's name, no alias, no other
    adapter's), and its model's engine loads adapters."""
    aliases: dict[str, int] = {}
    for i, model in _items(data, "models"):
        for _, alias in _strings(model, "aliases"):
            aliases.setdefault(alias, i)
    raw_profiles = data.get("profiles")
    profiles: dict[str, Any] = raw_profiles if isinstance(raw_profiles, dict) else {}
    given: dict[str, int] = {}  # adapter name -> the model it was first given for
    for i, model in _items(data, "models"):
        adapters = list(_items(model, "adapters"))
        if not adapters:
            continue
        name = model.get("profile")
        profile = profiles.get(name) if isinstance(name, str) else None
        engine = profile.get("engine") if isinstance(profile, dict) else None
        if isinstance(engine, str) and engine not in ADAPTER_ENGINES:
            why = NO_ADAPTERS.get(engine, "its engine does not load adapters")
            yield (
                ("models", i, "adapters"),
                f"the profile's engine {engine!r} cannot serve adapters: {why}; run the model with vLLM or remove its adapters",
            )
        for j, adapter in adapters:
            name = adapter.get("name")
            if not isinstance(name, str):
                continue
            at = ("models", i, "adapters", j, "name")
            if name in names:
                yield (
                    at,
                    f"adapter {name!r} is the name of models[{names[name]}]: a request for it would be that model; rename the adapter",
                )
            elif name in aliases:
                yield (
                    at,
                    f"adapter {name!r} is an alias of models[{aliases[name]}]: one name answers as one model; rename the adapter or the alias",
                )
            elif name in given:
                yield (
                    at,
                    f"adapter {name!r} is already an adapter of models[{given[name]}]: rename one of them",
                )
            else:
                given[name] = i


def _feasibility(data: dict[str, Any]) -> Iterator[Finding]:
    """Models that no node of this file could ever run."""
    nodes = [n for _, n in _items(data, "nodes")]
    fabric_nodes = [n for n in nodes if isinstance(n.get("fabric"), str)]
    declared = [n["gpus"] for n in nodes if isinstance(n.get("gpus"), dict)]
    largest = max((_int(g.get("count"), 0) for g in declared), default=0)
    raw_profiles = data.get("profiles")
    profiles: dict[str, Any] = raw_profiles if isinstance(raw_profiles, dict) else {}
    for i, model in _items(data, "models"):
        tp, count = _int(model.get("tensor_parallel"), 1), _int(model.get("nodes"), 1)
        if declared and len(declared) == len(nodes) and tp > largest:
            yield (
                ("models", i, "tensor_parallel"),
                (f"tensor_parallel {tp} is larger than any node (the largest declares {largest} GPUs)"),
            )
        if count > 1 and not fabric_nodes:
            yield (
                ("models", i, "nodes"),
                (f"a {count}-node replica needs nodes on a fabric, and no node has `fabric:` set"),
            )
        name = model.get("profile")
        profile = profiles.get(name) if isinstance(name, str) else None
        engine = profile.get("engine") if isinstance(profile, dict) else None
        if engine == "llama-server":
            source = model.get("source")
            if isinstance(source, str) and re.match(HF_REPO_PATTERN, source):
                yield (
                    ("models", i, "source"),
                    ("llama-server loads a GGUF file: give its path or an https URL, not a repo id"),
                )
            if count > 1:
                yield ("models", i, "nodes"), "llama-server cannot run a replica across nodes"


# --- files of two models on one path ------------------------------------------------
#
# Where a model's files go depends on the node, but only through the node's first weights
# folder W: a URL is downloaded to W/<its last path segment>, `./name` is read from
# W/name and a fetched repository fills W/hf/<org>--<name>/<commit>, on whichever node
# runs the model. Placement may put any two models on one node, so two models clash when
# they name one path under W, whatever the nodes; an absolute path clashes when it lies
# in the first weights folder of a node of the file.

FIRST = "<first weights folder>"
RULE = (
    "every node downloads a URL source into its first weights folder under the URL's last "
    "path segment, and any node may run both models"
)
YOURSELF = "download one of the files yourself under another name and give its path as the source"


@dataclass(frozen=True)
class _Download:
    index: int
    name: str  # the name directly inside W that the download replaces
    url: str
    sha256: str | None


@dataclass(frozen=True)
class _Read:
    index: int
    name: str  # the name directly inside W that the model's path starts with
    shown: str  # that path as messages show it
    source: str


@dataclass(frozen=True)
class _Snapshot:
    index: int
    ref: RepoRef
    selection: tuple[tuple[str, ...] | None, tuple[str, ...]]


def _first_weights_folders(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(node, its first weights folder) for each node whose folder can be read."""
    folders = []
    for k, node in _items(data, "nodes"):
        label = node["name"] if isinstance(node.get("name"), str) else f"nodes[{k}]"
        weights = node.get("weights", [])
        if not isinstance(weights, list):
            continue
        first = weights[0] if weights else DEFAULT_WEIGHTS
        folder = first.get("path") if isinstance(first, dict) else first
        if isinstance(folder, str) and folder.startswith("/") and folder.isprintable():
            folders.append((label, posixpath.normpath(folder)))
    return folders


def _top(relative: str) -> str | None:
    """The first component of a path inside W, or None when it names no entry of W."""
    top = posixpath.normpath(relative).split("/", 1)[0]
    return None if top in ("", ".", "..") else top


def _selection(fetch: dict[str, Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...]] | None:
    """The files a ``fetch: {include, exclude}`` keeps, in an order-free form; None when
    the lists are not lists of text (validation says so)."""
    include, exclude = fetch.get("include"), fetch.get("exclude", [])
    for patterns in (include or [], exclude or []):
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            return None
    return (None if include is None else tuple(sorted(set(include))), tuple(sorted(set(exclude or []))))


def _landings(
    i: int, model: dict[str, Any], folders: list[tuple[str, str]]
) -> tuple[_Download | None, list[_Read], _Snapshot | None]:
    """What model ``i`` writes into W, reads from it, and the snapshot it fetches there."""
    source = model.get("source")
    if not isinstance(source, str) or not source.isprintable():
        return None, [], None
    try:
        kind = classify_source(source)
    except ValueError:
        return None, [], None
    if kind is SourceKind.url:
        name = _top(download_name(source))
        sha256 = model.get("sha256")
        download = _Download(i, name, source, sha256 if isinstance(sha256, str) else None) if name else None
        return download, [], None
    if kind is SourceKind.path:
        if source.startswith("./"):
            name = _top(source[2:])
            return None, ([_Read(i, name, f"{FIRST}/{name}", source)] if name else []), None
        reads = []
        path = posixpath.normpath(source)
        for node, folder in folders:
            prefix = folder.rstrip("/") + "/"
            name = _top(path[len(prefix) :]) if path.startswith(prefix) else None
            if name:
                reads.append(
                    _Read(i, name, f"{prefix}{name} (in the first weights folder of node {node})", source)
                )
        return None, reads, None
    fetch = model.get("fetch", {})  # unset: the default files, as `fetch: {}`
    selection = _selection(fetch) if isinstance(fetch, dict) else None
    if selection is None:
        return None, [], None  # `fetch: engine` (or a value validation refuses): nothing on the nodes
    try:
        ref = parse_repo_ref(source)
    except ValueError:
        return None, [], None
    return None, [], _Snapshot(i, ref, selection)


def _keep(kept: list[Any], entry: Any, key: Any) -> None:
    """Keep ``entry`` when fewer than two distinct keys are kept and its key is new: the
    earliest entry whose key differs from any given one is then always among them."""
    if len(kept) < 2 and all(key != k for k, _ in kept):
        kept.append((key, entry))


def _first_other(kept: list[Any], key: Any) -> Any:
    """The earliest kept entry whose key is not ``key``, or None."""
    return next((entry for k, entry in kept if k != key), None)


@dataclass
class _Earlier:
    """What the models before the one checked put into W, indexed so that each model is
    checked in constant time: a hostile file may hold a hundred thousand models."""

    urls: dict[str, list[Any]] = field(default_factory=dict)  # file name -> (url, _Download)
    sha256s: dict[tuple[str, str], list[Any]] = field(default_factory=dict)  # url -> (sha256, _Download)
    readers: dict[str, _Read] = field(default_factory=dict)  # the first model reading each name
    selections: dict[RepoRef, list[Any]] = field(default_factory=dict)  # -> (selection, _Snapshot)
    first_snapshot: _Snapshot | None = None

    def add(self, download: _Download | None, reads: list[_Read], snapshot: _Snapshot | None) -> None:
        if download is not None:
            _keep(self.urls.setdefault(download.name, []), download, download.url)
            if download.sha256:
                _keep(self.sha256s.setdefault((download.name, download.url), []), download, download.sha256)
        for read in reads:
            self.readers.setdefault(read.name, read)
        if snapshot is not None:
            _keep(self.selections.setdefault(snapshot.ref, []), snapshot, snapshot.selection)
            self.first_snapshot = self.first_snapshot or snapshot


def _clash(
    download: _Download | None,
    reads: list[_Read],
    snapshot: _Snapshot | None,
    earlier: _Earlier,
    label: dict[int, str],
) -> Iterator[tuple[int, str]]:
    """(earlier model, why) for earlier models whose files this model's would land on."""
    if download is not None:
        d = _first_other(earlier.urls.get(download.name, []), download.url)
        if d is not None:
            yield (
                d.index,
                (
                    f"downloads to {FIRST}/{d.name}, as {label[d.index]} does from {d.url}: on a node "
                    f"that fetches both, one download replaces the other's file ({RULE}); {YOURSELF}, "
                    "or give both models the same URL"
                ),
            )
        d = _first_other(earlier.sha256s.get((download.name, download.url), []), download.sha256)
        if d is not None and download.sha256:
            yield (
                d.index,
                (
                    f"{download.url} is also the source of {label[d.index]}, with another sha256: both are "
                    f"downloaded to {FIRST}/{d.name}, and each model would take the other's file for a "
                    "wrong download and fetch it again; give both models the same sha256"
                ),
            )
        r = earlier.readers.get(download.name)
        if r is not None:
            yield (
                r.index,
                (
                    f"downloads to {r.shown}, the path {label[r.index]} runs from ({r.source}): the "
                    f"download would replace that model's weights ({RULE}); {YOURSELF}, or rename the "
                    "other model's file"
                ),
            )
        s = earlier.first_snapshot
        if download.name == HF_FOLDER and s is not None:
            yield (
                s.index,
                (
                    f"downloads to {FIRST}/{HF_FOLDER}, the folder where llmgw fetches the repository of "
                    f"{label[s.index]}: the download would take its place ({RULE}); download "
                    "this file yourself under another name and give its path as the source"
                ),
            )
    for read in reads:
        kept = earlier.urls.get(read.name)
        if kept:
            d = kept[0][1]
            yield (
                d.index,
                (
                    f"runs from {read.shown}, where {label[d.index]} downloads {d.url}: the download would "
                    f"replace this model's weights ({RULE}); rename this model's file (and its source), or "
                    "download the other model's file yourself under another name and give its path"
                ),
            )
    if snapshot is not None:
        s = _first_other(earlier.selections.get(snapshot.ref, []), snapshot.selection)
        if s is not None:
            folder = f"{FIRST}/{HF_FOLDER}/{repo_folder_name(snapshot.ref.repo)}/<commit>"
            yield (
                s.index,
                (
                    f"fetches {snapshot.ref} as {label[s.index]} does, with other files (its `fetch` "
                    f"include and exclude differ): both would fill the one snapshot folder "
                    f"{folder} and its manifest, each with its own "
                    "files; give both models the same `fetch`, one that keeps the files both need"
                ),
            )
        kept = earlier.urls.get(HF_FOLDER)
        if kept:
            d = kept[0][1]
            yield (
                d.index,
                (
                    f"fetches its repository into {FIRST}/{HF_FOLDER}, where {label[d.index]} downloads "
                    f"{d.url}: that download would take the repositories' folder ({RULE}); download that "
                    "file yourself under another name and give its path as the source"
                ),
            )


def _landing_clashes(data: dict[str, Any]) -> Iterator[Finding]:
    """Models whose files would land on the path of an earlier model's: one overwrites
    the other on a node that holds both. Reported at the later model's ``source``."""
    folders = _first_weights_folders(data)
    earlier = _Earlier()
    label: dict[int, str] = {}
    for i, model in _items(data, "models"):
        name = model.get("name")
        label[i] = f"models[{i}] ({name!r})" if isinstance(name, str) else f"models[{i}]"
        download, reads, snapshot = _landings(i, model, folders)
        clashes = sorted(_clash(download, reads, snapshot, earlier, label))
        if clashes:  # one problem per model: its clash with the earliest model
            yield ("models", i, "source"), clashes[0][1]
        earlier.add(download, reads, snapshot)


def check(data: dict[str, Any]) -> list[Finding]:
    """Every cross-object problem in the plain data of a cluster file."""
    findings: list[Finding] = []
    findings += _duplicates(data, "nodes", "name")
    findings += _duplicates(data, "nodes", "address")
    findings += _duplicates(data, "models", "name")
    findings += _references(data)
    findings += _names(data)
    findings += _feasibility(data)
    findings += _landing_clashes(data)
    return findings
