"""Checks across objects of a cluster file: references, uniqueness, feasibility.

They run on the plain data the YAML gave, not on a validated ClusterSpec, so that a
file with a type error in one model still gets its unknown profile reported in the same
run. Each check therefore reads defensively: a value of the wrong type is skipped here,
because the schema validation already reports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from llmgw_cli.core.spec import HF_REPO_PATTERN, is_address

Loc = tuple[str | int, ...]
Finding = tuple[Loc, str]


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


def check(data: dict[str, Any]) -> list[Finding]:
    """Every cross-object problem in the plain data of a cluster file."""
    findings: list[Finding] = []
    findings += _duplicates(data, "nodes", "name")
    findings += _duplicates(data, "nodes", "address")
    findings += _duplicates(data, "models", "name")
    findings += _references(data)
    findings += _feasibility(data)
    return findings
