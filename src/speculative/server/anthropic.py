"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over
the chat machinery, for clients written against Anthropic's SDK.

A request is translated into a chat completion request (``system`` as the system
message, ``text`` blocks as content, an assistant's ``tool_use`` blocks as its tool calls
and a user's ``tool_result`` blocks as tool messages, ``tools``' ``input_schema`` as chat
tools' parameters, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` as chat's,
``stop_sequences`` as ``stop``, ``output_config.format``'s JSON schema as
``response_format``), decoded exactly as chat is, and its answer translated
back: a whole chat completion into a ``message`` (``thinking``, ``text`` and
``tool_use`` content blocks, ``stop_reason`` ``end_turn`` / ``max_tokens`` /
``stop_sequence`` / ``tool_use``, ``usage``), a chat stream into Anthropic's events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` with ``text_delta``,
``thinking_delta`` and ``input_json_delta``, ``message_delta``, ``message_stop``). Errors
take Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculative.server.protocol import ApiError
from speculative.server.responses import new_id

# an HTTP status's Anthropic error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# Anthropic's fields that change nothing here
IGNORED = {"metadata", "service_tier", "container", "cache_control", "mcp_servers",
           "context_management", "inference_geo", "speed", "diagnostics", "user_profile_id",
           "workspace_id", "anthropic_version"}  # fmt: skip


class Block(BaseModel):
    """One content block of a message (the fields of the types served)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None  # a tool_use block's
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # a tool_result block's
    content: str | list[Block] | None = None
    thinking: str | None = None

    def plain(self) -> str:
        """A text block's text, or a tool result's content as text."""
        if self.type == "text":
            return self.text or ""
        if isinstance(self.content, list):
            return "".join(block.plain() for block in self.content)
        return self.content or ""


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str | None = None  # "custom" or absent: a client tool; others run on Anthropic's side
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: the fields this server serves (Anthropic's others, such as
    ``metadata``, are ignored; other fields, such as ``seed``,
    ``ignore_eos`` or ``speculative``, are passed on to the chat request)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)  # required, but not to count tokens
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its "format": a JSON schema the text follows
    output_format: dict[str, Any] | None = None  # (the same, as its beta named it)
    # {"type": "enabled" | "disabled" | "adaptive", …}: as the chat template's
    # enable_thinking (Qwen3's switch) where it is on or off
    thinking: dict[str, Any] | None = None

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request that decodes this one."""
        passed = {k: v for k, v in (self.model_extra or {}).items() if k not in IGNORED}
        chat: dict[str, Any] = {**passed, "model": self.model, "messages": self._messages(),
                                "n": 1, "stream": self.stream}  # fmt: skip
        if self.stream:
            chat["stream_options"] = {"include_usage": True}  # for message_delta's usage
        for name, value in (
            ("max_tokens", self.max_tokens),
            ("stop", self.stop_sequences),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
        ):
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat |= _chat_tool_choice(self.tool_choice)
        kind = (self.thinking or {}).get("type")
        if kind in ("enabled", "disabled"):
            variables = chat.setdefault("chat_template_kwargs", {})
            variables.setdefault("enable_thinking", kind == "enabled")
        form = (self.output_config or {}).get("format") or self.output_format
        if form is not None:
            if form.get("type") != "json_schema":
                raise ApiError(400, "output_config.format must be of type json_schema",
                               param="output_config")  # fmt: skip
            schema = {"name": "output", "schema": form.get("schema") or {"type": "object"}}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        return chat

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):
            system = "".join(block.plain() for block in system)
        if system:
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                messages += _user_turn(message.content)
            else:
                messages.append(_assistant_turn(message.content))
        return messages


def _user_turn(blocks: list[Block]) -> list[dict[str, Any]]:
    """A user message's blocks: its tool results as tool messages, its text after them."""
    turn, text = [], ""
    for block in blocks:
        if block.type == "tool_result":
            turn.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": block.plain()})  # fmt: skip
        elif block.type == "text":
            text += block.plain()
        else:
            raise ApiError(400, f"content blocks of type {block.type!r} are not served here",
                           param="messages")  # fmt: skip
    return [*turn, {"role": "user", "content": text}] if text or not turn else turn


