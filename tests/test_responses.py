"""OpenAI's Responses API (``POST /v1/responses``) with the real ``openai`` client: the
same decoding as chat (greedy text equal to the chat completion of the same messages),
its output items and usage, the typed stream events, and the refusals of what it does
not serve (stored responses, non-function tools)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from server_helpers import http, start_server, tiny_chat_folder  # noqa: E402

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_chat_folder(tmp_path_factory.mktemp("responses"))
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


def test_what_is_not_served_is_refused_by_name(served) -> None:
    server, _client, model = served
    url = server.url + "/v1/responses"
    for body, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 9}, "temperature"),
        ({"input": []}, "input"),  # (the chat request's messages)
        ({"max_output_tokens": 10**6}, "max_output_tokens"),  # beyond the context
    ]:
        status, error = http(url, "POST", {"model": model, "input": PROMPT, **body}, key=None)
        assert status == 400 and error["error"]["param"] == param, (body, error)
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
