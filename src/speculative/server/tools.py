"""Function calling (OpenAI's ``tools``) under a grammar.

Calls are written in the syntax the model's chat template teaches (a :class:`CallSyntax`):
the Hermes format (``<tool_call>``, a newline, one JSON object ``{"name": …, "arguments":
{…}}``, a newline, ``</tool_call>``), which Qwen's, Hermes' and many open models' chat
templates teach, Llama 3's JSON calls, or Mistral's ``[TOOL_CALLS]`` (a JSON list, or
``name[ARGS]{…}`` per call). :func:`call_format` compiles the tools into a
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from speculative.server.text import partial_stop_length, special_ids
from speculative.structured.grammar import ANY_OBJECT, JSON_FORMAT, OutputFormat

if TYPE_CHECKING:
    from speculative.targets import TemplateOptions


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


@dataclass(frozen=True)
class WrittenCall:
    """One call as the reply has written it so far."""

    name: str
    arguments: str  # its arguments' JSON text as written so far (all of it when whole)
    whole: bool  # its end came (Hermes' ``</tool_call>``, the JSON object's brace)


Written = tuple[str, list[WrittenCall]]  # the text before the calls, the calls


class CallSyntax(Protocol):
    """How a model family writes function calls: the grammar of a reply that may or must
    call, where its calls start, and how to read them back."""

    name: str
    # the special tokens the calls are written with (the reply's text keeps them, where
    # decoding would leave them out)
    special_ids: frozenset[int]

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> OutputFormat:
        """The grammar of a reply under ``tool_choice`` (see :func:`call_format`)."""
        ...

    def calls_start(self, text: str) -> tuple[int | None, int]:
        """Where the calls start in a reply's text (None: not there), and how many
        characters at its end may yet start them."""
        ...

    def written(self, text: str, names: set[str]) -> Written | None:
        """The text before the calls and the calls, as far as they are written (see
        :func:`written_calls`); None where the reply is text."""
        ...

    def write(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (an assistant's earlier call in a prompt)."""
        ...

    def join(self, text: str, calls: list[str]) -> str:
        """A reply's text and its written calls, as the model writes them together."""
        ...

    def guide(self) -> str:
        """How to write a call, for a template that does not show tools."""
        ...


def _call_schema(tool: Tool, key: str) -> dict[str, Any]:
    """A call of ``tool`` as JSON: its name and (under ``key``) its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, key: tool.function.schema()},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _calls_json(tools: list[Tool], choice: ToolChoice, key: str) -> str:
    """The JSON schema of one call (of the named function, or of any of the tools)."""
    named = isinstance(choice, NamedToolChoice)
    chosen = [_named(tools, choice.function.name)] if named else tools
    calls = [_call_schema(tool, key) for tool in chosen]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_FORMAT}
    return json.dumps(schema)


def _head(key: str) -> re.Pattern[str]:
    """A call's JSON up to its arguments: {"name": "<name>", "<key>": …"""
    return re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"' + key + r'"\s*:\s*')


def _arguments(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (None: not finished)."""
    try:
        return json.JSONDecoder().raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return None


CLOSE = re.compile(r"\s*\}")  # a call object's closing brace


def _opener_start(text: str, opener: str) -> tuple[int | None, int]:
    """Where calls that each begin with ``opener`` start in a reply's text (None: not
    there), and how many characters at its end may yet begin one."""
    start = text.find(opener)
    return (start if start >= 0 else None), partial_stop_length(text, (opener,))


def _opened(text: str, opener: str) -> tuple[str, str, str]:
    """A reply's text before its first ``opener``, the opener ("" where none), and the
    rest; an opener cut short at the end is left out."""
    cut = partial_stop_length(text, (opener,))
    head, found, rest = text[: len(text) - cut].partition(opener)
    return head, found, rest


def _list_grammar(
    tools: list[Tool], choice: ToolChoice, parallel: bool, key: str, calls: str,
    separator: str, text: str,
) -> OutputFormat:  # fmt: skip
    """The grammar of a reply that is text (``text``, the lexeme, under ``"auto"``) or a
    list of JSON calls (``calls``: the rule around ``call{more}``, where ``more`` repeats
    ``separator`` and a call, if parallel), each ``{"name": …, key: {…}}``."""
    more = f" ({json.dumps(separator)} call)*"
    more = more if parallel and not isinstance(choice, NamedToolChoice) else ""
    rules = [
        "%llguidance {}",
        f"start: {'TEXT | calls' if choice == 'auto' else 'calls'}",
        calls.format(more=more),
        f"call: %json {_calls_json(tools, choice, key)}",
    ]
    if choice == "auto":
        rules.append(f"TEXT: {text}")
    return OutputFormat(lark="\n".join(rules) + "\n")


def _cut_head(text: str, names: set[str], key: str) -> bool:
    """Whether ``text`` is a call's head cut short (before its arguments)."""
    return any(f'{{"name": "{name}", "{key}": '.startswith(text) for name in names)


