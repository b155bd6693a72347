"""Request bodies of the OpenAI-compatible endpoints and OpenAI-shaped errors.

Validation that needs no model (types, ranges, unsupported options) lives in the pydantic
models; what needs the loaded model (the model id, the context window, the drafters)
is checked in :mod:`speculative.server.app`. Every failure becomes an :class:`ApiError`,
returned as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from speculative.targets import TemplateOptions

from speculative.sampling.penalties import Penalties
from speculative.server.tools import (
    HERMES,
    CallSyntax,
    FunctionName,
    FunctionSpec,
    NamedToolChoice,
    Tool,
    ToolChoice,
    call_format,
)
from speculative.structured.grammar import ANY_OBJECT, OutputFormat

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_GAMMA = 16
MAX_COMPLETION_LOGPROBS = 5  # alternatives per token, as OpenAI's API: completions ...
MAX_TOP_LOGPROBS = 20  # ... and chat
MAX_CHOICES = 16  # n: choices per request (each a row of the batch) ...
MAX_PROMPTS = 16  # ... and completions' prompts per request (prompts × n rows at most 16)


class ApiError(Exception):
    """An error answered as OpenAI's JSON error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class SpeculativeOptions(BaseModel):
    """The ``speculative`` extension object: which loaded drafter (or "none") and γ."""

    model_config = ConfigDict(extra="forbid")

    draft: str | None = None  # a drafter loaded at startup, or "none" (plain decoding)
    gamma: int | None = Field(default=None, ge=1, le=MAX_GAMMA)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must satisfy."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema here


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON by a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise ValueError("type json_schema needs json_schema.schema (a JSON schema object)")
        return self

    def wanted_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must satisfy (None: free text)."""
        if self.type == "json_object":
            return dict(ANY_OBJECT)
        if self.type == "json_schema":
            assert self.json_schema is not None and self.json_schema.schema_
            return self.json_schema.schema_
        return None


class StructuredOutputsOptions(BaseModel):
    """vLLM's ``structured_outputs`` extension: one of a JSON schema, a regular expression
    (matched in full), a list of choices or a Lark grammar."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_format(self) -> StructuredOutputsOptions:
        given = [v for v in (self.json_, self.regex, self.choice, self.grammar) if v is not None]
        if len(given) != 1:
            raise ValueError("give one of json, regex, choice or grammar")
        return self

    def output_format(self) -> OutputFormat:
        output = OutputFormat.given(self.json_, self.regex, self.choice, self.grammar)
        assert output is not None  # _one_format
        return output


