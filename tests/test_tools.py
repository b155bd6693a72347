"""Function calling through the server: calls written in the Hermes format
(``<tool_call>{"name", "arguments"}</tool_call>``) under a grammar, on real tiny models.

Two tiny Llamas with a byte-level tokenizer: a random one (seeded: its free text is noise,
so ``"auto"`` must leave that text alone) and one trained for a second in the fixture to
answer the tool prompt with text and two calls, the second with an argument its schema
refuses. Unconstrained, that model writes the bad argument (the control); through the
server the grammar makes every call valid, ``"auto"`` keeps the text before the calls, and
``parallel_tool_calls: false`` stops after one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from server_helpers import CHAT_TEMPLATE, http, start_server
from speculative.cli.serve_cmd import TOOL_CALL_SYNTAXES
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.models.native import load_native
from speculative.sampling import SamplingParams
from speculative.server.protocol import ChatCompletionRequest
from speculative.server.tools import (
    HERMES,
    LLAMA3_JSON,
    SYNTAXES,
    CallStream,
    Mistral,
    MistralArgs,
    NamedToolChoice,
    Tool,
    call_format,
    chat_prompt,
    described,
    mistral_syntax,
    split_calls,
    template_shows_tools,
    template_syntax,
)
from speculative.structured import StructuredOutputs
from tiny import byte_tokenizer, save_tiny, save_trained

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(ALARM)]
CALL_OPEN = HERMES.open
# a template that shows the tools' names (as Qwen's shows their schemas)
TOOLS_TEMPLATE = (
    "{% if tools %}tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "{% endif %}" + CHAT_TEMPLATE
)
MESSAGES = [{"role": "user", "content": "Wake me at 7, and the weather in Paris?"}]
FIRST_CALL = '{"name": "set_alarm", "arguments": {"hour": 7}}'
# what the trained model answers: text, a call, and a call whose "days" is out of range
TRAINED_REPLY = (
    f"Sure. {CALL_OPEN}\n{FIRST_CALL}\n</tool_call>\n"
    f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 9}}}}'
    "\n</tool_call>"
)
# Llama 3's JSON calls: the whole reply, calls joined by "; " (the second out of range)
LLAMA_REPLY = (
    '{"name": "set_alarm", "parameters": {"hour": 7}}; '
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}'
)
LLAMA_TEMPLATE = "{# tool results come as ipython messages #}" + TOOLS_TEMPLATE
# Mistral's calls: the [TOOL_CALLS] token, then a JSON list (the second out of range)
MISTRAL_REPLY = (
    '[TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}}, '
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}]'
)
MISTRAL_TEMPLATE = "{# an assistant's calls follow [TOOL_CALLS] #}" + TOOLS_TEMPLATE
# Mistral's later calls: text, then [TOOL_CALLS]name[ARGS]{…} each (the second out of range)
ARGS_REPLY = (
    'Sure.[TOOL_CALLS]set_alarm[ARGS]{"hour": 7}'
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 9}'
)
ARGS_TEMPLATE = "{# [TOOL_CALLS] name [ARGS] arguments #}" + TOOLS_TEMPLATE
EOS = 1


def valid_call(call: dict) -> bool:
    """Whether a tool call names one of the tools with arguments its schema takes."""
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        return (
            set(arguments) == {"city", "days"}
            and isinstance(arguments["city"], str)
            and len(arguments["city"]) <= 12
            and type(arguments["days"]) is int
            and 1 <= arguments["days"] <= 7
        )
    return call["function"]["name"] == "set_alarm" and set(arguments) == {"hour"}


def _tokenizer(template: str = TOOLS_TEMPLATE):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama whose template shows the tools."""
    return save_tiny(tmp_path_factory.mktemp("tools_random"), seed=4, tokenizer=_tokenizer())


def _trained(folder: Path, template: str, reply_text: str) -> Path:
    """A tiny Llama trained to answer MESSAGES (through ``template``, with the tools)
    with ``reply_text`` (every token of it at probability > 0.8 under greedy decoding)."""
    tokenizer = _tokenizer(template)
    prompt = chat_prompt(tokenizer, MESSAGES, TOOLS)
    return save_trained(folder, tokenizer, [(prompt, reply_text)], goal=0.001)


