"""Function calling (OpenAI's ``tools``) under a grammar.

Calls are written in the Hermes format (``<tool_call>``, a newline, one JSON object
``{"name": …, "arguments": {…}}``, a newline, ``</tool_call>``), which Qwen's, Hermes' and
many open models' chat templates teach. :func:`call_format` compiles the tools into a
grammar (:mod:`speculative.structured`): with ``tool_choice`` ``"auto"`` free text whose
first ``<tool_call>`` opens a call (llguidance's lazy lexeme), with ``"required"`` a call
from the first token, with a named function one call of it; every call names one of the
tools and its arguments satisfy that function's schema. Speculation stays exact with
respect to the grammar-restricted target. :func:`split_calls` reads a reply back into
OpenAI's ``content`` and ``tool_calls``, and :class:`CallStream` streams the calls as
they are written (a call's name, then its arguments piece by piece); :func:`chat_prompt`
shows the tools to the model, described in a system message where the chat template
does not show them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculative.server.text import partial_stop_length
from speculative.structured.grammar import ANY_OBJECT, JSON_FORMAT, OutputFormat


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


CALL_OPEN = "<tool_call>"  # a call's text, as Hermes-format models write it:
CALL_CLOSE = "</tool_call>"  # <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>
TEXT_RULES = (
    'text_open[lazy]: TEXT "<tool_call>"',  # text up to its first call opener, no further
    "TEXT: /(.|\\n)*/",
)


def call_format(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> OutputFormat:
    """The grammar of a reply that may or must call ``tools``, each call written as
    ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` (the Hermes format
    that Qwen's and many open models' templates teach) with ``arguments`` valid under the
    function's ``parameters`` schema:
      - ``"auto"``: any text, or text followed by calls (the first ``<tool_call>`` the
        model writes starts a call; after the calls, only more calls or the end);
      - ``"required"``: calls from the first token;
      - a named function: one call of that function.
    ``parallel``: more than one call (OpenAI's ``parallel_tool_calls``)."""
    named = isinstance(choice, NamedToolChoice)
    chosen = [_named(tools, choice.function.name)] if named else tools
    calls = [_call_schema(tool) for tool in chosen]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_FORMAT}
    close = json.dumps("\n" + CALL_CLOSE)
    more = ' ("\\n"? call)*' if parallel and not named else ""
    first = "TEXT | text_open body" if choice == "auto" else "call"
    rules = [
        "%llguidance {}",
        f"start: {first}{more}",
        f"call: {json.dumps(CALL_OPEN)} body",
        f'body: "\\n" %json {json.dumps(schema)} {close}',
        *(TEXT_RULES if choice == "auto" else ()),
    ]
    return OutputFormat(lark="\n".join(rules) + "\n")


def _call_schema(tool: Tool) -> dict[str, Any]:
    """A call of ``tool`` as JSON: its name and its arguments."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.function.schema(),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class WrittenCall:
    """One call as the reply has written it so far."""

    name: str
    arguments: str  # its arguments' JSON text as written so far (all of it when whole)
    whole: bool  # its ``</tool_call>`` came


@dataclass(frozen=True)
class Reply:
    """A reply split into its text and its calls (OpenAI's ``content`` and
    ``tool_calls``)."""

    content: str | None  # the text before the first call; None: none
    calls: list[dict[str, Any]]  # OpenAI's shape: {"id", "type", "function": {…}}
    cut: bool = False  # the last call is not whole (the budget or a stop string cut it)


# a call's text up to its arguments: {"name": "<one of the tools>", "arguments": …
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*')


def written_calls(text: str, tools: list[Tool]) -> tuple[str, list[WrittenCall]] | None:
    """The text before the calls and the calls of a reply written by
    :func:`call_format`'s grammar, as far as it goes: a call counts from the moment its
    name and the ``"arguments"`` key are written, a last call cut short with its
    arguments as far as they go (OpenAI's truncated call). A later call cut before
    that (or the start of its opener) is left out. None where the reply is text after
    all: no call whose name is written, or a block that is not a call of ``tools``."""
    cut = partial_stop_length(text, (CALL_OPEN,))  # a next call's opener, cut short
    head, opener, rest = text[: len(text) - cut].partition(CALL_OPEN)
    names = {tool.function.name for tool in tools}
    calls: list[WrittenCall] = []
    for block in (opener + rest).split(CALL_OPEN)[1:]:
        body, closer, after = block.partition(CALL_CLOSE)
        call = _written(body, names, whole=bool(closer))
        if call is None and not closer and calls:  # a later call cut before its name
            break
        if call is None or (closer and after.strip()):
            return None
        calls.append(call)
        if not closer:
            break
    return (head, calls) if calls else None


def _written(body: str, names: set[str], whole: bool) -> WrittenCall | None:
    """The call in a block's text (after its opener, before any closer); None where its
    name is not written yet or the block is not a call of one of ``names``."""
    head = CALL_HEAD.match(body)
    if head is None or head[1] not in names:
        return None
    arguments = body[head.end() :]
    try:
        _, end = json.JSONDecoder().raw_decode(arguments)
    except json.JSONDecodeError:
        end = None  # not finished (or not JSON: a whole call is checked below)
    if whole:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if end is None or set(value) != {"name", "arguments"}:
            return None
    return WrittenCall(head[1], arguments if end is None else arguments[:end], whole)


def split_calls(text: str, tools: list[Tool]) -> Reply:
    """The text and the calls of a complete reply written by :func:`call_format`'s
    grammar (:func:`written_calls`); a reply with no call whose name is written, or with
    a block that is not a call of ``tools``, stays text, calls and all."""
    written = written_calls(text, tools)
    if written is None:
        return Reply(text, [])
    head, calls = written
    return Reply(
        head if head.strip() else None,
        [openai_call(call_id(), call.name, call.arguments) for call in calls],
        cut=not calls[-1].whole,
    )


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class CallStream:
    """OpenAI's streamed ``tool_calls`` of a reply as it grows: a call's first delta
    carries its index, id, type and name, later ones the next piece of its arguments
    (clients join them); a reply's text goes out beside them, by the text's own path."""

    tools: list[Tool]
    ids: list[str] = field(default_factory=list)  # of the calls announced so far
    sent: list[int] = field(default_factory=list)  # argument characters sent, per call

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The ``tool_calls`` entries that bring the calls sent so far up to ``text``
        (the reply's text so far: whole characters, cut at any stop string)."""
        written = written_calls(text, self.tools)
        out: list[dict[str, Any]] = []
        for k, call in enumerate(written[1] if written is not None else []):
            if k == len(self.ids):
                self.ids.append(call_id())
                self.sent.append(0)
                out.append({"index": k, **openai_call(self.ids[k], call.name, "")})
            piece = call.arguments[self.sent[k] :]
            if not piece:
                continue
            self.sent[k] = len(call.arguments)
            if out and out[-1]["index"] == k:
                out[-1]["function"]["arguments"] = piece
            else:
                out.append({"index": k, "function": {"arguments": piece}})
        return out


def _named(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    shows_tools: bool | None = None,
) -> list[int]:
    """A chat prompt's tokens: ``messages`` through the tokenizer's chat template, with
    the ``tools`` the reply may call. A template that does not show tools (SmolLM2's)
    gets them described in a system message instead (:func:`described`).
    ``shows_tools``: whether the template shows them (:func:`template_shows_tools`, asked
    once by a server); None: found out for these messages (one more rendering)."""
    from speculative.targets import encode_prompt

    if not tools:
        return encode_prompt(tokenizer, None, messages, chat=True)
    if shows_tools is False:
        return encode_prompt(tokenizer, None, described(messages, tools), chat=True)
    shown = [tool.model_dump(exclude_none=True) for tool in tools]
    ids = encode_prompt(tokenizer, None, messages, chat=True, tools=shown)
    if shows_tools or ids != encode_prompt(tokenizer, None, messages, chat=True):
        return ids
    return encode_prompt(tokenizer, None, described(messages, tools), chat=True)


PROBE_TOOL = Tool(type="function", function=FunctionSpec(name="probe"))


def template_shows_tools(tokenizer: Any) -> bool | None:
    """Whether the tokenizer's chat template shows tools (renders other tokens with one
    than without), probed with and without a system message; None where it rendered
    neither probe (:func:`chat_prompt` then finds out per request)."""
    from speculative.targets import encode_prompt

    if not getattr(tokenizer, "chat_template", None):
        return None
    shown = [PROBE_TOOL.model_dump(exclude_none=True)]
    user = {"role": "user", "content": "Hello"}
    rendered = False
    for messages in ([user], [{"role": "system", "content": "Be brief."}, user]):
        try:
            with_tools = encode_prompt(tokenizer, None, messages, chat=True, tools=shown)
            without = encode_prompt(tokenizer, None, messages, chat=True)
        except Exception:  # the template's own error (jinja's): it refuses this probe
            continue
        rendered = True
        if with_tools != without:
            return True
    return False if rendered else None


def described(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """``messages`` for a chat template that does not show tools (SmolLM2's): the tools
    and how to call them in a system message (the first one's text, extended), and an
    assistant's earlier calls written into its text as the model would have written
    them."""
    listed = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in tools)
    guide = (
        "You may call these functions, given as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, write its name and arguments as one JSON object between "
        f"{CALL_OPEN} and {CALL_CLOSE}, one call per block:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{"<argument>": "<value>"}}}}'
        f"\n{CALL_CLOSE}"
    )
    out = [_calls_as_text(message) for message in messages]
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{guide}"}, *out[1:]]
    return [{"role": "system", "content": guide}, *out]


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose ``tool_calls`` are written into its text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = []
    for call in calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = function.get("arguments")
        value = {"name": function.get("name"), "arguments": arguments}
        blocks.append(f"{CALL_OPEN}\n{json.dumps(value)}\n{CALL_CLOSE}")
    text = "\n".join([message["content"], *blocks] if message.get("content") else blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
