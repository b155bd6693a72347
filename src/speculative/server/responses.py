"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery.

A request is translated into a chat completion request (``instructions`` as the system
message, ``input`` as the messages, earlier ``function_call`` and
``function_call_output`` items as an assistant's tool calls and their results, flat
function tools as chat tools, ``text.format`` as ``response_format``), decoded exactly as
chat is, and its answer translated back: a whole chat completion into a ``response``
object (a ``message`` output item with ``output_text``, then a ``function_call`` item per
call), a chat stream into the Responses API's typed events (``response.created``, …,
``response.output_text.delta``, ``response.function_call_arguments.delta``, …,
``response.completed``). Responses are kept (``store``, by default) for
``previous_response_id`` follow-ups, retrieval and background decoding (see
:mod:`speculative.server.stored`); a ``conversation`` (:mod:`speculative.server.conversations`)
is continued and grows by each response's turn.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculative.server.protocol import ApiError

# chat fields whose errors name the Responses field the value came from
PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "tools": "tools",
}


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text", "reasoning_text"]
    text: str


class InputItem(BaseModel):
    """One ``input`` item: a message (``type`` "message" or absent), an earlier function
    call, a function call's output, or an earlier reply's reasoning (which the prompt
    leaves out, as chat templates leave out earlier turns' thinking)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def stored(self) -> dict[str, Any]:
        """The item as a kept response lists it (``/input_items``): with an id, a
        message's content as parts."""
        if self.type == "message":
            role = self.role or "user"
            kind = "output_text" if role == "assistant" else "input_text"
            return {"type": "message", "id": new_id("msg"), "role": role, "status": "completed",
                    "content": [{"type": kind, "text": self.text()}]}  # fmt: skip
        if self.type == "function_call":
            return {"type": "function_call", "id": new_id("fc"), "call_id": self.call_id,
                    "name": self.name, "arguments": self.arguments or "{}",
                    "status": "completed"}  # fmt: skip
        if self.type == "function_call_output":
            return {"type": "function_call_output", "id": new_id("fco"),
                    "call_id": self.call_id, "output": self.output or "",
                    "status": "completed"}  # fmt: skip
        return reasoning_item(new_id("rs"), self.text(), "completed")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields this server serves (others are ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None  # its id, or {"id": …}
    background: bool = False
    include: list[str] | None = None  # "message.output_text.logprobs" is served
    # "auto": earlier turns of the conversation are dropped (oldest first, its first turn
    # last) until the prompt fits the context window; "disabled": a 400 where it does not
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None  # alternatives with each output token's log-probability

    def conversation_id(self) -> str | None:
        """The id of the conversation the response continues and adds its turn to."""
        if isinstance(self.conversation, dict):
            given = self.conversation.get("id")
            if not isinstance(given, str):
                raise ApiError(400, "conversation must be an id or {\"id\": …}",
                               param="conversation")  # fmt: skip
            return given
        return self.conversation

    def wants_logprobs(self) -> bool:
        """Whether the output text comes with its tokens' log-probabilities (asked for in
        ``include``, or by asking for alternatives)."""
        return LOGPROBS in (self.include or ()) or bool(self.top_logprobs)

    def chat_request(self, history: Sequence[InputItem] = ()) -> dict[str, Any]:
        """The chat completion request that decodes this one after ``history`` (the
        earlier response's conversation, where ``previous_response_id`` names one), with
        extensions such as ``seed`` and ``speculative`` passed on."""
        extra = dict(self.model_extra or {})
        if self.background and not self.store:
            raise ApiError(400, "a background response needs store: true", param="background")
        passed = {k: v for k, v in extra.items() if k not in IGNORED}
        chat: dict[str, Any] = {
            **passed,
            "model": self.model,
            "messages": self._messages(history),
            "stream": self.stream,
            "n": 1,
        }
        if self.stream:
            chat["stream_options"] = {"include_usage": True}  # for response.completed
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("parallel_tool_calls", self.parallel_tool_calls),
        ):
            if value is not None:
                chat[name] = value
        if self.wants_logprobs():
            chat["logprobs"] = True
            chat["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        form = (self.text or {}).get("format")
        if form is not None and form.get("type") != "text":
            chat["response_format"] = _chat_format(form)
        return chat

    def input_items(self) -> list[InputItem]:
        """``input`` as items (a text input is one user message)."""
        if isinstance(self.input, str):
            return [InputItem(type="message", role="user", content=self.input)]
        return list(self.input)

    def _messages(self, history: Sequence[InputItem]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:  # (an earlier response's instructions are not carried over)
            messages.append({"role": "system", "content": self.instructions})
        for item in [*history, *self.input_items()]:
            if item.type == "reasoning":
                continue
            if item.type == "message":
                role = "system" if item.role == "developer" else (item.role or "user")
                messages.append({"role": role, "content": item.text()})
            elif item.type == "function_call":
                function = {"name": item.name, "arguments": item.arguments or "{}"}
                call = {"id": item.call_id, "type": "function", "function": function}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output or ""}
                )
        return messages