@pytest.fixture(scope="module")
def caller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained to answer MESSAGES with TRAINED_REPLY (Hermes' calls)."""
    return _trained(tmp_path_factory.mktemp("tools_caller"), TOOLS_TEMPLATE, TRAINED_REPLY)


def _mistral_tokenizer(template: str = MISTRAL_TEMPLATE, markers=(Mistral.open,)):
    """The byte-level tokenizer with ``markers`` as special tokens, one each."""
    tokenizer = _tokenizer(template)
    tokenizer.add_special_tokens({"additional_special_tokens": list(markers)})
    return tokenizer


def _args_tokenizer():
    return _mistral_tokenizer(ARGS_TEMPLATE, (MistralArgs.open, MistralArgs.args))


def _trained_on(folder: Path, tokenizer, reply: str) -> Path:
    prompt = chat_prompt(tokenizer, MESSAGES, TOOLS)
    return save_trained(folder, tokenizer, [(prompt, reply)], goal=0.001)


@pytest.fixture(scope="module")
def mistral_caller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose template teaches Mistral's calls (``[TOOL_CALLS]`` a special
    token), trained to answer MESSAGES with MISTRAL_REPLY."""
    folder = tmp_path_factory.mktemp("tools_mistral_caller")
    return _trained_on(folder, _mistral_tokenizer(), MISTRAL_REPLY)


@pytest.fixture(scope="module")
def args_caller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose template teaches Mistral's later calls (``[TOOL_CALLS]`` and
    ``[ARGS]`` special tokens), trained to answer MESSAGES with ARGS_REPLY."""
    folder = tmp_path_factory.mktemp("tools_args_caller")
    return _trained_on(folder, _args_tokenizer(), ARGS_REPLY)


@pytest.fixture(scope="module")
def llama_caller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose template teaches Llama 3's JSON calls, trained to answer
    MESSAGES with LLAMA_REPLY."""
    folder = tmp_path_factory.mktemp("tools_llama_caller")
    return _trained(folder, LLAMA_TEMPLATE, LLAMA_REPLY)


def _greedy(folder: Path, prompt: list[int], grammar: Any = None, budget: int = 160) -> str:
    """The library's greedy text for ``prompt`` (under ``grammar``, a format, if given)."""
    tokenizer = byte_tokenizer()
    constraint = None
    if grammar is not None:
        constraint = grammar.compile(StructuredOutputs(tokenizer, {EOS}))()
    engine = SpeculativeEngine(load_native(folder, max_length=256), None, 4)
    stop = StopCriteria(budget, frozenset({EOS}))
    params = SamplingParams(temperature=0)
    result = engine.generate(prompt, params, stop, torch.Generator().manual_seed(0), None,
                             constraint)  # fmt: skip
    return tokenizer.decode(result.token_ids, skip_special_tokens=True)