def _call_list(
    text: str, at: int, names: set[str], key: str, separator: re.Pattern[str],
    tail: re.Pattern[str],
) -> list[WrittenCall] | None:  # fmt: skip
    """The JSON calls ``{"name": …, key: {…}}`` written one after another from ``at``,
    ``separator`` between them and ``tail`` after the last (the list's end, or a separator
    cut short), as far as they go: a last call cut in its arguments with them as written,
    a later call cut before its name left out. None where the text is not such calls."""
    head, calls = _head(key), []
    while True:
        found = head.match(text, at)
        if found is None or found[1] not in names:
            if calls and found is None and _cut_head(text[at:], names, key):
                return calls  # a later call cut before its name
            return None
        end = _arguments(text, found.end())
        close = CLOSE.match(text, end) if end is not None else None
        if close is None:  # cut inside the arguments or before the closing brace
            if end is not None and text[end:].strip():
                return None
            calls.append(WrittenCall(found[1], text[found.end() : end], False))
            return calls
        calls.append(WrittenCall(found[1], text[found.end() : end], True))
        more = separator.match(text, close.end())
        if more is None:
            return calls if tail.fullmatch(text, close.end()) else None
        at = more.end()


class Hermes:
    """``<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`` blocks after the
    reply's text (Qwen's, Hermes' and many open models' templates)."""

    name = "hermes"
    special_ids: frozenset[int] = frozenset()
    open = "<tool_call>"
    close = "</tool_call>"
    head = _head("arguments")

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> OutputFormat:
        """``"auto"``: any text, or text followed by calls (the first ``<tool_call>``
        starts a call: a lazy lexeme, so the text cannot hold one; after the calls, only
        more calls or the end)."""
        more = ' ("\\n"? call)*' if parallel and not isinstance(choice, NamedToolChoice) else ""
        first = "TEXT | text_open body" if choice == "auto" else "call"
        rules = [
            "%llguidance {}",
            f"start: {first}{more}",
            f"call: {json.dumps(self.open)} body",
            f'body: "\\n" %json {_calls_json(tools, choice, "arguments")} '
            f"{json.dumps(chr(10) + self.close)}",
        ]
        if choice == "auto":
            rules += [f"text_open[lazy]: TEXT {json.dumps(self.open)}", "TEXT: /(.|\\n)*/"]
        return OutputFormat(lark="\n".join(rules) + "\n")

    def calls_start(self, text: str) -> tuple[int | None, int]:
        return _opener_start(text, self.open)

    def written(self, text: str, names: set[str]) -> Written | None:
        head, opener, rest = _opened(text, self.open)
        calls: list[WrittenCall] = []
        for block in (opener + rest).split(self.open)[1:]:
            body, closer, after = block.partition(self.close)
            call = self._call(body, names, whole=bool(closer))
            if call is None and not closer and calls:  # a later call cut before its name
                break
            if call is None or (closer and after.strip()):
                return None
            calls.append(call)
            if not closer:
                break
        return (head, calls) if calls else None

    def _call(self, body: str, names: set[str], whole: bool) -> WrittenCall | None:
        """The call in a block's text (after its opener, before any closer); None where
        its name is not written yet or the block is not a call of one of ``names``."""
        head = self.head.match(body)
        if head is None or head[1] not in names:
            return None
        end = _arguments(body, head.end())
        if whole:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return None
            if end is None or set(value) != {"name", "arguments"}:
                return None
        arguments = body[head.end() : end]
        return WrittenCall(head[1], arguments, whole)

    def write(self, name: str, arguments: Any) -> str:
        value = {"name": name, "arguments": arguments}
        return f"{self.open}\n{json.dumps(value)}\n{self.close}"

    def join(self, text: str, calls: list[str]) -> str:
        return "\n".join([text, *calls] if text else calls)

    def guide(self) -> str:
        return (
            "To call one, write its name and arguments as one JSON object between "
            f"{self.open} and {self.close}, one call per block:\n"
            f'{self.open}\n{{"name": "<function name>", "arguments": {{"<argument>": '
            f'"<value>"}}}}\n{self.close}'
        )


