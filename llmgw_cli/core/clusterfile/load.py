"""YAML text -> ClusterSpec, with every problem located at its line and column.

PyYAML's composer gives a node tree that remembers where each value was written; we
build plain data from it ourselves (so duplicate keys are caught, which PyYAML would
silently merge), keep a map from each value's path to its position, and translate
pydantic's error locations through that map. Cross-reference checks (``refs.py``) run
on the same plain data, so one run reports structural and reference problems together.

Whatever the bytes, the outcome is a ClusterSpec or a located ``SpecError``, never a
traceback: bytes that are not UTF-8, characters YAML refuses, tags whose constructor
fails (``!!timestamp 2024-02-30``, ``!!python/...``), aliases that expand without end
(a "billion laughs" file) or refer to themselves, and nesting deep enough to exhaust the
stack are all reported at their line and column.

The data handed to validation is JSON's: text, numbers, booleans, null, lists and
mappings. A YAML value of another type (``!!binary``, a timestamp such as ``2024-05-01``)
is refused at its line, and a number without a fractional part is an integer (``2.0`` is
``2``), as in JSON; so the JSON Schema of the file (docs/cluster.schema.json) sees the
same values the loader does, and they agree on what is valid.
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

from llmgw_cli.core.clusterfile import refs
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.clusterfile.values import CONTROL_CHARACTER, find_forbidden
from llmgw_cli.errors import Problem, SpecError

Loc = tuple[str | int, ...]

# A cluster file of thousands of nodes holds some hundred thousand values; more means
# aliases multiplying one another. No sensible file nests this deep.
MAX_VALUES = 500_000
MAX_DEPTH = 40


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


_JSON_SCALARS = (str, int, float, bool, type(None))
_MERGE = "tag:yaml.org,2002:merge"


def _mark(node: yaml.Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Refused(Exception):
    """The document cannot be turned into data at all: one located problem ends the build."""

    def __init__(self, position: tuple[int, int], loc: Loc, message: str) -> None:
        super().__init__(message)
        self.position, self.loc, self.message = position, loc, message


class _Builder:
    """Plain data from a composed YAML node tree, recording positions and duplicate keys."""

    def __init__(self) -> None:
        self.positions = Positions()
        self.duplicates: list[tuple[Loc, str, tuple[int, int]]] = []
        self._scalars = yaml.SafeLoader("")
        self._count = 0

    def _scalar(self, node: yaml.Node, loc: Loc) -> Any:
        """A scalar (or a mapping key) constructed by PyYAML's safe constructor, whose
        failures (unknown tags, ``!!int x``, a 30th of February) are located problems."""
        try:
            return self._scalars.construct_object(node, deep=True)
        except Exception as exc:  # every constructor failure is a problem of the input
            reason = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else str(exc)
            tag = str(node.tag).removeprefix("tag:yaml.org,2002:")
            raise _Refused(
                _mark(node), loc, f"cannot read this value as a YAML {tag}: {reason}; quote it if it is text"
            ) from None

    def _merged(self, node: yaml.Node, loc: Loc, depth: int) -> dict[Any, Any]:
        """The mapping(s) of a ``<<:`` merge key; later keys of the mapping override them."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        merged: dict[Any, Any] = {}
        own_position = self.positions.values[loc]
        for source in reversed(sources):  # earlier sources win, as in YAML 1.1
            value = self.build(source, loc, depth + 1)
            if isinstance(value, dict):
                merged.update(value)
        self.positions.values[loc] = own_position
        return merged

    def build(self, node: yaml.Node, loc: Loc = (), depth: int = 0) -> Any:
        self._count += 1
        if self._count > MAX_VALUES:
            raise _Refused(
                _mark(node),
                loc,
                f"the file expands to more than {MAX_VALUES} values (aliases repeating aliases?); "
                "write the values out",
            )
        if depth > MAX_DEPTH:
            raise _Refused(
                _mark(node),
                loc,
                f"values are nested more than {MAX_DEPTH} deep (or an alias refers to itself)",
            )
        self.positions.values[loc] = _mark(node)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, loc, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*loc, i), depth + 1) for i, item in enumerate(node.value)]
        return self._json_value(node, loc)

    def _mapping(self, node: yaml.MappingNode, loc: Loc, depth: int) -> dict[Any, Any]:
        """A mapping. The keys of its ``<<:`` merges come first and its own keys override
        them, wherever the merge key is written (YAML's merge rule): only a key written
        twice in the mapping itself is a duplicate."""
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                result.update(self._merged(value_node, loc, depth))
        own: set[Any] = set()
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise _Refused(_mark(key_node), loc, "a key must be a plain value, not a list or mapping")
            key = self._scalar(key_node, loc)
            if not isinstance(key, str | int | float | bool):
                raise _Refused(_mark(key_node), loc, f"a key must be text: quote {key_node.value!r}")
            child = (*loc, key) if isinstance(key, str | int) else (*loc, str(key))
            if key in own:
                self.duplicates.append((child, str(key), _mark(key_node)))
            own.add(key)
            self.positions.keys[child] = _mark(key_node)
            result[key] = self.build(value_node, child, depth + 1)
        return result

    def _json_value(self, node: yaml.Node, loc: Loc) -> Any:
        value = self._scalar(node, loc)
        if not isinstance(value, _JSON_SCALARS):
            tag = str(node.tag).removeprefix("tag:yaml.org,2002:")
            raise _Refused(
                _mark(node),
                loc,
                f"YAML reads this value as a {tag}, which no setting takes: quote it if it is text",
            )
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