def _client(server) -> tuple[Any, str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return client, client.models.list().data[0].id


def _chat_asker(client, model: str):
    """A greedy chat request for MESSAGES with both tools, keyword arguments on top."""

    def ask(**kw):
        return client.chat.completions.create(
            model=model, messages=MESSAGES, tools=[WEATHER, ALARM], temperature=0,
            max_tokens=kw.pop("max_tokens", 178), **kw,
        )  # fmt: skip

    return ask


def _streamed(chunks, pieces: list | None = None) -> tuple[str, list[dict], str | None]:
    """A streamed reply's text, calls (their argument pieces joined, as clients join
    them) and finish reason; ``pieces`` collects each call's argument pieces. Checks
    that a call's first delta, and only that one, names it, and that no text comes
    after the calls began."""
    text, calls, reason = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not (calls and delta.content)
        text += delta.content or ""
        for entry in delta.tool_calls or []:
            part = entry.model_dump()
            first = part["index"] == len(calls)
            assert (part["id"] is not None) == first == (part["function"]["name"] is not None)
            if first:
                calls.append({**part, "function": {**part["function"], "arguments": ""}})
                if pieces is not None:
                    pieces.append([])
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
            if pieces is not None and part["function"]["arguments"]:
                pieces[part["index"]].append(part["function"]["arguments"])
        reason = chunk.choices[0].finish_reason or reason
    return text, calls, reason


def test_calls_are_split_from_text_and_described_to_templates_without_tools() -> None:
    call = f"{CALL_OPEN}\n{FIRST_CALL}\n</tool_call>"
    reply = split_calls(f"Sure. {call}\n{call}", TOOLS)
    assert reply.content == "Sure. " and len(reply.calls) == 2
    assert [json.loads(c["function"]["arguments"]) for c in reply.calls] == [{"hour": 7}] * 2
    assert len({c["id"] for c in reply.calls}) == 2
    assert split_calls(call, TOOLS).content is None and not split_calls(call, TOOLS).cut
    cut = split_calls(f"{call}\n<tool", TOOLS)  # a next call's opener, cut: left out
    assert len(cut.calls) == 1 and not cut.cut
    named = f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": '
    cut = split_calls(f'{call}\n{named}{{"city": "Pa', TOOLS)  # a call cut in its arguments
    assert cut.cut and [c["function"]["arguments"] for c in cut.calls] == [
        '{"hour": 7}', '{"city": "Pa'
    ]  # fmt: skip
    cut = split_calls(f"Sure. {call[:-3]}", TOOLS)  # arguments whole, the closer cut
    assert cut.cut and cut.content == "Sure. " and cut.calls[0]["function"]["arguments"] == (
        '{"hour": 7}'
    )  # fmt: skip
    assert len(split_calls(f"{call}\n{named[:20]}", TOOLS).calls) == 1  # cut before its name
    for text in ("no call", f"Sure. {named[:20]}", call.replace("set_alarm", "nope"),
                 f"{call} and more", call.replace("{", "(", 1),
                 call.replace(" 7}", " 7, 8}")):  # fmt: skip
        assert split_calls(text, TOOLS).calls == [] and split_calls(text, TOOLS).content == text
    # streamed: a call's name once written, then its arguments piece by piece
    stream, entries = CallStream(TOOLS), []
    for end in range(len(TRAINED_REPLY) + 1):
        entries += stream.deltas(TRAINED_REPLY[:end])
    assert [e["function"].get("name") for e in entries if "id" in e] == [
        "set_alarm", "get_weather"
    ]  # fmt: skip
    assert "".join(e["function"]["arguments"] for e in entries if e["index"] == 1) == (
        '{"city": "Paris", "days": 9}'
    )  # fmt: skip
    assert len(entries) == 2 + len('{"hour": 7}') + len('{"city": "Paris", "days": 9}')
    # a template that shows tools gets them; one that does not gets a description
    shows, plain = _tokenizer(), _tokenizer(CHAT_TEMPLATE)
    assert (
        byte_tokenizer()
        .decode(chat_prompt(shows, MESSAGES, TOOLS))
        .startswith("tools get_weather set_alarm user")
    )
    text = byte_tokenizer().decode(chat_prompt(plain, MESSAGES, TOOLS))
    assert text.startswith("system You may call") and json.dumps(WEATHER) in text
    assert text.endswith("user Wake me at 7, and the weather in Paris? then")
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "set_alarm", "arguments": '{"hour": 7}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]  # fmt: skip
    request = {"model": "m", "messages": history}
    parsed = ChatCompletionRequest.model_validate(request).chat_messages()
    assert parsed[2]["tool_calls"][0]["function"]["arguments"] == {"hour": 7}  # for templates
    assert described(parsed, TOOLS) == described(history, TOOLS)
    rendered = described(history, TOOLS)
    assert rendered[0]["content"].startswith("Be brief.\n\nYou may call") and len(rendered) == 4
    assert rendered[2]["content"] == call and "tool_calls" not in rendered[2]
    assert chat_prompt(plain, MESSAGES, None) == chat_prompt(shows, MESSAGES, None)
    # a server asks the template once; the answer gives the prompts found per request
    assert template_shows_tools(shows) is True and template_shows_tools(plain) is False
    for tokenizer in (shows, plain):
        known = template_shows_tools(tokenizer)
        assert chat_prompt(tokenizer, MESSAGES, TOOLS, known) == chat_prompt(
            tokenizer, MESSAGES, TOOLS
        )  # fmt: skip
    assert chat_prompt(shows, MESSAGES, TOOLS, False) != chat_prompt(shows, MESSAGES, TOOLS)


def test_auto_keeps_text_and_makes_every_call_valid(caller: Path) -> None:
    tokenizer = _tokenizer()
    prompt = chat_prompt(tokenizer, MESSAGES, TOOLS)
    assert _greedy(caller, prompt, budget=200) == TRAINED_REPLY  # the control: "days" 9
    with start_server(caller, max_prompt_tokens=200) as server:
        ask = _chat_asker(*_client(server))

        choice = ask().choices[0]  # tool_choice "auto", the default beside tools
        calls = [c.model_dump() for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
        assert [c["function"]["name"] for c in calls] == ["set_alarm", "get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"hour": 7}
        assert all(valid_call(c) for c in calls)  # the grammar kept "days" within 1..7
        assert json.loads(calls[1]["function"]["arguments"])["city"] == "Paris"
        pieces: list[list[str]] = []
        text, streamed, reason = _streamed(ask(tool_choice="auto", stream=True), pieces)
        assert (text, reason) == ("Sure. ", "tool_calls")
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert [c["index"] for c in streamed] == [0, 1]
        assert len(pieces[1]) > 1  # the arguments came as they were written
        one = ask(parallel_tool_calls=False).choices[0]
        assert [c.function.name for c in one.message.tool_calls] == ["set_alarm"]
        late = ask(max_tokens=80).choices[0]  # the budget cuts the second call's opener
        assert late.finish_reason == "length" and late.message.content == "Sure. "
        (kept,) = [c.model_dump() for c in late.message.tool_calls]
        assert kept["function"] == calls[0]["function"]
        budget = TRAINED_REPLY.index('"Paris"') + 3  # (a byte a token) cut inside "Paris"
        cut = ask(max_tokens=budget).choices[0]
        assert cut.finish_reason == "length" and cut.message.content == "Sure. "
        cut_calls = [c.model_dump()["function"] for c in cut.message.tool_calls]
        assert cut_calls == [calls[0]["function"], {"name": "get_weather",
                                                    "arguments": '{"city": "Pa'}]  # fmt: skip
        streamed_cut = _streamed(ask(max_tokens=budget, stream=True))
        assert [c["function"] for c in streamed_cut[1]] == cut_calls
        assert streamed_cut[::2] == ("Sure. ", "length")
        stopped = ask(stop=['"days"']).choices[0]  # a stop string cuts the second call
        assert stopped.finish_reason == "stop"
        stopped_call = stopped.message.tool_calls[1].function.model_dump()
        assert stopped_call == cut_calls[1] | {"arguments": '{"city": "Paris", '}
        assert _streamed(ask(stop=['"days"'], stream=True))[1][1]["function"] == stopped_call
        brace = byte_tokenizer().convert_tokens_to_ids("}")  # a stop token inside a call
        braced = ask(extra_body={"stop_token_ids": [brace]}).choices[0]
        assert braced.finish_reason == "stop" and braced.message.content == "Sure. "
        (first,) = [c.model_dump()["function"] for c in braced.message.tool_calls]
        assert first == {"name": "set_alarm", "arguments": '{"hour": 7'}
        streamed_brace = _streamed(ask(extra_body={"stop_token_ids": [brace]}, stream=True))
        assert [c["function"] for c in streamed_brace[1]] == [first]
        cut = ask(max_tokens=30).choices[0]  # the budget cuts the first call
        assert cut.finish_reason == "length" and cut.message.tool_calls is None
        assert cut.message.content == TRAINED_REPLY[: len(cut.message.content)]
        assert CALL_OPEN in cut.message.content
        assert _streamed(ask(max_tokens=30, stream=True)) == (cut.message.content, [], "length")


def test_required_named_and_none(folder: Path) -> None:
    """On the random model: "auto" replies with the text the library decodes under the
    same grammar (free text, held to valid UTF-8: the grammar's text is characters);
    "required" and a named function make valid calls (the named one's greedy call is the
    library's under the same grammar); "none" replies with text; refusals name their
    field."""
    tokenizer = _tokenizer()
    prompt = chat_prompt(tokenizer, MESSAGES, TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    grammar = call_format(TOOLS, NamedToolChoice.model_validate(named))
    expected = split_calls(_greedy(folder, prompt, grammar), TOOLS)
    free = _greedy(folder, prompt, budget=60)  # noise, bytes that are not UTF-8 included
    auto_text = _greedy(folder, prompt, call_format(TOOLS, "auto"), budget=60)
    assert "\ufffd" in free and "\ufffd" not in auto_text and CALL_OPEN not in auto_text
    with start_server(folder, max_prompt_tokens=200) as server:
        client, model = _client(server)

        def ask(**kw):
            return client.chat.completions.create(
                model=model, messages=kw.pop("messages", MESSAGES),
                max_tokens=kw.pop("max_tokens", 120), tools=kw.pop("tools", [WEATHER, ALARM]),
                extra_body={"speculative": {"draft": "ngram"}}, **kw,
            )  # fmt: skip

        auto = ask(temperature=0, max_tokens=60).choices[0]
        assert auto.message.tool_calls is None and auto.message.content == auto_text
        assert _streamed(ask(temperature=0, max_tokens=60, stream=True))[0] == auto_text
        choice = ask(tool_choice=named, temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = [c.model_dump() for c in choice.message.tool_calls]
        assert call["function"] == expected.calls[0]["function"] and valid_call(call)
        sampled = ask(tool_choice="required", temperature=1.0, n=3, seed=4,
                      parallel_tool_calls=False)  # fmt: skip
        for answer in sampled.choices:
            assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
            assert valid_call(answer.message.tool_calls[0].model_dump())
        text, streamed, reason = _streamed(ask(tool_choice=named, temperature=0, stream=True))
        assert (text, reason, len(streamed)) == ("", "tool_calls", 1)
        assert streamed[0]["function"] == call["function"]
        reply = ask(tool_choice="none", temperature=0).choices[0]
        assert reply.message.tool_calls is None and reply.message.content
        history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]  # fmt: skip
        assert ask(messages=history, tool_choice="none").choices[0].message.content is not None
        bad = {"type": "function", "function": {"name": "nope"}}
        with pytest.raises(openai.BadRequestError) as caught:
            ask(tool_choice=bad)
        assert caught.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError):
            ask(messages=history, tools=None, tool_choice="required")
        broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
        with pytest.raises(openai.BadRequestError) as caught:
            ask(tools=[broken], tool_choice="required")
        assert caught.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError) as caught:
            ask(response_format={"type": "json_object"})
        assert caught.value.body["param"] == "tools"


def test_legacy_functions_answer_in_their_own_form(caller: Path) -> None:
    """OpenAI's legacy ``functions``/``function_call``: the same grammar with one call at
    most, answered as ``message.function_call`` with finish reason ``function_call``
    (streamed too); a conversation may hold the legacy call and its ``function`` result;
    tools beside functions, or a function_call naming none of them, are 400s."""
    functions = [WEATHER["function"], ALARM["function"]]
    with start_server(caller, max_prompt_tokens=200) as server:
        url = server.url + "/v1/chat/completions"
        client, model = _client(server)
        base = {"model": model, "messages": MESSAGES, "functions": functions,
                "temperature": 0, "max_tokens": 178}  # fmt: skip
        status, body = http(url, "POST", base)
        assert status == 200, body
        answer = body["choices"][0]
        assert status == 200 and answer["finish_reason"] == "function_call"
        assert answer["message"]["function_call"] == {
            "name": "set_alarm", "arguments": json.dumps({"hour": 7})
        } and "tool_calls" not in answer["message"]  # fmt: skip
        assert answer["message"]["content"] == "Sure. "
        stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                                max_tokens=178, functions=functions,
                                                stream=True)  # fmt: skip
        deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
        parts = [d.delta.function_call.model_dump() for d in deltas if d.delta.function_call]
        assert [part["name"] for part in parts] == ["set_alarm"] + [None] * (len(parts) - 1)
        joined = "".join(part["arguments"] for part in parts)  # as clients join them
        assert {"name": "set_alarm", "arguments": joined} == answer["message"]["function_call"]
        assert len(parts) > 1  # the arguments came as they were written
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["function_call"]
        history = [*MESSAGES, {"role": "assistant", "content": None,
                               "function_call": answer["message"]["function_call"]},
                   {"role": "function", "name": "set_alarm", "content": "set"}]  # fmt: skip
        status, plain = http(url, "POST", {**base, "messages": history, "function_call": "none",
                                           "max_tokens": 4})  # fmt: skip
        assert status == 200 and "function_call" not in plain["choices"][0]["message"]
        for bad, param in [({"tools": [WEATHER]}, "functions"),
                           ({"function_call": {"name": "nope"}}, "function_call")]:  # fmt: skip
            status, refused = http(url, "POST", {**base, **bad})
            assert status == 400 and refused["error"]["param"] == param


def _reads(syntax, reply: str, content: str | None, cuts, texts) -> None:
    """A call syntax's reader on ``reply`` (text ``content`` before two calls, the second
    with "days" 9): whole, each cut ``(text, calls read, last whole)``, each of ``texts``
    read as text, and streamed piece by piece to the same two calls."""

    def split(text: str):
        return split_calls(text, TOOLS, syntax)

    whole = split(reply)
    assert whole.content == content and not whole.cut
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == [
        ("set_alarm", '{"hour": 7}'), ("get_weather", '{"city": "Paris", "days": 9}')
    ]  # fmt: skip
    for cut, calls, complete in cuts:
        read = split(cut)
        assert (len(read.calls), read.cut) == (calls, not complete), cut
    for text in texts:
        assert split(text).calls == [] and split(text).content == text
    stream, entries = CallStream(TOOLS, syntax), []
    for end in range(len(reply) + 1):
        entries += stream.deltas(reply[:end])
    assert [e["function"]["name"] for e in entries if "id" in e] == ["set_alarm", "get_weather"]
    assert "".join(e["function"]["arguments"] for e in entries if e["index"] == 1) == (
        '{"city": "Paris", "days": 9}'
    )  # fmt: skip


def test_llama3_json_calls_are_read_and_streamed() -> None:
    """Llama 3's syntax: a reply that starts with ``{`` is calls joined by "; ", any
    other is text; cut calls as for Hermes."""
    llama = LLAMA3_JSON
    first = LLAMA_REPLY.index("; ")
    cuts = [
        (LLAMA_REPLY[: first + 1], 1, True),  # the separator cut short
        (LLAMA_REPLY[: first + 12], 1, True),  # the second call cut before its name
        (LLAMA_REPLY[: LLAMA_REPLY.index("Paris") + 2], 2, False),  # in its arguments
        (LLAMA_REPLY[:-1], 2, False),  # before its closing brace
    ]
    spaced = ' {"name": "set_alarm", "parameters": {}}'  # text: it does not start with {
    texts = ["Sure, at 7.", '{"name": "nope", "parameters": {}}', '{"na',
             LLAMA_REPLY + " and more", spaced]  # fmt: skip
    _reads(llama, LLAMA_REPLY, None, cuts, texts)
    assert split_calls(LLAMA_REPLY[:-1], TOOLS, llama).calls[1]["function"]["arguments"] == (
        '{"city": "Paris", "days": 9}'
    )  # fmt: skip
    # the template decides the syntax; a template without tools gets Hermes' described
    assert template_syntax(_tokenizer(LLAMA_TEMPLATE)) is llama
    assert template_syntax(_tokenizer()) is HERMES
    assert ("auto", *SYNTAXES) == TOOL_CALL_SYNTAXES  # serve's choices name them all
    text = byte_tokenizer().decode(chat_prompt(_tokenizer(CHAT_TEMPLATE), MESSAGES, TOOLS,
                                               syntax=llama))  # fmt: skip
    assert '"parameters"' in text and CALL_OPEN not in text


def _served_calls(ask, content: str | None) -> list[dict]:
    """A trained model's two calls through the server (``content`` before them): valid
    (the second's out-of-range "days" kept in range), streamed in several pieces to the
    same calls; returns them."""
    choice = ask().choices[0]
    calls = [c.model_dump() for c in choice.message.tool_calls]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert [c["function"]["name"] for c in calls] == ["set_alarm", "get_weather"]
    assert all(valid_call(c) for c in calls)
    pieces: list[list[str]] = []
    text, streamed, reason = _streamed(ask(stream=True), pieces)
    assert (text, reason) == (content or "", "tool_calls") and len(pieces[1]) > 1
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    return calls


def test_llama3_json_served(llama_caller: Path, folder: Path) -> None:
    """A model whose template teaches Llama 3's calls, served with the syntax read from
    it: the calls come back valid (the second's out-of-range "days" kept in range; the
    control: unconstrained it writes 9), streamed piece by piece; on a random model,
    "auto"'s text is what the library decodes under the same grammar and never starts
    with ``{``, and "required" gives valid calls."""
    llama = LLAMA3_JSON
    prompt = chat_prompt(_tokenizer(LLAMA_TEMPLATE), MESSAGES, TOOLS)
    assert _greedy(llama_caller, prompt, budget=200) == LLAMA_REPLY
    with start_server(llama_caller, max_prompt_tokens=200) as server:
        calls = _served_calls(_chat_asker(*_client(server)), None)
        assert json.loads(calls[1]["function"]["arguments"])["city"] == "Paris"
    grammar = call_format(TOOLS, "auto", syntax=llama)
    tokenizer = _tokenizer()
    auto_text = _greedy(folder, chat_prompt(tokenizer, MESSAGES, TOOLS), grammar, budget=60)
    assert auto_text and not auto_text.startswith("{")
    with start_server(folder, max_prompt_tokens=200, tool_call_syntax="llama3_json") as server:
        client, model = _client(server)
        auto = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=[WEATHER, ALARM], temperature=0, max_tokens=60
        ).choices[0]
        assert auto.message.tool_calls is None and auto.message.content == auto_text
        required = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=[WEATHER, ALARM], temperature=1.0, seed=3,
            tool_choice="required", max_tokens=120, n=2, parallel_tool_calls=False,
        )  # fmt: skip
        for answer in required.choices:
            assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
            assert valid_call(answer.message.tool_calls[0].model_dump())