def _assistant_turn(blocks: list[Block]) -> dict[str, Any]:
    """An assistant message's blocks: its text and its tool calls (thinking left out, as
    chat templates leave out earlier turns' thinking)."""
    text = "".join(block.plain() for block in blocks if block.type == "text")
    calls = [
        {"id": block.id, "type": "function",
         "function": {"name": block.name, "arguments": json.dumps(block.input or {})}}
        for block in blocks if block.type == "tool_use"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _chat_tool(tool: AnthropicTool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(400, f"tools of type {tool.type!r} are not served here (client "
                       "tools with an input_schema are)", param="tools")  # fmt: skip
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    chosen: dict[str, Any] = {
        "auto": {"tool_choice": "auto"},
        "any": {"tool_choice": "required"},
        "none": {"tool_choice": "none"},
        "tool": {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}},
    }.get(kind, {})
    if not chosen:
        raise ApiError(400, f"tool_choice type {kind!r} is not one of auto, any, tool, none",
                       param="tool_choice")  # fmt: skip
    if choice.get("disable_parallel_tool_use"):
        chosen["parallel_tool_calls"] = False
    return chosen


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat choice (its vLLM ``stop_reason``
    names the stop string that ended it)."""
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(choice.get("finish_reason") or "", "end_turn"), None


def _usage(chat: dict[str, Any] | None) -> dict[str, int]:
    chat = chat or {}
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat.get("prompt_tokens", 0) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": chat.get("completion_tokens", 0),
    }


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an object ({} where a budget cut them short)."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesAnswer:
    """How a Messages request is answered from chat's answer: whole, or as events."""

    def __init__(self, request: MessagesRequest) -> None:
        self.request = request
        self.id = new_id("msg")

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as a ``message``."""
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})  # fmt: skip
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                            "input": _arguments(function["arguments"])})  # fmt: skip
        stop_reason, stop_sequence = _stop(choice)
        return {**self._message(content, stop_reason, stop_sequence, _usage(chat.get("usage"))),
                "speculative": chat.get("speculative")}  # fmt: skip

    def events(self) -> MessageEvents:
        return MessageEvents(self)

    def _message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
        usage: dict[str, int],
    ) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.request.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}  # fmt: skip


class MessageEvents:
    """A chat completion's stream (its chunks' payloads, in order) as Anthropic's events:
    each :meth:`feed` returns the events a chunk makes."""

    def __init__(self, answer: MessagesAnswer) -> None:
        self.answer = answer
        self.blocks = -1  # the index of the block being written (or last written)
        self.open: str | None = None  # "text", "thinking", "tool_use"
        self.calls: dict[int, int] = {}  # a chat call's index -> its block's index
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.usage: dict[str, int] = _usage(None)
        self.failed = False

    def start(self) -> list[dict[str, Any]]:
        message = self.answer._message([], None, None, _usage(None))
        return [{"type": "message_start", "message": message}]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            self.failed = True
            return [error_body(500, chunk["error"].get("message") or "decoding failed")]
        if chunk.get("usage") is not None:
            self.usage = _usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._piece("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""},
                                      {"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]})  # fmt: skip
            if delta.get("content"):
                events += self._piece("text", {"type": "text", "text": ""},
                                      {"type": "text_delta", "text": delta["content"]})  # fmt: skip
            for part in delta.get("tool_calls") or []:
                events += self._call(part)
            if choice.get("finish_reason") is not None:
                self.stop = _stop(choice)
        return events

    def end(self) -> list[dict[str, Any]]:
        if self.failed:
            return []
        stop_reason, stop_sequence = self.stop
        delta = {"type": "message_delta", "usage": self.usage,
                 "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}  # fmt: skip
        return [*self._close(), delta, {"type": "message_stop"}]

    def _piece(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[dict]:
        events = [] if self.open == kind else [*self._close(), *self._start(kind, block)]
        return [*events, {"type": "content_block_delta", "index": self.blocks, "delta": delta}]

    def _call(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        function = part.get("function") or {}
        events = []
        if part["index"] not in self.calls:
            block = {"type": "tool_use", "id": part["id"], "name": function["name"], "input": {}}
            events += [*self._close(), *self._start("tool_use", block)]
            self.calls[part["index"]] = self.blocks
        piece = function.get("arguments") or ""
        if piece:
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append({"type": "content_block_delta", "index": self.calls[part["index"]],
                           "delta": delta})  # fmt: skip
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks += 1
        self.open = kind
        return [{"type": "content_block_start", "index": self.blocks, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks}]