# Responses fields that change nothing here (reasoning, streaming details, metadata)
IGNORED = {"metadata", "user", "reasoning", "service_tier", "prompt_cache_key",
           "safety_identifier", "stream_options"}  # fmt: skip
# the ``include`` value that asks for the output text's log-probabilities (others name
# outputs of tools this server does not run, and add nothing)
LOGPROBS = "message.output_text.logprobs"


def turns(items: Sequence[InputItem]) -> list[list[InputItem]]:
    """``items`` in turns: each starts at a user message (what goes with it, the replies,
    calls and their outputs, stays with it when a turn is dropped)."""
    grouped: list[list[InputItem]] = []
    for item in items:
        if not grouped or (item.type == "message" and (item.role or "user") == "user"):
            grouped.append([])
        grouped[-1].append(item)
    return grouped


def truncations(history: Sequence[InputItem]) -> list[list[InputItem]]:
    """The histories ``truncation: "auto"`` tries, longest first: all of it, then with
    its oldest turns dropped one by one after the first (which often sets the task),
    then without the first too, down to none."""
    grouped = turns(history)
    first, rest = grouped[:1], grouped[1:]
    tried = [[item for turn in first + rest[k:] for item in turn] for k in range(len(rest) + 1)]
    return [*tried, []] if first else tried


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool."""
    if tool.get("type") != "function":
        raise ApiError(
            400, f"only function tools are served, not {tool.get('type')!r}", param="tools"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, f"tool_choice {choice!r} is not served", param="tool_choice")


def _chat_format(form: dict[str, Any]) -> dict[str, Any]:
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": form.get("type")}


def chat_error_param(param: str | None) -> str | None:
    """A chat field's name as the Responses request called it."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return PARAMS.get(head, head) + dot + rest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created: int,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
    speculative: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``response`` object."""
    conversation = request.conversation_id()
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": request.model,
        "status": status,
        "output": output,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "text": request.text or {"format": {"type": "text"}},
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "usage": _usage(usage),
        "truncation": request.truncation or "disabled",
        "previous_response_id": request.previous_response_id,
        "conversation": None if conversation is None else {"id": conversation},
        "store": request.store,
        "background": request.background,
    }
    if speculative is not None:
        body["speculative"] = speculative
    return body


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A ``message`` output item (``logprobs``: its text's tokens', where asked for)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [part] if text or status == "completed" else []}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (its ``<think>`` block) as a ``reasoning`` item."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


def whole_response(
    request: ResponsesRequest, chat: dict[str, Any], response_id: str | None = None
) -> dict[str, Any]:
    """A whole chat completion as a ``response`` (with ``response_id``, or a new id)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content") or not message.get("tool_calls"):  # (a reply of no text too)
        logprobs = (choice.get("logprobs") or {}).get("content")
        text = message.get("content") or ""
        output.append(message_item(new_id("msg"), text, "completed", logprobs))
    for call in message.get("tool_calls") or []:
        output.append(call_item(new_id("fc"), call, "completed"))
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return response_object(
        request, response_id or new_id("resp"), chat["created"], output, status,
        chat.get("usage"), chat.get("speculative"),
    )  # fmt: skip


class ResponsesAnswer:
    """How a Responses request is answered from chat's answer: whole, or as events."""

    def __init__(self, request: ResponsesRequest, response_id: str) -> None:
        self.request = request
        self.id = response_id

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        return whole_response(self.request, chat, self.id)

    def events(self) -> ResponseEvents:
        return ResponseEvents(self.request, self.id)