class Llama3Json:
    """A reply that is either text or calls, each call a JSON object ``{"name": …,
    "parameters": {…}}``, calls joined by ``"; "`` (Llama 3.1–3.3's JSON tool calling,
    vLLM's ``llama3_json``)."""

    name = "llama3_json"
    special_ids: frozenset[int] = frozenset()
    separator = "; "
    # between two calls, and what may follow the last: its end, or the separator cut short
    between = re.compile(re.escape(separator))
    tail = re.compile(r"\s*|;")

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> OutputFormat:
        """``"auto"``: text that does not start with ``{``, or calls from the first
        character."""
        return _list_grammar(tools, choice, parallel, "parameters", "calls: call{more}",
                             self.separator, "/([^{](.|\\n)*)?/")  # fmt: skip

    def calls_start(self, text: str) -> tuple[int | None, int]:
        return (0 if text.startswith("{") else None), 0

    def written(self, text: str, names: set[str]) -> Written | None:
        if not text.startswith("{"):
            return None
        calls = _call_list(text, 0, names, "parameters", self.between, self.tail)
        return ("", calls) if calls else None

    def write(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments})

    def join(self, text: str, calls: list[str]) -> str:
        return self.separator.join(calls) if calls else text

    def guide(self) -> str:
        return (
            "To call functions, reply with only JSON, one object per call, joined by "
            f'"{self.separator}": {{"name": "<function name>", "parameters": '
            '{"<argument>": "<value>"}}'
        )


class Mistral:
    """A reply that is either text or Mistral's calls: the ``[TOOL_CALLS]`` token, then a
    JSON list of calls ``[{"name": …, "arguments": {…}}, …]`` (the templates of Mistral
    7B v0.3, Mixtral 8x22B, Nemo and Small 2409–2501; vLLM's ``mistral``). Where the
    tokenizer has ``[TOOL_CALLS]`` as one token the grammar writes that token (a special
    token, which the reply's text keeps), else its text."""

    name = "mistral"
    open = "[TOOL_CALLS]"
    separator = ", "
    between = re.compile(r"\s*,\s*")
    tail = re.compile(r"\s*\]?\s*")  # the list's end, or not yet

    def __init__(self, token_id: int | None = None, special: bool = False) -> None:
        self.token_id = token_id  # the opener's id, where it is one token
        kept = {token_id} if special and token_id is not None else set()
        self.special_ids = frozenset(kept)

    @classmethod
    def of(cls, tokenizer: Any) -> Mistral:
        """The syntax over ``tokenizer``: its ``[TOOL_CALLS]`` token, if it has one."""
        token_id = tokenizer.get_vocab().get(cls.open)
        special = token_id is not None and token_id in special_ids(tokenizer)
        return cls(token_id, special)

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> OutputFormat:
        """``"auto"``: any text, or the calls from the first token."""
        opener = f"<[{self.token_id}]>" if self.token_id is not None else json.dumps(self.open)
        calls = f'calls: {opener} " [" call{{more}} "]"'
        return _list_grammar(tools, choice, parallel, "arguments", calls, self.separator,
                             "/(.|\\n)*/")  # fmt: skip

    def calls_start(self, text: str) -> tuple[int | None, int]:
        begun = 0 < len(text) < len(self.open) and self.open.startswith(text)
        return (0 if text.startswith(self.open) else None), (len(text) if begun else 0)

    def written(self, text: str, names: set[str]) -> Written | None:
        opened = re.compile(re.escape(self.open) + r"\s*\[").match(text)
        if opened is None:
            return None
        calls = _call_list(text, opened.end(), names, "arguments", self.between, self.tail)
        return ("", calls) if calls else None

    def write(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "arguments": arguments})

    def join(self, text: str, calls: list[str]) -> str:
        return f"{self.open} [{self.separator.join(calls)}]" if calls else text

    def guide(self) -> str:
        return (
            f"To call functions, reply with only {self.open} and a JSON list of the calls: "
            f'{self.open} [{{"name": "<function name>", "arguments": {{"<argument>": '
            '"<value>"}}]'
        )


