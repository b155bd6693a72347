"""OpenAI's Responses API (``POST /v1/responses``) with the real ``openai`` client: the
same decoding as chat (greedy text equal to the chat completion of the same messages),
its output items and usage, the typed stream events, stored responses (a follow-up by
``previous_response_id`` is the chat completion of the whole conversation and finds it in
the cache; retrieval, input items, deletion; background responses, polled and cancelled),
and the refusals of what it does not serve (conversation objects, non-function tools)."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from server_helpers import CONTINUING_TEMPLATE, http, start_server, tiny_chat_folder  # noqa: E402

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    # (a follow-up's prompt begins with the earlier prompt and reply)
    folder = tiny_chat_folder(tmp_path_factory.mktemp("responses"), CONTINUING_TEMPLATE)
    with start_server(folder, max_prompt_tokens=64) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        yield server, client, client.models.list().data[0].id


def test_a_response_is_the_chat_completion_of_the_same_messages(served) -> None:
    _server, client, model = served
    messages = [{"role": "system", "content": "red blue"}, {"role": "user", "content": PROMPT}]
    through = {"ignore_eos": True}  # (extensions pass through to the chat request)
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, extra_body=through
    )
    response = client.responses.create(
        model=model, instructions="red blue", input=PROMPT, max_output_tokens=12, temperature=0,
        extra_body=through,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.id.startswith("resp_")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.status == "incomplete"  # the budget cut it
    assert response.incomplete_details.reason == "max_output_tokens"
    # input as message items, with content parts, gives the same
    parts = client.responses.create(
        model=model, max_output_tokens=12, temperature=0, extra_body=through,
        input=[{"role": "developer", "content": "red blue"},
               {"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
    )  # fmt: skip
    assert parts.output_text == response.output_text


def test_the_stream_is_typed_events_adding_up_to_the_response(served) -> None:
    _server, client, model = served
    whole = client.responses.create(model=model, input=PROMPT, max_output_tokens=12,
                                    temperature=0)  # fmt: skip
    events = list(client.responses.create(model=model, input=PROMPT, max_output_tokens=12,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 12


def test_output_text_log_probabilities_are_the_chat_completions(served) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the output
    text's tokens and alternatives, as the chat completion of the same messages gives
    them, whole and streamed (each delta's own)."""
    _server, client, model = served
    through = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}  # (words only)
    asked = {"model": model, "input": PROMPT, "max_output_tokens": 8, "temperature": 0,
             "include": ["message.output_text.logprobs"], "top_logprobs": 2,
             "extra_body": through}  # fmt: skip
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=through,
    )  # fmt: skip
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    whole = client.responses.create(**asked)
    got = [entry.model_dump() for entry in whole.output[0].content[0].logprobs]
    assert len(got) == 8 and got == expected
    assert all(len(entry["top_logprobs"]) == 2 for entry in got)
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.model_dump() for e in deltas for entry in e.logprobs]
    assert streamed == expected
    plain = client.responses.create(**{**asked, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []  # only where asked for


def test_what_is_not_served_is_refused_by_name(served) -> None:
    server, _client, model = served
    url = server.url + "/v1/responses"
    for body, param in [
        ({"conversation": "conv_1"}, "conversation"),  # (a 404: there is no such one)
        ({"conversation": {"name": "x"}}, "conversation"),
        ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True, "store": False}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 9}, "temperature"),
        ({"input": []}, "input"),  # (the chat request's messages)
        ({"max_output_tokens": 10**6}, "max_output_tokens"),  # beyond the context
    ]:
        status, error = http(url, "POST", {"model": model, "input": PROMPT, **body}, key=None)
        assert status in (400, 404) and error["error"]["param"] == param, (body, error)
    status, _ = http(url, "POST", {"model": model, "input": PROMPT, "store": False,
                                   "max_output_tokens": 2}, key=None)  # fmt: skip
    assert status == 200


def test_a_stream_that_fails_ends_with_response_failed() -> None:
    from speculative.server.responses import ResponseEvents, ResponsesRequest

    events = ResponseEvents(ResponsesRequest(model="m", input="hi"))
    started = events.start()
    text = events.feed(
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    )
    failed = events.feed({"error": {"message": "decoding failed", "code": None}})
    ended = events.end()
    kinds = [e["type"] for e in [*started, *text, *failed, *ended]]
    assert kinds[-2:] == ["error", "response.failed"]
    assert ended[-1]["response"]["status"] == "failed"
    assert ended[-1]["response"]["error"]["message"] == "decoding failed"