class ResponseEvents:
    """A chat completion's stream (its chunks' payloads, in order) as the Responses API's
    events: each :meth:`feed` returns the events a chunk makes."""

    def __init__(self, request: ResponsesRequest, response_id: str | None = None) -> None:
        self.request = request
        self.id = response_id or new_id("resp")
        self.created = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items so far (the open one last)
        self.text = ""  # the open message's text
        self.logprobs: list[dict[str, Any]] = []  # the open message's tokens' (where asked)
        self.calls: dict[int, int] = {}  # a chat call's index -> its output item's index
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.speculative: dict[str, Any] | None = None
        self.open: str | None = None  # "reasoning", "message", "call": the item being written
        self.failed: dict[str, Any] | None = None  # the error that ended the stream

    def start(self) -> list[dict[str, Any]]:
        snapshot = self._response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]  # fmt: skip

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (or of its error payload)."""
        if "error" in chunk:
            self.failed = chunk["error"]
            return [self._event("error", message=chunk["error"].get("message"),
                                code=chunk["error"].get("code"), param=None)]  # fmt: skip
        self.speculative = chunk.get("speculative", self.speculative)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"], logprobs)
            elif logprobs and self.open == "message":  # tokens that sent no text
                self.logprobs += logprobs
            for part in delta.get("tool_calls") or []:
                events += self._call(part)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def end(self) -> list[dict[str, Any]]:
        """The events that close the open item and the response."""
        if self.failed is not None:
            response = self._response("failed")
            response["error"] = {"code": "server_error", "message": self.failed.get("message")}
            return [self._event("response.failed", response=response)]
        answered = any(item["type"] != "reasoning" for item in self.output)
        events = [] if answered else [*self._close(), *self._open_message()]  # no text
        events += self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._response(status))]

    def _text(self, piece: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = [] if self.open == "message" else [*self._close(), *self._open_message()]
        self.text += piece
        self.logprobs += logprobs
        item = self.output[-1]
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=piece, logprobs=logprobs))  # fmt: skip
        return events

    def _reasoning(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if self.open != "reasoning":
            events += self._close()
            item = reasoning_item(new_id("rs"), "", "in_progress")
            self.output.append(item)
            self.open, self.text = "reasoning", ""
            events.append(self._added(item))
        self.text += piece
        item = self.output[-1]
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=piece))  # fmt: skip
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = message_item(new_id("msg"), "", "in_progress")
        self.output.append(item)
        self.open, self.text, self.logprobs = "message", "", []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._added(item)
        part_added = self._event(
            "response.content_part.added", item_id=item["id"],
            output_index=len(self.output) - 1, content_index=0, part=part,
        )  # fmt: skip
        return [added, part_added]

    def _call(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = part.get("function") or {}
        if part["index"] not in self.calls:
            events += self._close()
            call = {"id": part["id"], "function": {"name": function["name"], "arguments": ""}}
            item = call_item(new_id("fc"), call, "in_progress")
            self.output.append(item)
            self.calls[part["index"]] = len(self.output) - 1
            self.open = "call"
            events.append(self._added(item))
        at = self.calls[part["index"]]
        piece = function.get("arguments") or ""
        if piece:
            self.output[at]["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self.output[at]["id"], output_index=at,
                                      delta=piece))  # fmt: skip
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the item being written, if any."""
        if self.open is None:
            return []
        at, item = len(self.output) - 1, self.output[-1]
        events = []
        if self.open == "reasoning":
            item.update(reasoning_item(item["id"], self.text, "completed"))
            done = self._event(
                "response.reasoning_text.done", item_id=item["id"], output_index=at,
                content_index=0, text=self.text,
            )  # fmt: skip
            events.append(done)
        elif self.open == "message":
            item.update(message_item(item["id"], self.text, "completed", self.logprobs))
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"],
                                      output_index=at, content_index=0, text=self.text,
                                      logprobs=self.logprobs))  # fmt: skip
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=at, content_index=0, part=part))  # fmt: skip
        else:
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=at,
                                      arguments=item["arguments"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=at, item=item))
        self.open = None
        return events

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        return self._event("response.output_item.added", output_index=len(self.output) - 1,
                           item=dict(item))  # fmt: skip

    def _response(self, status: str) -> dict[str, Any]:
        return response_object(
            self.request, self.id, self.created, [dict(item) for item in self.output], status,
            self.usage if status != "in_progress" else None, self.speculative,
        )  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}