class MistralArgs:
    """Mistral's later calls: text, then each call as the ``[TOOL_CALLS]`` token, the
    function's name, the ``[ARGS]`` token and its arguments as JSON (the templates of
    Mistral Small 3.2, Magistral and Devstral, tokenizers v11 on; vLLM's ``mistral``
    there). The markers are written as the tokenizer's tokens where each is one, else as
    their text."""

    name = "mistral"
    open = Mistral.open
    args = "[ARGS]"

    def __init__(self, refs: tuple[str, str], special_ids: frozenset[int]) -> None:
        self.refs = refs  # the grammar's references to the opener and to [ARGS]
        self.special_ids = special_ids

    @classmethod
    def of(cls, tokenizer: Any) -> MistralArgs:
        vocab, special = tokenizer.get_vocab(), special_ids(tokenizer)
        ids = [vocab.get(marker) for marker in (cls.open, cls.args)]
        refs = tuple(f"<[{i}]>" if i is not None else json.dumps(m)
                     for i, m in zip(ids, (cls.open, cls.args), strict=True))  # fmt: skip
        return cls(refs, frozenset(i for i in ids if i in special))

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> OutputFormat:
        """``"auto"``: any text, then (or instead) the calls; each call names one of the
        tools and its arguments satisfy that function's schema."""
        named = isinstance(choice, NamedToolChoice)
        chosen = [_named(tools, choice.function.name)] if named else tools
        more = "+" if parallel and not named else ""
        first = "TEXT | TEXT calls" if choice == "auto" else "calls"
        opener, args = self.refs
        alternatives = " | ".join(f"call_{k}" for k in range(len(chosen)))
        rules = ["%llguidance {}", f"start: {first}", f"calls: ({alternatives}){more}"]
        for k, tool in enumerate(chosen):
            schema = {**tool.function.schema(), "x-guidance": JSON_FORMAT}
            rules.append(f"call_{k}: {opener} {json.dumps(tool.function.name)} {args} "
                         f"%json {json.dumps(schema)}")  # fmt: skip
        if choice == "auto":
            rules.append("TEXT: /(.|\\n)*/")
        return OutputFormat(lark="\n".join(rules) + "\n")

    def calls_start(self, text: str) -> tuple[int | None, int]:
        return _opener_start(text, self.open)

    def written(self, text: str, names: set[str]) -> Written | None:
        head, opener, rest = _opened(text, self.open)
        if not opener:
            return None
        calls: list[WrittenCall] = []
        for block in rest.split(self.open):
            name, marker, arguments = block.partition(self.args)
            if not marker:  # cut before its arguments
                if calls and any(n.startswith(name) for n in names):
                    break
                return None
            if name not in names:
                return None
            start = len(arguments) - len(arguments.lstrip())
            end = _arguments(arguments, start)
            if end is None:  # cut inside them
                calls.append(WrittenCall(name, arguments[start:], False))
                break
            if arguments[end:].strip():
                return None
            calls.append(WrittenCall(name, arguments[start:end], True))
        return (head, calls) if calls else None

    def write(self, name: str, arguments: Any) -> str:
        return f"{self.open}{name}{self.args}{json.dumps(arguments)}"

    def join(self, text: str, calls: list[str]) -> str:
        return text + "".join(calls)

    def guide(self) -> str:
        return (
            f"To call a function, write {self.open}, its name, {self.args} and its arguments "
            f'as one JSON object: {self.open}<function name>{self.args}{{"<argument>": '
            '"<value>"}'
        )


def mistral_syntax(tokenizer: Any) -> Mistral | MistralArgs:
    """Mistral's syntax for ``tokenizer``: the later one where it has an ``[ARGS]`` token
    (v11 on) or its template speaks of it, else the JSON list."""
    template = getattr(tokenizer, "chat_template", None)
    later = MistralArgs.args in tokenizer.get_vocab() or (
        isinstance(template, str) and MistralArgs.args in template
    )
    return MistralArgs.of(tokenizer) if later else Mistral.of(tokenizer)


HERMES = Hermes()
LLAMA3_JSON = Llama3Json()
# serve --tool-call-syntax: each syntax over the served model's tokenizer
SYNTAXES: dict[str, Callable[[Any], CallSyntax]] = {
    "hermes": lambda tokenizer: HERMES,
    "llama3_json": lambda tokenizer: LLAMA3_JSON,
    "mistral": mistral_syntax,
}


def call_syntax(name: str, tokenizer: Any) -> CallSyntax:
    """The syntax ``name`` (one of :data:`SYNTAXES`, or "auto": the template's) over
    ``tokenizer``."""
    return template_syntax(tokenizer) if name == "auto" else SYNTAXES[name](tokenizer)


