"""YAML text -> ClusterSpec, with every problem located at its line and column.

PyYAML's composer gives a node tree that remembers where each value was written; we
build plain data from it ourselves (so duplicate keys are caught, which PyYAML would
silently merge), keep a map from each value's path to its position, and translate
pydantic's error locations through that map. Cross-reference checks (``refs.py``) run
on the same plain data, so one run reports structural and reference problems together.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from llmgw_cli.core import refs
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import Problem, SpecError

Loc = tuple[str | int, ...]


@dataclass
class Positions:
    """Where each path of the document was written (1-based line and column)."""

    values: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Loc, tuple[int, int]] = field(default_factory=dict)

    def of_value(self, loc: Loc) -> tuple[int, int]:
        """Position of the value at ``loc``, or of its nearest ancestor that was written."""
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.values:
                return self.values[loc[:end]]
        return (0, 0)

    def of_key(self, loc: Loc) -> tuple[int, int]:
        return self.keys.get(loc) or self.of_value(loc)


def _mark(node: yaml.Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    """Plain data from a composed YAML node tree, recording positions and duplicate keys."""

    def __init__(self) -> None:
        self.positions = Positions()
        self.duplicates: list[tuple[Loc, str, tuple[int, int]]] = []
        self._scalars = yaml.SafeLoader("")

    def _merged(self, node: yaml.Node, loc: Loc) -> dict[Any, Any]:
        """The mapping(s) of a ``<<:`` merge key; later keys of the mapping override them."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        merged: dict[Any, Any] = {}
        own_position = self.positions.values[loc]
        for source in reversed(sources):  # earlier sources win, as in YAML 1.1
            value = self.build(source, loc)
            if isinstance(value, dict):
                merged.update(value)
        self.positions.values[loc] = own_position
        return merged

    def build(self, node: yaml.Node, loc: Loc = ()) -> Any:
        self.positions.values[loc] = _mark(node)
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    result.update(self._merged(value_node, loc))
                    continue
                key = self._scalars.construct_object(key_node, deep=True)
                if not isinstance(key, str | int | float | bool) or key is None:
                    key = str(key)
                child = (*loc, key) if isinstance(key, str | int) else (*loc, str(key))
                if key in result:
                    self.duplicates.append((child, str(key), _mark(key_node)))
                self.positions.keys[child] = _mark(key_node)
                result[key] = self.build(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*loc, i)) for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node, deep=True)


def where(loc: Loc) -> str:
    """``('models', 2, 'scaling')`` -> ``models[2].scaling``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete types inside Optional/Annotated/list/dict wrappers, outermost first."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The pydantic model class describing the mapping at ``loc``, if any."""
    current: Any = ClusterSpec
    for part in loc:
        nxt = None
        for candidate in _unwrap(current):
            origin = typing.get_origin(candidate)
            if isinstance(candidate, type) and issubclass(candidate, BaseModel) and isinstance(part, str):
                for name, info in candidate.model_fields.items():
                    if part in (name, info.alias):
                        nxt = info.annotation
            elif origin is list and isinstance(part, int):
                nxt = typing.get_args(candidate)[0]
            elif origin is dict and isinstance(part, str):
                nxt = typing.get_args(candidate)[1]
            if nxt is not None:
                break
        if nxt is None:
            return None
        current = nxt
    for candidate in _unwrap(current):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _unknown_key_message(parent: Loc, key: str) -> str:
    model = _model_at(parent)
    if model is None:
        return f"unknown key {key!r}"
    allowed = [info.alias or name for name, info in model.model_fields.items()]
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r} (did you mean {close[0]!r}?)"
    return f"unknown key {key!r}; allowed here: {', '.join(allowed)}"


def _problem(filename: str, positions: Positions, error: ErrorDetails) -> Problem:
    loc: Loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "missing":
        parent = loc[:-1]
        line, col = positions.of_value(parent)
        return Problem(filename, line, col, where(parent), f"missing required key {loc[-1]!r}")
    if kind == "extra_forbidden":
        parent = loc[:-1]
        line, col = positions.of_key(loc)
        return Problem(filename, line, col, where(parent), _unknown_key_message(parent, str(loc[-1])))
    message = error["msg"].removeprefix("Value error, ")
    value = error["input"]
    if value is None:
        message = "has no value: give one, or remove the key"
    elif kind not in ("value_error", "assertion_error") and not isinstance(value, dict | list):
        message += f" (got {value!r})"
        if isinstance(value, bool) and kind == "string_type":
            message += "; YAML reads unquoted yes/no/on/off as booleans: quote the value"
    line, col = positions.of_value(loc)
    return Problem(filename, line, col, where(loc), message)


def parse_cluster(text: str, filename: str = "cluster.yaml") -> ClusterSpec:
    """Validate a cluster file's text; raise ``SpecError`` listing every problem found."""
    try:
        documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        reason = exc.problem or exc.context or "invalid YAML"
        raise SpecError([Problem(filename, line, col, "", f"YAML syntax error: {reason}")]) from None
    documents = [d for d in documents if d is not None]
    if not documents:
        raise SpecError(
            [Problem(filename, 1, 1, "", "the file is empty: it needs at least `cluster: {name: ...}`")]
        )
    if len(documents) > 1:
        line, col = _mark(documents[1])
        raise SpecError(
            [Problem(filename, line, col, "", "one cluster per file: remove the second document")]
        )
    builder = _Builder()
    data = builder.build(documents[0])
    if not isinstance(data, dict):
        raise SpecError(
            [
                Problem(
                    filename,
                    1,
                    1,
                    "",
                    "the top level must be a mapping of keys such as cluster, nodes, models",
                )
            ]
        )

    problems = [
        Problem(filename, line, col, where(loc[:-1]), f"key {key!r} is given twice; the later one would win")
        for loc, key, (line, col) in builder.duplicates
    ]
    spec: ClusterSpec | None = None
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as exc:
        problems += [_problem(filename, builder.positions, e) for e in exc.errors()]
    for loc, message in refs.check(data):
        line, col = builder.positions.of_value(loc)
        problems.append(Problem(filename, line, col, where(loc), message))
    if problems or spec is None:
        unique = list(dict.fromkeys(problems))
        raise SpecError(sorted(unique, key=lambda p: (p.line, p.column)))
    return spec