def test_a_follow_up_is_the_whole_conversation_and_finds_it_in_the_cache(served) -> None:
    _server, client, model = served
    # words only (no <unk> or </s>, which decoding drops): the reply re-tokenizes as made
    through = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}
    first = client.responses.create(
        model=model, input=PROMPT, max_output_tokens=8, temperature=0, extra_body=through
    )
    then = client.responses.create(
        model=model, previous_response_id=first.id, input="and then", max_output_tokens=8,
        temperature=0, extra_body=through,
    )  # fmt: skip
    assert then.previous_response_id == first.id
    # the earlier turn's prompt and reply, then the new input, rendered and decoded again
    cached = then.usage.input_tokens_details.cached_tokens
    held = first.usage.input_tokens + first.usage.output_tokens - 1  # (the last not yet fed)
    assert held <= cached < then.usage.input_tokens  # the first turn's row still held them
    messages = [{"role": "user", "content": PROMPT},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then"}]  # fmt: skip
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=through
    )
    assert then.output_text == chat.choices[0].message.content
    assert then.usage.input_tokens == chat.usage.prompt_tokens
    # instructions are the request's own: a follow-up with others is decoded with them
    told = client.responses.create(
        model=model, previous_response_id=first.id, input="and then", instructions="red",
        max_output_tokens=8, temperature=0, extra_body=through,
    )  # fmt: skip
    assert told.usage.input_tokens > then.usage.input_tokens


def test_a_conversation_object_is_continued_and_grows_by_each_turn(served) -> None:
    """``conversation``: a response decodes the conversation's items, then its own input,
    exactly as the chat completion of those messages, finds the last turn in the cache,
    and adds its input and output to the conversation (streamed and whole alike)."""
    _server, client, model = served
    through = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}
    asked = {"model": model, "max_output_tokens": 6, "temperature": 0, "extra_body": through}
    made = client.conversations.create(items=[{"role": "user", "content": PROMPT}],
                                       metadata={"topic": "cats"})  # fmt: skip
    assert made.object == "conversation" and made.metadata == {"topic": "cats"}
    first = client.responses.create(conversation=made.id, input="and then", **asked)
    assert first.conversation.id == made.id
    events = list(client.responses.create(conversation={"id": made.id}, input="so", stream=True,
                                          **asked))  # fmt: skip
    second = events[-1].response
    messages = [{"role": "user", "content": PROMPT}, {"role": "user", "content": "and then"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "so"}]  # fmt: skip
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, extra_body=through
    )
    assert second.output_text == chat.choices[0].message.content
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= held
    items = client.conversations.items.list(made.id, order="asc").data
    texts = [item.content[0].text for item in items]
    assert texts == [PROMPT, "and then", first.output_text, "so", second.output_text]
    assert [item.role for item in items] == ["user", "user", "assistant", "user", "assistant"]
    # items added, read, taken out; the conversation's metadata replaced; then deleted
    added = client.conversations.items.create(made.id, items=[{"role": "user", "content": "a"}])
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=made.id).id == (
        added.first_id
    )
    client.conversations.items.delete(items[0].id, conversation_id=made.id)
    left = client.conversations.items.list(made.id, order="asc").data
    assert [item.id for item in left] == [item.id for item in items[1:]] + [added.first_id]
    assert client.conversations.update(made.id, metadata={"topic": "dogs"}).metadata == {
        "topic": "dogs"
    }
    assert client.conversations.retrieve(made.id).metadata == {"topic": "dogs"}
    assert client.conversations.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):  # a response id is not a conversation's
        client.conversations.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(conversation=made.id, input="so", **asked)


def test_a_conversation_gains_a_turn_only_from_a_response_that_ends_well(
    served, monkeypatch
) -> None:
    server, client, model = served
    engine = server.server.config.app.state.scheduler.engine
    step = engine.step

    def fails():
        raise RuntimeError("the pass broke")

    made = client.conversations.create()
    monkeypatch.setattr(engine, "step", fails)
    failed = client.responses.create(model=model, conversation=made.id, input=PROMPT,
                                     max_output_tokens=4, background=True)  # fmt: skip
    assert _poll(client, failed.id).status == "failed"
    monkeypatch.setattr(engine, "step", step)
    assert client.conversations.items.list(made.id).data == []
    done = client.responses.create(model=model, conversation=made.id, input=PROMPT,
                                   max_output_tokens=4, background=True)  # fmt: skip
    assert _poll(client, done.id).status in ("completed", "incomplete")
    assert len(client.conversations.items.list(made.id).data) == 2  # its input and output


