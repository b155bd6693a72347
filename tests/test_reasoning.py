"""A reasoning model's thinking split from its answer (``reasoning_content``), whole and
streamed, on tiny models trained in the fixtures (about a second each): one that writes
``<think>…</think>`` itself (Qwen3's way) and one whose template opens the block in the
generation prompt (DeepSeek-R1's); the control, ``--reasoning-parser none``, gives the
whole text as content. The streamed router is checked against the whole split for every
way of cutting a reply into pieces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from server_helpers import CHAT_TEMPLATE, start_server  # noqa: E402
from speculative.server.reasoning import ReasoningStream, split_reasoning  # noqa: E402
from tiny import byte_tokenizer, save_trained  # noqa: E402

MESSAGES = [{"role": "user", "content": "Wake me at 7."}]
THINKS = "<think>\nThe user wants an alarm at 7.\n</think>\n\nSure, at 7."
# a template that speaks of thinking (the parser's auto), and one that opens the block
QWEN_LIKE = "{# models think in <think></think> first #}" + CHAT_TEMPLATE
R1_LIKE = (
    "{# history keeps what follows </think> #}"
    + CHAT_TEMPLATE
    + ("{% if add_generation_prompt %}<think>\n{% endif %}")
)


def _thinker(folder: Path, template: str, reply: str, special_tags: bool = False) -> Path:
    tokenizer = byte_tokenizer()
    if special_tags:  # one special token each, which decoding leaves out
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = template
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return save_trained(folder, tokenizer, [(ids, reply)])


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _thinker(tmp_path_factory.mktemp("qwen_like"), QWEN_LIKE, THINKS)


@pytest.fixture(scope="module")
def special_tags(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _thinker(tmp_path_factory.mktemp("special"), QWEN_LIKE, THINKS, special_tags=True)


@pytest.fixture(scope="module")
def r1_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _thinker(tmp_path_factory.mktemp("r1_like"), R1_LIKE, "Seven it is.\n</think>\nDone.")


def _ask(server, stream: bool = False):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=120, stream=stream
    )
    if not stream:
        message = answer.choices[0].message
        return (message.model_extra or {}).get("reasoning_content"), message.content
    reasoning, content = "", ""
    for chunk in answer:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    return reasoning, content


def test_the_thinking_goes_out_as_reasoning_content(qwen_like: Path, r1_like: Path) -> None:
    with start_server(qwen_like, max_prompt_tokens=200) as server:
        whole = _ask(server)
        assert whole == ("\nThe user wants an alarm at 7.\n", "Sure, at 7.")
        assert _ask(server, stream=True) == whole
    with start_server(r1_like, max_prompt_tokens=200) as server:  # the prompt opened it
        whole = _ask(server)
        assert whole == ("Seven it is.\n", "Done.")
        assert _ask(server, stream=True) == whole
    with start_server(qwen_like, max_prompt_tokens=200, reasoning_parser="none") as server:
        assert _ask(server) == (None, THINKS)  # the control: all of it as content
        assert _ask(server, stream=True) == ("", THINKS)


@pytest.mark.parametrize("thinking", [False, True])
def test_the_streamed_router_equals_the_whole_split(thinking: bool) -> None:
    rng = random.Random(0)
    replies = [THINKS, "  <think>a</think>b", "<thi", "no thinking here", "<think>cut sh",
               "x</think>\n y", "", " ", "</think>", "a </thin", "<think></think>"]  # fmt: skip
    for reply in replies:
        whole = split_reasoning(reply, thinking)
        for _ in range(20):
            router, reasoning, answer, at = ReasoningStream(thinking), "", "", 0
            while at < len(reply):
                step = rng.randint(1, 4)
                r, a = router.feed(reply[at : at + step])
                reasoning, answer, at = reasoning + r, answer + a, at + step
            r, a = router.feed("", final=True)
            reasoning, answer = reasoning + r, answer + a
            assert (reasoning, answer) == (whole[0] or "", whole[1]), (reply, thinking)


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(qwen_like: Path) -> None:
    with start_server(qwen_like, max_prompt_tokens=200) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        ask = {"model": model, "input": MESSAGES[0]["content"], "temperature": 0,
               "max_output_tokens": 120}  # fmt: skip
        response = client.responses.create(**ask)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "\nThe user wants an alarm at 7.\n"
        assert response.output_text == "Sure, at 7."
        events = list(client.responses.create(**ask, stream=True))
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (thinking, answer) == (response.output[0].content[0].text, "Sure, at 7.")
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert [e.sequence_number for e in events] == list(range(len(events)))


def test_anthropics_messages_api_gives_the_thinking_as_a_thinking_block(qwen_like: Path) -> None:
    anthropic = pytest.importorskip("anthropic")
    with start_server(qwen_like, max_prompt_tokens=200) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        model = openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list()
        ask = {"model": model.data[0].id, "messages": MESSAGES, "max_tokens": 120,
               "extra_body": {"temperature": 0}}  # fmt: skip
        message = client.messages.create(**ask)
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "\nThe user wants an alarm at 7.\n"
        assert message.content[1].text == "Sure, at 7." and message.stop_reason == "end_turn"
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in final.content] == [("thinking", message.content[0].thinking),
                                            ("text", "Sure, at 7.")]  # fmt: skip


def test_thinking_tags_that_are_special_tokens_still_split_the_reply(special_tags: Path) -> None:
    """Where ``<think>`` and ``</think>`` are special tokens (decoding leaves them out),
    the reply's text keeps them, so the thinking is split as with text tags; the control
    (the parser off) gives the answer with the tags left out, as plain decoding does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(special_tags)
    assert len(tokenizer("<think>", add_special_tokens=False)["input_ids"]) == 1
    with start_server(special_tags, max_prompt_tokens=200) as server:
        whole = _ask(server)
        assert whole == ("\nThe user wants an alarm at 7.\n", "Sure, at 7.")
        assert _ask(server, stream=True) == whole
    with start_server(special_tags, max_prompt_tokens=200, reasoning_parser="none") as server:
        plain = THINKS.replace("<think>", "").replace("</think>", "")
        assert _ask(server) == (None, plain)