def test_mistral_calls_are_read_and_streamed() -> None:
    """Mistral's syntax: a reply that starts with ``[TOOL_CALLS]`` and a list is calls
    joined by ", ", any other is text; cut calls as for Hermes; the opener is the
    tokenizer's special token where it has one (kept in the reply's text)."""
    tokenizer = _mistral_tokenizer()
    mistral = template_syntax(tokenizer)
    opener = tokenizer.convert_tokens_to_ids(Mistral.open)
    assert isinstance(mistral, Mistral) and mistral.special_ids == {opener}
    assert f"<[{opener}]>" in call_format(TOOLS, "required", syntax=mistral).lark
    plain = Mistral.of(_tokenizer())  # no such token: its text
    assert plain.special_ids == frozenset() and '"[TOOL_CALLS]"' in call_format(
        TOOLS, "auto", syntax=plain
    ).lark  # fmt: skip

    first = MISTRAL_REPLY.index("}, ") + 1
    cuts = [
        (MISTRAL_REPLY[: first + 1], 1, True),  # the separator cut short
        (MISTRAL_REPLY[: first + 12], 1, True),  # the second call cut before its name
        (MISTRAL_REPLY[: MISTRAL_REPLY.index("Paris") + 2], 2, False),  # in its arguments
        (MISTRAL_REPLY[:-2], 2, False),  # before its closing brace
        (MISTRAL_REPLY[:-1], 2, True),  # before the list's end
    ]
    unopened = MISTRAL_REPLY[len(Mistral.open) :]
    texts = ["Sure, at 7.", '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',
             "[TOOL_CALLS] [", MISTRAL_REPLY + " and more", unopened]  # fmt: skip
    _reads(mistral, MISTRAL_REPLY, None, cuts, texts)
    assert mistral.calls_start("[TOOL") == (None, 5)  # (its text may yet open the calls)
    described = byte_tokenizer().decode(chat_prompt(_tokenizer(CHAT_TEMPLATE), MESSAGES,
                                                    TOOLS, syntax=mistral))  # fmt: skip
    assert Mistral.open in described and CALL_OPEN not in described


