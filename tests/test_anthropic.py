"""Anthropic's Messages API (``POST /v1/messages``) with the real ``anthropic`` client: the
same decoding as chat (a message's text and usage are the chat completion's of the same
messages), its stop reasons, its stream events adding up to the whole message, token
counting, the API key as ``x-api-key``, and errors in Anthropic's shape. Tool use is in
``tests/test_tools.py``."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from server_helpers import API_KEY, http, start_server, tiny_chat_folder  # noqa: E402

PROMPT = "the cat sat on the mat"
SYSTEM = "red blue"
# greedy, words only (no <unk> or </s>): passed on to the chat request as the body's fields
# (this SDK no longer takes sampling parameters itself)
GREEDY = {"temperature": 0, "ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_chat_folder(tmp_path_factory.mktemp("anthropic"))
    with start_server(folder, api_key=API_KEY) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
        chat = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield server, client, chat, chat.models.list().data[0].id


def _chat(chat, model: str, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    return chat.chat.completions.create(model=model, messages=messages, extra_body=GREEDY, **kw)


def test_a_message_is_the_chat_completion_of_the_same_messages(served) -> None:
    _server, client, chat, model = served
    asked = {"model": model, "system": SYSTEM, "extra_body": GREEDY,
             "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    message = client.messages.create(max_tokens=12, **asked)
    expected = _chat(chat, model, max_tokens=12)
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    cached = message.usage.cache_read_input_tokens
    assert message.usage.input_tokens + cached == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens == 12
    counted = client.messages.count_tokens(**{**asked, "extra_body": None})
    assert counted.input_tokens == expected.usage.prompt_tokens
    # a stop sequence the reply writes ends it there, and is named
    word = message.content[0].text.split()[2]
    stopped = client.messages.create(max_tokens=12, stop_sequences=[word], **asked)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    assert message.content[0].text.startswith(stopped.content[0].text)
    # Anthropic's content blocks and a list system prompt render as the strings do
    blocks = client.messages.create(
        max_tokens=12, model=model, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    )  # fmt: skip
    assert blocks.content[0].text == message.content[0].text


def test_the_stream_is_anthropics_events_adding_up_to_the_message(served) -> None:
    _server, client, _chat_client, model = served
    asked = {"model": model, "max_tokens": 12, "extra_body": GREEDY, "system": SYSTEM,
             "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    whole = client.messages.create(**asked)
    events = list(client.messages.create(stream=True, **asked))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**asked) as stream:  # the SDK's own accumulation
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    word = whole.content[0].text.split()[2]  # a stop sequence, named in message_delta
    cut = list(client.messages.create(stream=True, stop_sequences=[word], **asked))
    assert cut[-2].delta.stop_reason == "stop_sequence" and cut[-2].delta.stop_sequence == word


def test_keys_and_errors_as_anthropics_clients_expect(served) -> None:
    server, client, _chat_client, model = served
    asked = {"max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]}
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=model, **asked)
    assert denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", **asked)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},
    }
    assert "claude-nope" in missing.value.body["error"]["message"]
    headers = {"x-api-key": API_KEY}
    for body, named in [
        ({"model": model, "messages": [{"role": "user", "content": PROMPT}]}, "max_tokens"),
        ({**asked, "model": model, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({**asked, "model": model, "tools": [{"type": "web_search_20250305", "name": "w"}]},
         "tools"),
    ]:  # fmt: skip
        status, error = http(server.url + "/v1/messages", "POST", body, key=None, headers=headers)
        assert status == 400 and error["type"] == "error", (body, error)
        assert error["error"]["type"] == "invalid_request_error" and named in str(error)
    status, error = http(server.url + "/v1/chat/completions", "POST", {}, key=None,
                         headers=headers)  # fmt: skip
    assert status == 400 and "param" in error["error"]  # (OpenAI's shape elsewhere)
    for path in ("/v1/conversations", "/v1/batches", "/v1/responses/resp_1/cancel"):
        assert http(server.url + path, "POST", {}, key=None)[0] == 401, path  # kept routes too
    assert http(server.url + "/v1/conversations", "POST", {})[0] == 200  # (with the key)


def test_thinking_on_or_off_reaches_the_template_as_enable_thinking(tmp_path) -> None:
    """Anthropic's ``thinking`` ``enabled`` / ``disabled`` is the chat template's
    ``enable_thinking`` (Qwen3's switch): a template that closes an empty thinking block
    when it is off renders a longer prompt then; without ``thinking`` it renders as on."""
    from server_helpers import CHAT_TEMPLATE

    template = CHAT_TEMPLATE + (
        "{% if enable_thinking is defined and not enable_thinking %} red blue{% endif %}"
    )
    with start_server(tiny_chat_folder(tmp_path, template)) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        model = http(server.url + "/v1/models", key=None)[1]["data"][0]["id"]
        asked = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
        counted = {
            kind: client.messages.count_tokens(**asked, thinking=thinking).input_tokens
            for kind, thinking in (
                ("on", {"type": "enabled", "budget_tokens": 1024}),
                ("off", {"type": "disabled"}),
                ("unsaid", anthropic.omit),
            )
        }
        assert counted["off"] == counted["on"] + 2 and counted["unsaid"] == counted["on"]