def where(loc: Loc) -> str:
    """``('models', 2, 'scaling')`` -> ``models[2].scaling``."""
    text = ""
    for part in loc:
        if isinstance(part, str) and (not part.isprintable() or " " in part):
            text += f"[{part!r}]"  # a key holding blanks or control characters, quoted and escaped
        else:
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
    if kind == CONTROL_CHARACTER:
        # Point at the very item or key that holds it, not at the list or mapping around it.
        found = find_forbidden(error["input"])
        below, in_key = found[:2] if found else ((), False)
        line, col = positions.of_key((*loc, *below)) if in_key else positions.of_value((*loc, *below))
        return Problem(
            filename, line, col, where((*loc, *below)), ("its key " if in_key else "") + error["msg"]
        )
    if loc and loc[-1] == "[key]":  # a mapping key of the wrong form: point at the key
        loc = loc[:-1]
        line, col = positions.of_key(loc)
        return Problem(filename, line, col, where(loc), error["msg"].removeprefix("Value error, "))
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


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of ``text[index]``."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def decode(data: bytes, filename: str) -> str:
    """A cluster file's bytes as text; bytes that are not UTF-8 are a located problem."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = data[: exc.start].decode("utf-8")
        line, col = _line_col(good + "?", len(good))
        raise SpecError(
            [
                Problem(
                    filename,
                    line,
                    col,
                    "",
                    f"byte 0x{data[exc.start]:02x} is not UTF-8: save the file as UTF-8",
                )
            ]
        ) from None


# libyaml composes a file ten times faster than PyYAML's Python composer (30 ms against 3
# for a 9 kB cluster file; a second for a file of hundreds of nodes), but it recurses in C,
# out of reach of Python's recursion limit: a hostile file nesting a million brackets
# would crash the process instead of being refused. It composes only a text that cannot
# nest deeper than some thousand levels: few flow brackets, and short lines (block
# nesting needs a column, or an indentation, per level).
_LIBYAML_BRACKETS = 2000
_LIBYAML_LINE = 2000


def _shallow(text: str) -> bool:
    """Whether libyaml may compose ``text`` (see above); it needs libyaml, too."""
    if not getattr(yaml, "__with_libyaml__", False):
        return False
    if text.count("[") + text.count("{") > _LIBYAML_BRACKETS:
        return False
    return max(map(len, text.split("\n")), default=0) <= _LIBYAML_LINE


def _compose(text: str, filename: str) -> list[yaml.Node]:
    """The YAML documents of ``text`` as node trees; every failure is a located SpecError."""
    bad = yaml.reader.Reader.NON_PRINTABLE.search(text)
    if bad is not None:
        line, col = _line_col(text, bad.start())
        message = (
            f"the file holds control character U+{ord(bad.group()):04X}, which YAML does not allow: remove it"
        )
        raise SpecError([Problem(filename, line, col, "", message)])
    if _shallow(text):
        try:
            return [d for d in yaml.compose_all(text, Loader=yaml.CSafeLoader) if d is not None]
        except yaml.YAMLError:
            pass  # said again below, in the words (and at the place) of the Python composer
    try:
        return [d for d in yaml.compose_all(text, Loader=yaml.SafeLoader) if d is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        reason = exc.problem or exc.context or "invalid YAML"
        raise SpecError([Problem(filename, line, col, "", f"YAML syntax error: {reason}")]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Problem(filename, 0, 0, "", f"YAML syntax error: {exc}")]) from None
    except RecursionError:
        raise SpecError(
            [Problem(filename, 1, 1, "", f"values are nested more than {MAX_DEPTH} deep: flatten the file")]
        ) from None


def parse_cluster(text: str | bytes, filename: str = "cluster.yaml") -> ClusterSpec:
    """Validate a cluster file's text (or bytes, which must be UTF-8); raise ``SpecError``
    listing every problem found."""
    if isinstance(text, bytes):
        text = decode(text, filename)
    documents = _compose(text, filename)
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
    try:
        data = builder.build(documents[0])
    except _Refused as refused:
        line, col = refused.position
        raise SpecError([Problem(filename, line, col, where(refused.loc), refused.message)]) from None
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
        # The file's keys are the documented ones (`class`), never the Python names (`gpu_class`).
        spec = ClusterSpec.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        problems += [_problem(filename, builder.positions, e) for e in exc.errors()]
    for loc, message in refs.check(data):
        line, col = builder.positions.of_value(loc)
        problems.append(Problem(filename, line, col, where(loc), message))
    if problems or spec is None:
        unique = list(dict.fromkeys(problems))
        raise SpecError(sorted(unique, key=lambda p: (p.line, p.column)))
    return spec


def locate(text: str, filename: str, found: list[tuple[Loc | None, str]]) -> list[Problem]:
    """Problems found in a valid cluster file's ``text`` after it was loaded (by checks
    that need the nodes' facts): each (path, message) at the line and column where that
    path's value is written; a None path is the file's, at no line."""
    documents = _compose(text, filename)
    builder = _Builder()
    if documents:
        builder.build(documents[0])
    problems = []
    for loc, message in found:
        line, col = builder.positions.of_value(loc) if loc is not None else (0, 0)
        problems.append(Problem(filename, line, col, where(loc) if loc is not None else "", message))
    return problems
