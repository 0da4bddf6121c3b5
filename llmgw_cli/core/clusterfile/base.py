"""The base of every cluster-file model (``Spec``): frozen, strict, unknown keys refused,
no control character in any string."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from llmgw_cli.core.clusterfile.values import CONTROL_CHARACTER, find_forbidden


class Spec(BaseModel):
    """Base of every cluster-file model: frozen, unknown keys refused, and no string of any
    field, present or future, may hold a control character: values become lines of systemd
    units and words of shell commands, where a newline starts a new directive.

    Strict: a value keeps the type YAML gave it. `"8"` is no count, `"yes"` no boolean and
    a number no text, as in the JSON Schema that editors check the file against. (The
    loader reads a number without a fractional part as an integer, as JSON does.) Enum
    fields say ``strict=False``: strict, they would take only enum members, never words."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_control_characters(cls, value: Any) -> Any:
        found = find_forbidden(value)
        if found is not None:
            raise PydanticCustomError(
                CONTROL_CHARACTER,
                "holds {what}: values end up in systemd units and shell commands, where a "
                "control character would start a new directive or command; remove it "
                "(write the value on one line, without tabs or escapes such as \\n)",
                {"what": found[2]},
            )
        return value