def test_a_streamed_response_is_kept_and_followed_up(served) -> None:
    """A streamed response is kept as its last event gives it: retrieved whole, and a
    follow-up continues it (the same text as after the whole response)."""
    _server, client, model = served
    asked = {"model": model, "max_output_tokens": 6, "temperature": 0}
    events = list(client.responses.create(input=PROMPT, stream=True, **asked))
    streamed = events[-1].response
    kept = client.responses.retrieve(streamed.id)
    assert kept.output_text == streamed.output_text and kept.status == streamed.status
    whole = client.responses.create(input=PROMPT, **asked)
    after_stream = client.responses.create(previous_response_id=streamed.id, input="and", **asked)
    after_whole = client.responses.create(previous_response_id=whole.id, input="and", **asked)
    assert whole.output_text == streamed.output_text
    assert after_stream.output_text == after_whole.output_text


def test_interleaved_conversations_each_find_their_last_turn_in_the_cache(served) -> None:
    """Two conversations taking turns: each next request starts from its own last turn
    (the other's rows took other free slots, not the one it finished in)."""
    _server, client, model = served
    through = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}
    asked = {"model": model, "max_output_tokens": 6, "temperature": 0, "extra_body": through}
    turns = {name: client.responses.create(input=text, **asked)
             for name, text in (("cat", PROMPT), ("dog", "a dog ran on the rug"))}  # fmt: skip
    for _ in range(2):
        for name, last in list(turns.items()):
            then = client.responses.create(previous_response_id=last.id, input="and", **asked)
            held = last.usage.input_tokens + last.usage.output_tokens - 1
            assert then.usage.input_tokens_details.cached_tokens >= held, name
            turns[name] = then


