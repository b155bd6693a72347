"""Function calling (OpenAI's ``tools``) by constrained decoding.

A request that must call a function (``tool_choice`` ``"required"`` or a named function)
has its output constrained by a grammar (:mod:`speculative.structured`): a named
function's ``parameters`` schema (the output is the call's arguments), or, for
``"required"``, one of the functions as ``{"name": …, "arguments": {…}}``. The output is
then always a well-formed call, and speculation stays exact with respect to the
constrained target. ``"auto"`` (the model decides whether to call) would need a parser
for each model family's own call syntax: it is refused with a 400 that says so.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculative.structured.grammar import ANY_OBJECT, OutputFormat


class FunctionSpec(BaseModel):
    """A function the model may call: its name, description and parameters' schema."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # calls always follow the schema here

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (any object where none is given)."""
        return self.parameters or dict(ANY_OBJECT)


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def call_format(tools: list[Tool], choice: ToolChoice) -> OutputFormat:
    """What the output must be to call a function: the named one's arguments, or any of
    ``tools`` as ``{"name", "arguments"}`` (``"required"``)."""
    if isinstance(choice, NamedToolChoice):
        return OutputFormat(json_schema=_named(tools, choice.function.name).function.schema())
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.schema(),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return OutputFormat(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})


def tool_call(text: str, tools: list[Tool], choice: ToolChoice) -> dict[str, Any] | None:
    """The call ``text`` (a complete constrained output) makes, in OpenAI's shape
    (``{"id", "type", "function": {"name", "arguments"}}``, the arguments as JSON text),
    or None where the text is not a whole call (the token budget cut it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(choice, NamedToolChoice):
        name, arguments = _named(tools, choice.function.name).function.name, value
    elif isinstance(value, dict) and {"name", "arguments"} <= set(value):
        name, arguments = value["name"], value["arguments"]
    else:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _named(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