def test_mistral_calls_served(mistral_caller: Path, monkeypatch) -> None:
    """A model whose template teaches Mistral's calls with ``[TOOL_CALLS]`` a special
    token: served with the syntax read from the template, the calls come back valid (the
    second's out-of-range "days" kept in range), whole and streamed. The control: with
    the token left out of the reply's text (as decoding leaves special tokens out), the
    calls are lost in the content."""
    with start_server(mistral_caller, max_prompt_tokens=200) as server:
        ask = _chat_asker(*_client(server))
        _served_calls(ask, None)
        named = ask(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        only = [c.model_dump() for c in named.choices[0].message.tool_calls]
        assert [c["function"]["name"] for c in only] == ["get_weather"] and valid_call(only[0])
    unkept = Mistral.of(_mistral_tokenizer())
    unkept.special_ids = frozenset()
    monkeypatch.setattr(Mistral, "of", classmethod(lambda cls, tokenizer: unkept))
    with start_server(mistral_caller, max_prompt_tokens=200) as server:
        lost = _chat_asker(*_client(server))().choices[0]
        assert lost.message.tool_calls is None and lost.message.content.startswith(' [{"name"')


def test_mistral_later_calls_are_read_and_streamed() -> None:
    """Mistral's later syntax (a tokenizer with ``[ARGS]``): text, then each call as
    ``[TOOL_CALLS]name[ARGS]{…}``; cut calls as for Hermes."""
    tokenizer = _args_tokenizer()
    syntax = template_syntax(tokenizer)
    ids = {tokenizer.convert_tokens_to_ids(m) for m in (MistralArgs.open, MistralArgs.args)}
    assert isinstance(syntax, MistralArgs) and syntax.special_ids == ids
    assert mistral_syntax(_mistral_tokenizer()).special_ids < ids  # (the JSON list's)

    second = ARGS_REPLY.index("[TOOL_CALLS]get")
    cuts = [
        (ARGS_REPLY[: second + 5], 1, True),  # the second call cut in its opener
        (ARGS_REPLY[: second + 16], 1, True),  # cut in its name
        (ARGS_REPLY[: ARGS_REPLY.index("Paris") + 2], 2, False),  # in its arguments
    ]
    texts = ["Sure, at 7.", "Sure.[TOOL_CALLS]nope[ARGS]{}", "Sure.[TOOL_CALLS]set",
             ARGS_REPLY + " and more"]  # fmt: skip
    _reads(syntax, ARGS_REPLY, "Sure.", cuts, texts)
    assert syntax.calls_start("Sure.[TOOL") == (None, 5)
    assert syntax.join("Sure.", [syntax.write("set_alarm", {"hour": 7})]) == ARGS_REPLY[:second]


def test_mistral_later_calls_served(args_caller: Path) -> None:
    """The later syntax served: the text before the calls as content, the calls valid
    (the second's "days" kept in range), whole and streamed alike."""
    with start_server(args_caller, max_prompt_tokens=200) as server:
        _served_calls(_chat_asker(*_client(server)), "Sure.")


def test_the_responses_api_calls_as_chat_does(caller: Path) -> None:
    """OpenAI's Responses API: flat function tools; the reply's text as a message item,
    each call a ``function_call`` item (valid: the grammar kept "days" in range), streamed
    as argument deltas; a follow-up with the calls and their outputs as input items."""
    flat = [{"type": "function", **WEATHER["function"]}, {"type": "function", **ALARM["function"]}]
    with start_server(caller, max_prompt_tokens=200) as server:
        client, model = _client(server)

        def ask(**kw):
            return client.responses.create(
                model=model, tools=flat, temperature=0,
                max_output_tokens=kw.pop("max_output_tokens", 178),
                input=kw.pop("input", MESSAGES[0]["content"]), **kw,
            )  # fmt: skip

        response = ask()
        assert [item.type for item in response.output] == ["message", "function_call",
                                                           "function_call"]  # fmt: skip
        assert response.output[0].content[0].text == "Sure. " and response.status == "completed"
        calls = response.output[1:]
        assert [call.name for call in calls] == ["set_alarm", "get_weather"]
        assert json.loads(calls[0].arguments) == {"hour": 7}
        assert all(valid_call({"function": {"name": c.name, "arguments": c.arguments}})
                   for c in calls)  # fmt: skip
        events = list(ask(stream=True))
        delta = "response.function_call_arguments.delta"
        pieces = [e.delta for e in events if e.type == delta and e.output_index == 2]
        assert len(pieces) > 1 and "".join(pieces) == calls[1].arguments
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert done == [call.arguments for call in calls]
        assert events[-1].type == "response.completed"
        history = [
            {"role": "user", "content": MESSAGES[0]["content"]},
            *({"type": "function_call", "call_id": c.call_id, "name": c.name,
               "arguments": c.arguments} for c in calls),
            *({"type": "function_call_output", "call_id": c.call_id, "output": "done"}
              for c in calls),
        ]  # fmt: skip
        follow = ask(input=history, max_output_tokens=4, tool_choice="none")
        assert follow.output[0].type == "message"


def test_anthropics_messages_api_uses_tools_as_chat_does(caller: Path) -> None:
    """Anthropic's Messages API: tools with an ``input_schema``; the reply's text as a
    ``text`` block, each call a ``tool_use`` block whose ``input`` is the chat call's
    arguments (valid: "days" kept in range), ``stop_reason`` "tool_use"; streamed as
    ``input_json_delta`` pieces; a follow-up with ``tool_result`` blocks is the chat
    completion with the calls and their results."""
    anthropic = pytest.importorskip("anthropic")
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description"),
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, ALARM)]  # fmt: skip
    with start_server(caller, max_prompt_tokens=200) as server:
        chat_client, model = _client(server)
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)

        def ask(**kw):
            return client.messages.create(
                model=model, tools=tools, max_tokens=kw.pop("max_tokens", 178),
                messages=kw.pop("messages", MESSAGES), extra_body={"temperature": 0}, **kw,
            )  # fmt: skip

        message = ask()
        expected = _chat_asker(chat_client, model)().choices[0].message
        assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == expected.content and message.stop_reason == "tool_use"
        uses = message.content[1:]
        assert [(u.name, u.input) for u in uses] == [
            (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
        ]  # fmt: skip
        assert all(valid_call({"function": {"name": u.name, "arguments": json.dumps(u.input)}})
                   for u in uses)  # fmt: skip
        events = list(ask(stream=True))
        pieces = [e.delta.partial_json for e in events
                  if e.type == "content_block_delta" and e.index == 2]  # fmt: skip
        assert len(pieces) > 1 and json.loads("".join(pieces)) == uses[1].input
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        assert [b.type for b in starts] == ["text", "tool_use", "tool_use"]
        assert events[-2].delta.stop_reason == "tool_use"
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "done"} for u in uses]
        follow_up = [*MESSAGES, {"role": "assistant", "content": message.content},
                     {"role": "user", "content": results}]  # fmt: skip
        answered = ask(messages=follow_up, max_tokens=4, tool_choice={"type": "none"})
        calls = [
            {
                "id": u.id,
                "type": "function",
                "function": {"name": u.name, "arguments": json.dumps(u.input)},
            }
            for u in uses
        ]
        chat_follow = [
            *MESSAGES,
            {"role": "assistant", "content": message.content[0].text, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": u.id, "content": "done"} for u in uses),
        ]
        chat_answer = chat_client.chat.completions.create(
            model=model, messages=chat_follow, tools=[WEATHER, ALARM], tool_choice="none",
            temperature=0, max_tokens=4,
        )  # fmt: skip
        used = answered.usage.input_tokens + answered.usage.cache_read_input_tokens
        assert used == chat_answer.usage.prompt_tokens
        assert answered.content[0].text == chat_answer.choices[0].message.content


def test_the_responses_api_takes_a_json_schema_format(folder: Path) -> None:
    """``text.format`` ``json_schema`` (the Responses form of ``response_format``): the
    random model's output, free noise otherwise, is JSON that satisfies the schema."""
    schema = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
              "maximum": 23}}, "required": ["hour"], "additionalProperties": False}  # fmt: skip
    with start_server(folder, max_prompt_tokens=200) as server:
        client, model = _client(server)
        response = client.responses.create(
            model=model, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=60,
            text={"format": {"type": "json_schema", "name": "alarm", "schema": schema}},
        )  # fmt: skip
        value = json.loads(response.output_text)
        assert set(value) == {"hour"} and 0 <= value["hour"] <= 23
        anthropic = pytest.importorskip("anthropic")
        messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        message = messages.messages.create(
            model=model, messages=MESSAGES, max_tokens=60, extra_body={"temperature": 0},
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )  # fmt: skip
        assert message.content[0].text == response.output_text  # the same grammar, greedy