# vLLM's earlier names for the same options, taken as structured_outputs
GUIDED_OPTIONS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's ``prediction``: ``{"type": "content", "content": …}``."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(BaseModel):
    """Fields shared by completions and chat completions (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; 0 or -1: off
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)  # vLLM's extension; 0: off
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # as OpenAI's API
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as text) -> offset, as OpenAI's
    response_format: ResponseFormat | None = None  # JSON output (structured outputs)
    structured_outputs: StructuredOutputsOptions | None = None  # vLLM's: regex, choice, ...

    @field_validator("logit_bias")
    @classmethod
    def _token_offsets(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, offset in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids, got {token!r}")
            if not -100 <= offset <= 100:
                raise ValueError(f"offsets lie in [-100, 100], got {offset} for token {token}")
        return value

    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: rows decoded together
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # vLLM's: under serve --scheduling-policy priority, waiting requests are admitted
    # lowest value first (ties in arrival order)
    priority: int = 0
    ignore_eos: bool = False  # as vLLM: decode through end-of-sequence (benchmarks)
    # vLLM's: tokens that end the output like end-of-sequence (their text left out) ...
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # ... and the stop string or stop token kept at the end of the text
    include_stop_str_in_output: bool = False
    # vLLM's: end-of-sequence and stop tokens held back until the output has this many
    min_tokens: int = Field(default=0, ge=0)
    # OpenAI's Predicted Outputs: text the reply is expected to resemble, drafted from
    prediction: Prediction | None = None
    speculative: SpeculativeOptions | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:  # 0: see _some_tokens
            raise ValueError(f"max_tokens must be at least 1, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @model_validator(mode="before")
    @classmethod
    def _guided_options(cls, data: Any) -> Any:
        """vLLM's ``guided_json`` and kin as ``structured_outputs`` (one of them at most,
        and not beside it)."""
        if not isinstance(data, dict):
            return data
        guided = {key: data[key] for key in GUIDED_OPTIONS if data.get(key) is not None}
        if not guided:
            return data
        if len(guided) > 1 or data.get("structured_outputs") is not None:
            names = sorted(guided) + ["structured_outputs"] * ("structured_outputs" in data)
            raise ApiError(
                400, f"give one output format, got {', '.join(names)}", param=names[0]
            )  # fmt: skip
        ((key, value),) = guided.items()
        rest = {k: v for k, v in data.items() if k not in GUIDED_OPTIONS}
        return {**rest, "structured_outputs": {GUIDED_OPTIONS[key]: value}}

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> _Common:
        budget = self.wanted_tokens()
        if budget is not None and self.min_tokens > budget:
            raise ApiError(
                400, f"min_tokens ({self.min_tokens}) exceeds max_tokens ({budget})",
                param="min_tokens",
            )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _some_tokens(self) -> _Common:
        """A budget of 0 tokens only where the request scores its prompt."""
        if self.wanted_tokens() == 0 and not self.echoes_prompt():
            raise ApiError(
                400,
                "max_tokens must be at least 1 (0 only with echo: true on /v1/completions, "
                "which returns the prompt, scored where logprobs is set)",
                param="max_tokens",
            )
        return self

    def echoes_prompt(self) -> bool:
        """Whether the response carries the prompt (completions' ``echo``)."""
        return False

    def candidates(self) -> int:
        """Rows sampled per prompt (``n``; completions' ``best_of`` more)."""
        return self.n

    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token where the prompt's log-probabilities are asked
        for (echoed with ``logprobs``); None: not asked for."""
        return None

    def output_format(self) -> OutputFormat | None:
        """What the output must be (``response_format`` or ``structured_outputs``: not
        both); None: free text."""
        schema = None if self.response_format is None else self.response_format.wanted_schema()
        options = self.structured_outputs
        if schema is not None and options is not None:
            raise ApiError(
                400, "give response_format or structured_outputs, not both",
                param="structured_outputs",
            )  # fmt: skip
        if options is not None:
            return options.output_format()
        return None if schema is None else OutputFormat(json_schema=schema)

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())  # the validator made it a list

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no
        log-probabilities."""
        return None

    def penalties(self, ends: frozenset[int] = frozenset()) -> Penalties:
        """The request's penalties of the target's logits (the engine applies active ones);
        ``ends``: the tokens that end its output (``min_tokens`` holds them back)."""
        bias = tuple((int(token), offset) for token, offset in (self.logit_bias or {}).items())
        return Penalties(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, bias,
            self.min_tokens, tuple(sorted(ends)) if self.min_tokens else (),
        )  # fmt: skip

    def stop_tokens(self) -> frozenset[int]:
        """The request's own stop tokens (``stop_token_ids``)."""
        return frozenset(self.stop_token_ids or ())


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (raw, no chat template) as text or token ids, or
    a list of them: each prompt gets ``n`` choices (prompt p's choice j has index
    p × n + j)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # the prompt before the completion (its tokens' log-probabilities too, with logprobs;
    # with max_tokens 0, the prompt alone: scoring)
    echo: bool = False
    # each token's log-probability and this many alternatives' (0: the token's alone)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # completions sampled per prompt, of which the n likeliest per token are returned
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    # the text after the completion: the model fills in between prompt and suffix (its
    # fill-in-the-middle tokens; "" or null: none, as clients send by default)
    suffix: str | None = None

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def echoes_prompt(self) -> bool:
        return self.echo

    def wanted_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _some_prompts(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        prompts = _as_prompts(value)
        if not prompts:
            raise ValueError("the prompt list is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts a request, got {len(prompts)}")
        for prompt in prompts:
            if not prompt or (isinstance(prompt, str) and not prompt.strip()):
                raise ValueError("the prompt is empty")
            if not isinstance(prompt, str) and min(prompt) < 0:
                raise ValueError("token ids are non-negative")
        return value

    @model_validator(mode="after")
    def _rows_fit(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError(
                400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of"
            )  # fmt: skip
        if self.stream and self.candidates() > self.n:
            raise ApiError(400, "best_of above n cannot be streamed", param="best_of")
        if self.suffix and self.echo:
            raise ApiError(400, "echo cannot be combined with a suffix", param="suffix")
        rows = len(self.prompts()) * self.candidates()
        if rows > MAX_CHOICES:
            param = "n" if self.best_of is None else "best_of"
            raise ApiError(
                400, f"prompts × {param} is at most {MAX_CHOICES}, got {rows}", param=param
            )  # fmt: skip
        return self

    def candidates(self) -> int:
        """Rows sampled per prompt: ``best_of`` (the ``n`` likeliest per token are
        returned), else ``n``."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        return _as_prompts(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: str | list[TextPart] | None = None  # None: an assistant's tool calls alone
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (passed on)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: dict[str, Any] | None = None  # the legacy form of one call

    @model_validator(mode="after")
    def _some_content(self) -> ChatMessage:
        if self.function_call is not None and self.tool_calls is None:  # legacy: one call
            self.tool_calls = [{"type": "function", "function": self.function_call}]
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (but for an assistant's tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (``developer`` as ``system``)."""
        roles = {"developer": "system", "function": "tool"}  # (a legacy function result)
        message: dict[str, Any] = {
            "role": roles.get(self.role, self.role),
            "content": self.text(),
        }
        if self.tool_calls:
            message["tool_calls"] = [_arguments_parsed(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class TemplateFields(BaseModel):
    """How a chat's messages go through the chat template (vLLM's fields)."""

    add_generation_prompt: bool = True  # the assistant's turn opened for the reply
    continue_final_message: bool = False  # the last (assistant) message continued: a prefill
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables

    def template_options(self) -> TemplateOptions:
        """The options (400 naming the field that makes them impossible)."""
        from speculative.targets import TemplateOptions

        variables = tuple((self.chat_template_kwargs or {}).items())
        try:
            return TemplateOptions(
                self.add_generation_prompt, self.continue_final_message, variables
            )
        except ValueError as exc:
            param = "chat_template_kwargs" if "variable" in str(exc) else "continue_final_message"
            raise ApiError(400, str(exc), param=param) from None


class ChatCompletionRequest(TemplateFields, _Common):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False  # each token's log-probability ...
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # ... and more
    tools: list[Tool] | None = None  # functions the reply may call (see server.tools)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (default: any)
    functions: list[FunctionSpec] | None = None  # OpenAI's legacy tools: one call, …
    function_call: Literal["none", "auto"] | FunctionName | None = None  # … its tool_choice
    # vLLM's: the reply starts with the last message where that is the assistant's (a
    # prefill continued with continue_final_message comes back whole)
    echo: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _legacy_functions_as_tools(self) -> ChatCompletionRequest:
        """OpenAI's legacy ``functions`` and ``function_call`` as tools with one call at
        most (the reply then answers in the legacy form: :meth:`legacy_functions`)."""
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ApiError(400, "give tools or the legacy functions, not both", param="functions")
        if not self.functions:
            if self.function_call not in (None, "none", "auto"):
                raise ApiError(400, "function_call needs functions", param="function_call")
            return self
        self.tools = [Tool(type="function", function=spec) for spec in self.functions]
        choice = self.function_call
        named = isinstance(choice, FunctionName)
        self.tool_choice = NamedToolChoice(type="function", function=choice) if named else choice
        self.parallel_tool_calls = False
        return self

    def legacy_functions(self) -> bool:
        """Whether the request gave the legacy ``functions`` (the reply's call then goes
        as ``function_call``, the finish reason ``function_call``)."""
        return bool(self.functions)

    @model_validator(mode="after")
    def _tool_choice_served(self) -> ChatCompletionRequest:
        """A choice needs tools to choose from; a named one must be among them."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools to choose from", param="tool_choice")
            return self
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if choice.function.name not in names:
                field = "function_call" if self.legacy_functions() else "tool_choice"
                raise ApiError(
                    400, f"{field} names {choice.function.name!r}; the tools are "
                    f"{', '.join(names)}", param=field,
                )  # fmt: skip
        return self

    def may_call(self) -> bool:
        """Whether the reply may call a function (tools, and a choice other than "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def output_format(self, syntax: CallSyntax = HERMES) -> OutputFormat | None:
        """The calls' grammar (in ``syntax``) where the reply may call a function (not
        beside another format: a reply is text, calls, or both), else as for any
        request."""
        given = super().output_format()
        if not self.may_call():
            return given
        if given is not None:
            raise ApiError(400, "give tools or an output format, not both", param="tools")
        assert self.tools is not None
        choice = self.tool_choice or "auto"  # OpenAI's default beside tools
        parallel = self.parallel_tool_calls is not False
        return call_format(self.tools, choice, parallel, syntax)

    def echoed_message(self) -> str:
        """The text the reply starts with: the last message's, where ``echo`` asks for it
        and it is the assistant's; else ""."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def template_tools(self) -> list[Tool] | None:
        """The tools the prompt shows the model (None: none to show)."""
        return self.tools if self.may_call() else None

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages is empty")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_completion_tokens must be at least 1, got {value}")
        return value

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]


class TokenizeRequest(TemplateFields):
    """``POST /tokenize`` (vLLM's): the tokens the server would count for a completions
    ``prompt`` (the tokenizer's own special tokens included) or a chat's ``messages``
    (through the chat template, with ``tools`` shown as a chat request shows them)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give a prompt or messages (one of them)", param="prompt")
        if not self.messages and self.messages is not None:
            raise ApiError(400, "messages is empty", param="messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _arguments_parsed(call: dict[str, Any]) -> dict[str, Any]:
    """A call as chat templates take it: OpenAI sends a call's ``arguments`` as JSON
    text; templates (Qwen's, Hermes') write them with ``tojson`` and expect an object."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _as_prompts(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts (a text or token ids each)."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [list(value)]  # one prompt's token ids
    return list(value)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first pydantic error as an OpenAI error (``param``: the field's path)."""
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"'{param}' is required"
    elif first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    elif param:
        message = f"{param}: {message}"
    return ApiError(400, message, param=param)