def test_truncation_auto_drops_the_oldest_turns_after_the_first(served) -> None:
    """A conversation grown past the prompt limit (64 tokens here) is a 400 with
    ``truncation`` off; with "auto" the oldest turns after the first are dropped until it
    fits, and the reply is the chat completion of what was kept."""
    _server, client, model = served
    through = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}
    asked = {"model": model, "max_output_tokens": 8, "temperature": 0, "extra_body": through}
    says = ["the cat sat on the mat and the dog ran on the rug",
            "a big red cat sat on a small blue mat",
            "then it was a big dog and it ran on the red rug",
            "and then the small cat ran on the mat"]  # fmt: skip
    replies, last = [], None
    for text in says[:3]:
        last = client.responses.create(input=text, previous_response_id=last and last.id,
                                       **asked)  # fmt: skip
        replies.append(last.output_text)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input=says[3], previous_response_id=last.id, **asked)
    assert refused.value.body["code"] == "context_length_exceeded"
    cut = client.responses.create(input=says[3], previous_response_id=last.id,
                                  truncation="auto", **asked)  # fmt: skip
    assert cut.truncation == "auto" and cut.usage.input_tokens <= 64
    kept = [{"role": "user", "content": says[0]}, {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": says[2]}, {"role": "assistant", "content": replies[2]},
            {"role": "user", "content": says[3]}]  # fmt: skip
    chat = client.chat.completions.create(
        model=model, messages=kept, max_tokens=8, temperature=0, extra_body=through
    )
    assert cut.usage.input_tokens == chat.usage.prompt_tokens
    assert cut.output_text == chat.choices[0].message.content
    # what is kept is what the model saw (the kept conversation stays within the window)
    items = client.responses.input_items.list(cut.id, order="asc").data
    assert [item.content[0].text for item in items] == [m["content"] for m in kept]


def test_truncations_keep_turns_whole_and_the_first_longest() -> None:
    from speculative.server.responses import InputItem, truncations

    def item(role: str, text: str = "x", kind: str = "message") -> InputItem:
        if kind != "message":
            return InputItem(type=kind, call_id="c", name="f", output="o")
        return InputItem(role=role, content=text)

    history = [item("user", "1"), item("assistant"), item("user", "2"),
               item("", kind="function_call"), item("", kind="function_call_output"),
               item("assistant"), item("user", "3"), item("assistant")]  # fmt: skip
    tried = [[i.content for i in kept if i.role == "user"] for kept in truncations(history)]
    assert tried == [["1", "2", "3"], ["1", "3"], ["1"], []]
    lengths = [len(kept) for kept in truncations(history)]
    assert lengths == [8, 4, 2, 0]  # the call and its output went with their turn


def test_a_stored_response_is_retrieved_listed_and_deleted(served) -> None:
    server, client, model = served
    first = client.responses.create(model=model, input=PROMPT, max_output_tokens=4, temperature=0)
    then = client.responses.create(
        model=model, previous_response_id=first.id, input="and then", max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    kept = client.responses.retrieve(then.id)
    assert kept.output_text == then.output_text and kept.usage == then.usage
    items = client.responses.input_items.list(then.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")
    ]  # fmt: skip
    assert items[1].content[0].text == first.output_text
    assert items[2].content[0].text == "and then"
    newest = client.responses.input_items.list(then.id, limit=2)  # desc by default
    assert [item.id for item in newest.data] == [items[2].id, items[1].id]
    assert newest.has_more
    rest = client.responses.input_items.list(then.id, limit=2, after=items[1].id)
    assert [item.id for item in rest.data] == [items[0].id] and not rest.has_more
    for query, param in (("limit=x", "limit"), ("limit=0", "limit"), ("order=up", "order"),
                         ("after=msg_none", "after")):  # fmt: skip
        status, error = http(f"{server.url}/v1/responses/{then.id}/input_items?{query}",
                             key=None)  # fmt: skip
        assert status == 400 and error["error"]["param"] == param, query
    # deleting the first leaves the follow-up's conversation whole
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=model, previous_response_id=first.id, input="x")
    assert gone.value.body["param"] == "previous_response_id"
    again = client.responses.create(
        model=model, previous_response_id=then.id, input="more", max_output_tokens=2
    )
    assert again.usage.input_tokens > then.usage.input_tokens
    unkept = client.responses.create(model=model, input=PROMPT, max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_background_response_is_polled_to_the_foreground_answer(served) -> None:
    _server, client, model = served
    asked = {"model": model, "input": PROMPT, "max_output_tokens": 12, "temperature": 0}
    foreground = client.responses.create(**asked)
    started = client.responses.create(**asked, background=True)
    assert started.status in ("queued", "in_progress") and started.output == []
    polled = _poll(client, started.id)
    assert polled.status == foreground.status and polled.background
    assert polled.output_text == foreground.output_text
    with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
        client.responses.cancel(foreground.id)


def test_a_cancelled_background_response_frees_its_row(served, monkeypatch) -> None:
    import threading

    server, client, model = served
    scheduler = server.server.config.app.state.scheduler
    step, asked, after = scheduler.engine.step, threading.Event(), []

    def held_step():  # the row cannot finish (at the tiny context's end) before the cancel
        result = step()
        after.extend([1] if asked.is_set() else [])
        asked.wait(30)
        return result

    monkeypatch.setattr(scheduler.engine, "step", held_step)
    long = client.responses.create(
        model=model, input=PROMPT, max_output_tokens=2000, background=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    _wait(lambda: scheduler.running == 1)
    cancelled = client.responses.cancel(long.id)
    asked.set()
    assert cancelled.status == "cancelled"
    _wait(lambda: scheduler.running == 0)  # the row left the batch
    assert len(after) <= 1  # at once, not at the context's end (dozens of rounds on)
    assert client.responses.retrieve(long.id).status == "cancelled"


def test_a_background_stream_is_resumed_after_the_last_event_seen(served, monkeypatch) -> None:
    """``background`` with ``stream``: the events come as a foreground stream's would,
    the client may go away without stopping the response, and ``GET …?stream=true
    &starting_after=N`` gives the events after N, as they come, until it ends."""
    import threading

    server, client, model = served
    asked = {"model": model, "input": PROMPT, "max_output_tokens": 12, "temperature": 0}
    foreground = client.responses.create(**asked)
    events = list(client.responses.create(**asked, background=True, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    ended = events[-1].response
    assert ended.output_text == foreground.output_text and ended.background
    again = client.responses.retrieve(ended.id, stream=True, starting_after=3)
    assert [event.model_dump() for event in again] == [event.model_dump() for event in events[4:]]

    engine = server.server.config.app.state.scheduler.engine
    step, released, rounds = engine.step, threading.Event(), []

    def held_step():  # after its first round the response waits while the client goes away
        released.wait(30 if rounds else 0)
        rounds.append(1)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    seen = []
    with client.responses.create(**asked, background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 3:
                break  # the client goes away after the first round's first event
    response_id = seen[0].response.id
    assert client.responses.retrieve(response_id).status == "in_progress"  # it decodes on
    released.set()
    rest = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=seen[-1].sequence_number))  # fmt: skip
    resumed = [*seen, *rest]
    assert [event.sequence_number for event in resumed] == list(range(len(resumed)))
    assert resumed[-1].response.output_text == foreground.output_text
    assert [event.type for event in resumed] == [event.type for event in events]
    whole = client.responses.create(**asked, background=True)  # not streamed: not resumable
    for unstreamed in (foreground.id, whole.id):
        status, error = http(f"{server.url}/v1/responses/{unstreamed}?stream=true", key=None)
        assert status == 400 and error["error"]["param"] == "stream"
    _poll(client, whole.id)


def test_a_background_response_whose_decoding_fails_is_failed(served, monkeypatch) -> None:
    server, client, model = served
    engine = server.server.config.app.state.scheduler.engine
    step, calls = engine.step, []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the pass broke")
        return step()

    monkeypatch.setattr(engine, "step", fails_once)
    started = client.responses.create(model=model, input=PROMPT, max_output_tokens=4,
                                      background=True)  # fmt: skip
    failed = _poll(client, started.id)
    assert failed.status == "failed" and "the pass broke" in failed.error.message
    again = client.responses.create(model=model, input=PROMPT, max_output_tokens=4)
    assert again.usage.output_tokens > 0  # the server decodes on


def _poll(client, response_id: str):
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.02)
    raise AssertionError(f"{response_id} still {response.status} after 60 s")


def _wait(condition) -> None:
    import time

    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_store_keeps_the_most_recently_used_and_never_evicts_a_running_one() -> None:
    from speculative.server.protocol import ApiError
    from speculative.server.stored import LocalRecords, ResponseStore, StoredResponse

    def response(name: str, status: str = "completed") -> StoredResponse:
        return StoredResponse(
            {"id": name, "object": "response", "status": status, "output": []}, []
        )

    async def run() -> None:
        store = ResponseStore(capacity=2)
        queued = response("a", "queued")
        await store.put(queued)  # running: kept past the capacity
        await store.put(response("b"))
        await store.put(response("c"))
        assert list(store.records.kept) == ["a", "c"]  # b, the oldest finished one, went
        await store.finish(queued, {**queued.body, "status": "completed"})
        await store.records.update({**queued.body, "status": "in_progress"})  # (never back)
        assert (await store.get("a")).body["status"] == "completed"  # now the most recent
        await store.put(response("d"))
        assert list(store.records.kept) == ["a", "d"]  # c, now the least recently used, went
        with pytest.raises(ApiError) as missing:
            await ResponseStore(capacity=0).get("a", "previous_response_id")
        assert missing.value.status == 404 and "--responses-store 0" in missing.value.message
        with pytest.raises(ApiError) as elsewhere:  # (it may live in another replica)
            await ResponseStore(capacity=10, replicas=2).get("a")
        assert "2 replicas" in elsewhere.value.message
        with pytest.raises(ApiError) as shared:  # shared records: it is nowhere
            await ResponseStore(10, 2, LocalRecords(10, shared=True)).get("a")
        assert "replicas" not in shared.value.message

    asyncio.run(run())


def test_only_the_last_streams_keep_their_events() -> None:
    """A background stream's events are kept for the last STREAMS_KEPT streams (their
    responses stay kept without them), and always while the stream decodes."""
    from speculative.server.stored import STREAMS_KEPT, LocalRecords

    async def run() -> LocalRecords:
        records = LocalRecords(capacity=1000)
        for i in range(STREAMS_KEPT + 3):
            status = "in_progress" if i == 1 else "completed"
            await records.put({"id": f"r{i}/events", "object": "response.events"}, [])
            await records.put({"id": f"r{i}", "object": "response", "status": status}, [])
        return records

    kept = asyncio.run(run()).kept
    assert [f"r{i}" in kept for i in range(3)] == [True] * 3  # the responses stay
    assert [f"r{i}/events" in kept for i in range(4)] == [False, True, False, True]
    assert sum(key.endswith("/events") for key in kept) == STREAMS_KEPT + 1  # (+ the running)


def test_stored_items_translate_back_to_the_chat_they_came_from() -> None:
    from speculative.server.responses import InputItem, ResponsesRequest

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'}
    given = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    request = ResponsesRequest(model="m", input=given)
    stored = [item.stored() for item in request.input_items()]
    assert len({item["id"] for item in stored}) == 4
    history = [InputItem.model_validate(item) for item in stored]
    follow_up = ResponsesRequest(model="m", input="thanks")
    assert follow_up.chat_request(history)["messages"] == [
        *request.chat_request()["messages"], {"role": "user", "content": "thanks"}
    ]  # fmt: skip
    assert [m["role"] for m in follow_up.chat_request(history)["messages"]] == [
        "user", "assistant", "tool", "user"
    ]  # fmt: skip
