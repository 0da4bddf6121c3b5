"""docs/configuration.md and the JSON Schema, generated from the spec models.

Generated rather than written so the reference cannot drift from the code: a test
regenerates both and compares them with the committed files.

The JSON Schema describes the file as a person writes it, not the spec it becomes: each
shorthand (``ports: 8100-8199``, ``hcas: [mlx5_0:1]``, ``weights: [/data]``) is an
alternative beside the long form, durations and sizes are patterns, defaults are shown
written out (``10s``), and every string and key refuses control characters as the loader
does. Tests validate the example inventories, the documentation's examples and a corpus
of bad files with both the schema and the loader, and check that they agree.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import PydanticUndefined, core_schema

from llmgw_cli.core.clusterfile.grammar import CONTROL_CHARACTERS
from llmgw_cli.core.clusterfile.quantities import format_duration, format_size, parse_duration, parse_size
from llmgw_cli.core.clusterfile.spec import ClusterSpec


def json_schema() -> str:
    """The cluster file's JSON Schema, as committed in docs/cluster.schema.json."""
    schema = ClusterSpec.model_json_schema(by_alias=True, schema_generator=_WrittenForm)
    _refuse_control_characters(schema)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llmgw cluster file"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


class _WrittenForm(GenerateJsonSchema):
    """Defaults as the file writes them (``10s``, ``4MiB``), through the field's serializer:
    pydantic shows a duration's default as the float it is in memory, which the pattern
    of the very same field refuses."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        serialize = _plain_serializer(schema["schema"])
        if serialize is not None and json_schema.get("default") is not None:
            json_schema["default"] = serialize(self.get_default_value(schema))
        return json_schema


def _plain_serializer(schema: Any) -> Callable[[Any], Any] | None:
    """The plain serializer of a (possibly wrapped) core schema, if it has one."""
    serialization = schema.get("serialization") or {}
    if serialization.get("type") == "function-plain":
        function: Callable[[Any], Any] = serialization["function"]
        return function
    if schema.get("type") in ("function-before", "function-after", "nullable") and "schema" in schema:
        return _plain_serializer(schema["schema"])
    return None


# Keys whose values are data, not schemas.
_DATA_KEYS = frozenset({"default", "examples", "enum", "const"})


def _refuse_control_characters(node: Any) -> None:
    """Every string and every mapping key refuses control characters (spec.Spec refuses
    them in any value), and a mapping's key pattern binds every key: pydantic's
    ``patternProperties`` would let a key that does not match through unchecked."""
    if isinstance(node, list):
        for item in node:
            _refuse_control_characters(item)
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key not in _DATA_KEYS:
            _refuse_control_characters(value)
    no_control = {"type": "string", "pattern": CONTROL_CHARACTERS}
    if node.get("type") == "string":  # (not A) and (not B) is not (A or B)
        node["not"] = {"anyOf": [node["not"], no_control]} if "not" in node else no_control
    if node.get("type") == "object" and "properties" not in node:  # a mapping of names
        names: dict[str, Any] = {"type": "string", "not": no_control}
        patterns = node.pop("patternProperties", None)
        if patterns:
            ((pattern, values),) = patterns.items()
            names["pattern"] = pattern
            node["additionalProperties"] = values
        node["propertyNames"] = names


def _quantity(info_or_args: Any) -> str | None:
    """'duration' or 'size' when the metadata carries our parsers."""
    for meta in info_or_args:
        func = getattr(meta, "func", None)
        if func is parse_duration:
            return "duration"
        if func is parse_size:
            return "size"
    return None


def _type_name(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> str:
    quantity = _quantity(metadata)
    if quantity:
        return quantity
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0], args[1:])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of name to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return {str: "string", int: "integer", bool: "boolean", float: "number"}.get(annotation, str(annotation))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "see below"
        return "empty" if not value else f"`{value}`"
    value = info.default
    if value is None or value is PydanticUndefined:
        return "unset"
    quantity = _quantity(info.metadata)
    if quantity == "duration":
        return f"`{format_duration(value)}`"
    if quantity == "size":
        return f"`{format_size(value)}`"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _nested(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in typing.get_args(annotation) for cls in _nested(arg)]


def _key_path(parent: str, key: str, annotation: Any) -> str:
    """How a child section is reached: ``nodes[]``, ``profiles.<name>``, ``gateway.timeouts``."""
    base = f"{parent}.{key}" if parent else key
    for arg in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(arg)
        if origin is list:
            return f"{base}[]"
        if origin is dict:
            return f"{base}.<name>"
    return base


def _classes() -> list[tuple[type[BaseModel], str]]:
    """Every model reachable from ClusterSpec with where it first appears, parents first."""
    order: list[tuple[type[BaseModel], str]] = [(ClusterSpec, "")]
    seen: set[type[BaseModel]] = {ClusterSpec}
    for cls, path in order:
        for name, info in cls.model_fields.items():
            for child in _nested(info.annotation):
                if child not in seen:
                    seen.add(child)
                    order.append((child, _key_path(path, info.alias or name, info.annotation)))
    return order


def _section(cls: type[BaseModel], path: str) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "").replace("\n", " ")
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, info in cls.model_fields.items():
        key = info.alias or name
        kind = _type_name(info.annotation, info.metadata)
        meaning = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{key}` | {kind} | {_default(info)} | {meaning} |")
    title = f"`{path}` ({cls.__name__})" if path else f"Top level ({cls.__name__})"
    anchor = f'<a id="{cls.__name__.lower()}"></a>\n'
    return f"{anchor}### {title}\n\n{doc}\n\n" + "\n".join(rows) + "\n"


def configuration_markdown(example: str, example_name: str) -> str:
    """docs/configuration.md: an example file, then every key of every section."""
    head = (
        "# Configuration reference\n\n"
        "<!-- Generated by scripts/regen from llmgw_cli/core/clusterfile/spec.py; do not edit by hand. -->\n\n"
        "A cluster file is one YAML document. `llmgw validate -f FILE` checks it and reports\n"
        "every problem at once with its line and column; `llmgw schema` prints the JSON Schema\n"
        "(also in [cluster.schema.json](cluster.schema.json)) for editor completion.\n\n"
        "Durations are written with a unit: `250ms`, `90s`, `10m`, `1h`, `1h30m`, `1d`.\n"
        "Sizes too: `512MiB`, `80GiB`, `2TB` (binary `KiB/MiB/GiB/TiB`, decimal `KB/MB/GB/TB`).\n"
        "A bare number is refused, since it could mean either unit. Spaces may separate the\n"
        "parts (`1h 30m`, `512 MiB`); digits are 0-9.\n\n"
        "Values keep the type YAML gives them, as in the JSON Schema: numbers and booleans are\n"
        'written bare (`port: 22`, `install: false`), and a quoted `"22"` or `"yes"` is text,\n'
        "refused where a number or a boolean belongs. A number without a fraction is an integer\n"
        "(`8.0` is `8`). YAML's timestamps and binary values (`2024-05-01`, `!!binary`) are\n"
        "refused: quote text that looks like a date.\n\n"
        "Shorthands: `ports: 8100-8199` for `{first: 8100, last: 8199}`, `hcas: [mlx5_0:1]` for\n"
        "`[{name: mlx5_0, port: 1}]` (`mlx5_0` alone: every port), `weights: [/data]` for\n"
        "`[{path: /data}]`. The JSON Schema knows both forms.\n\n"
        "## Values that reach units and shells\n\n"
        "Most values end up in systemd units and shell commands on the nodes, so every string in\n"
        "the file is checked for what would change their meaning there:\n\n"
        "- No control characters anywhere: a newline, carriage return, tab, NUL, DEL, the C1\n"
        "  controls and the Unicode line separators are refused (a newline in a model's `args`\n"
        "  would otherwise start a new unit directive such as `ExecStartPre=+...`, run as root).\n"
        "  Write each value on one line.\n"
        "- `$`, `%`, quotes, backslashes, blanks and `;` in `args` and `env` are fine: they are\n"
        "  quoted for systemd and reach the engine unchanged.\n"
        "- User names (`ssh.user`, `profiles.*.user`) are POSIX names (`^[a-z_][a-z0-9_-]{0,30}$`,\n"
        "  optionally ending in `$`). Engines never run as `root`: they run code that comes with\n"
        "  the model.\n"
        "- A profile's program (`command[0]`) cannot start with `- @ : + !`, which systemd reads as\n"
        "  flags (`+` ignores `User=`).\n"
        "- Environment variable names are `^[A-Za-z_][A-Za-z0-9_]*$`; ports are 1 to 65535;\n"
        "  addresses are host names or IP addresses (never something `ssh` could read as an option).\n"
        "- `gateway.state_dir` and `gateway.llmgw_bin` are written into a unit as single words: no\n"
        "  blanks, quotes, backslashes, `$`, `%`, `;` or backquotes.\n"
        "- Durations are at most 365 days and sizes at most 1024TiB.\n\n"
        "The file itself must be UTF-8. YAML tags that build other types (`!!python/...`), aliases\n"
        "that expand beyond half a million values and nesting deeper than 40 levels are refused,\n"
        "each at its line and column.\n\n"
        "## Scaling, exactly\n\n"
        "| `scaling` | meaning |\n|---|---|\n"
        "| absent | off: never started |\n"
        "| `min: 0, max: 0` | configured and deliberately off |\n"
        "| `min: 0, max: N` (N >= 1) | on demand: started by the first request, "
        "stopped after `idle_timeout` |\n"
        "| `min: N` (N >= 1) | N replicas always running, never evicted; up to `max` |\n\n"
        "`max` is never filled in for you: a `scaling` block without it is an error.\n\n"
        "## Engine versions and their flags\n\n"
        "A profile's `version` names the engine version its `args` are written for. The probe\n"
        "reads the version each node really has, without starting the engine: vLLM's and\n"
        "SGLang's from their Python distribution's metadata beside the program\n"
        "(`<venv>/lib/python3*/site-packages/vllm-*.dist-info/METADATA`), llama-server's from\n"
        "`llama-server --version` (a binary only, as `nobody`, within 5 seconds); `llmgw status`\n"
        "shows them. `plan` and `apply` render every replica they start or keep and check its\n"
        "command line against the flag table of the node's version (the profile's `version` when\n"
        "the node's could not be read), dumped from that version's own argument parser (vLLM\n"
        "0.32.0, SGLang 0.5.23). A flag that version does not accept is an error at its `args`\n"
        "entry, naming the node, the engine, the version and the flag; nothing is changed. A\n"
        "version without a table (`flags not checked: no table for vllm 0.31.0`), and a node whose\n"
        "version differs from the profile's, are warnings in the plan. llama-server's flags are\n"
        "not checked: llmgw has no flag table for it.\n\n"
        f"## Example ({example_name})\n\n```yaml\n{example.rstrip()}\n```\n\n## Keys\n\n"
    )
    return head + "\n".join(_section(cls, path) for cls, path in _classes())