def template_syntax(tokenizer: Any) -> CallSyntax:
    """The call syntax the tokenizer's chat template teaches: Mistral's where it speaks of
    ``[TOOL_CALLS]``, Llama 3's JSON calls where it speaks of ``<|python_tag|>`` or
    ``ipython`` results, else Hermes' blocks (also what a template without tools gets
    described)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return HERMES
    if Mistral.open in template:
        return mistral_syntax(tokenizer)
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def call_format(
    tools: list[Tool], choice: ToolChoice, parallel: bool = True, syntax: CallSyntax = HERMES
) -> OutputFormat:
    """The grammar of a reply that may or must call ``tools``, each call written in
    ``syntax`` with arguments valid under the function's ``parameters`` schema:
      - ``"auto"``: text, or calls (after the text where the syntax allows both);
      - ``"required"``: calls from the first token;
      - a named function: one call of that function.
    ``parallel``: more than one call (OpenAI's ``parallel_tool_calls``)."""
    return syntax.grammar(tools, choice, parallel)


def written_calls(text: str, tools: list[Tool], syntax: CallSyntax = HERMES) -> Written | None:
    """The text before the calls and the calls of a reply written by
    :func:`call_format`'s grammar, as far as it goes: a call counts from the moment its
    name and its arguments' key are written, a last call cut short with its arguments as
    far as they go (OpenAI's truncated call). A later call cut before that is left out.
    None where the reply is text after all: no call whose name is written, or one that
    is not a call of ``tools``."""
    return syntax.written(text, {tool.function.name for tool in tools})


@dataclass(frozen=True)
class Reply:
    """A reply split into its text and its calls (OpenAI's ``content`` and
    ``tool_calls``)."""

    content: str | None  # the text before the first call; None: none
    calls: list[dict[str, Any]]  # OpenAI's shape: {"id", "type", "function": {…}}
    cut: bool = False  # the last call is not whole (the budget or a stop string cut it)


def split_calls(text: str, tools: list[Tool], syntax: CallSyntax = HERMES) -> Reply:
    """The text and the calls of a complete reply written by :func:`call_format`'s
    grammar (:func:`written_calls`); a reply with no call whose name is written, or with
    one that is not a call of ``tools``, stays text, calls and all."""
    written = written_calls(text, tools, syntax)
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
    syntax: CallSyntax = HERMES
    ids: list[str] = field(default_factory=list)  # of the calls announced so far
    sent: list[int] = field(default_factory=list)  # argument characters sent, per call

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The ``tool_calls`` entries that bring the calls sent so far up to ``text``
        (the reply's text so far: whole characters, cut at any stop string)."""
        written = written_calls(text, self.tools, self.syntax)
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
    syntax: CallSyntax = HERMES,
    template: TemplateOptions | None = None,
) -> list[int]:
    """A chat prompt's tokens: ``messages`` through the tokenizer's chat template, with
    the ``tools`` the reply may call. A template that does not show tools (SmolLM2's)
    gets them described in a system message instead (:func:`described`, calls written in
    ``syntax``).
    ``shows_tools``: whether the template shows them (:func:`template_shows_tools`, asked
    once by a server); None: found out for these messages (one more rendering).
    ``template``: how the template renders (:class:`~speculative.targets.TemplateOptions`)."""
    from speculative.targets import encode_prompt

    if not tools:
        return encode_prompt(tokenizer, None, messages, chat=True, template=template)
    if shows_tools is False:
        return encode_prompt(
            tokenizer, None, described(messages, tools, syntax), chat=True, template=template
        )
    shown = [tool.model_dump(exclude_none=True) for tool in tools]
    ids = encode_prompt(tokenizer, None, messages, chat=True, tools=shown, template=template)
    if shows_tools or ids != encode_prompt(tokenizer, None, messages, chat=True, template=template):
        return ids
    return encode_prompt(
        tokenizer, None, described(messages, tools, syntax), chat=True, template=template
    )


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


def described(
    messages: list[dict[str, Any]], tools: list[Tool], syntax: CallSyntax = HERMES
) -> list[dict[str, Any]]:
    """``messages`` for a chat template that does not show tools (SmolLM2's): the tools
    and how to call them in a system message (the first one's text, extended), and an
    assistant's earlier calls written into its text as the model would have written
    them (in ``syntax``)."""
    listed = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in tools)
    guide = (
        "You may call these functions, given as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n{syntax.guide()}"
    )
    out = [_calls_as_text(message, syntax) for message in messages]
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{guide}"}, *out[1:]]
    return [{"role": "system", "content": guide}, *out]


def _calls_as_text(message: dict[str, Any], syntax: CallSyntax) -> dict[str, Any]:
    """An assistant message whose ``tool_calls`` are written into its text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = []
    for call in calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = function.get("arguments")
        written.append(syntax.write(function.get("name"), arguments))
    text = syntax.join(message.get("content") or "", written)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
