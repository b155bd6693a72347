"""`speculative serve` on loopback, called with the real `openai` client.

A tiny native model (word-level tokenizer, a chat template) behind a live uvicorn server
on a free port. Greedy and seeded outputs must equal `speculative generate` for the same
settings (a single-sequence engine run: the batched server must not change a token);
stop strings are cut exactly however the text is chunked; a client that disconnects frees
its batch slot (seen in /metrics); bad input gets OpenAI-shaped 4xx errors.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from server_helpers import API_KEY, http, metric, start_server, tiny_chat_folder  # noqa: E402
from speculative.cli.main import main  # noqa: E402

PROMPT = "the cat sat on the mat"
PROMPTS = [PROMPT, "red blue red blue red"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny_server"))


@pytest.fixture(scope="module")
def server(folder: Path):
    with start_server(folder, api_key=API_KEY, max_prompt_tokens=64, max_body_bytes=16384) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def generate(folder: Path, *args: str) -> dict:
    """`speculative generate --json` for the tiny model (stdout's last line)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--target", str(folder), "--runtime", "native", "--json", *args])
    assert code == 0
    return json.loads(out.getvalue().splitlines()[-1])


def stream_text(stream) -> tuple[str, list, dict | None, str | None]:
    """(text, chunk texts, final speculative stats, finish_reason) of a streamed response."""
    parts, stats, reason = [], None, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text = choice.text if hasattr(choice, "text") else choice.delta.content
        if text:
            parts.append(text)
        if choice.finish_reason is not None:
            reason = choice.finish_reason
            stats = chunk.model_extra["speculative"]
    return "".join(parts), parts, stats, reason


def test_models_health_and_key(server, client: openai.OpenAI, model: str) -> None:
    assert http(server.url + "/health", key=None) == (200, {"status": "ok"})
    card = client.models.list().data[0]
    assert card.model_extra["speculative"]["drafters"] == ["ngram", "none"]
    for key in (None, "sk-wrong"):
        status, body = http(server.url + "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt=PROMPT, max_tokens=4)


def test_tokenize_counts_what_a_request_counts(server, client: openai.OpenAI, model: str) -> None:
    """/tokenize gives the tokens a completions prompt or a chat's messages count as
    (``usage.prompt_tokens``), /detokenize their text back; both check their input and
    the key."""
    url = server.url
    messages = [{"role": "user", "content": PROMPT}]
    status, chat = http(url + "/tokenize", "POST", {"model": model, "messages": messages})
    assert status == 200 and chat["count"] == len(chat["tokens"]) and chat["max_model_len"]
    asked = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert asked.usage.prompt_tokens == chat["count"]
    status, plain = http(url + "/tokenize", "POST", {"prompt": PROMPT})
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert status == 200 and done.usage.prompt_tokens == plain["count"]
    status, text = http(url + "/detokenize", "POST", {"tokens": plain["tokens"]})
    assert status == 200 and text["prompt"].strip() == PROMPT
    for path, body, param in [
        ("/tokenize", {"prompt": PROMPT, "messages": messages}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ]:
        status, error = http(url + path, "POST", body)
        assert status == 400 and error["error"]["param"] == param, (path, body, error)
    assert http(url + "/tokenize", "POST", {"prompt": PROMPT}, key=None)[0] == 401


def test_a_conversations_next_request_reports_its_cached_prompt(
    client: openai.OpenAI, model: str
) -> None:
    """A chat's next request (the conversation so far, then a new message) finds the
    previous request's prompt in its finished row's slot: ``cached_tokens`` counts it
    (all of it but the generation prompt, which the template writes as the assistant's
    role), and the reply is the one a cold cache gives (once more rows than the cache's
    slots have been decoded since)."""
    first = [{"role": "user", "content": "red blue big small red"}]
    asked = client.chat.completions.create(model=model, messages=first, max_tokens=6,
                                           temperature=0)  # fmt: skip
    reply = asked.choices[0].message.content
    later = [*first, {"role": "assistant", "content": reply},
             {"role": "user", "content": "and then"}]  # fmt: skip
    warm = client.chat.completions.create(model=model, messages=later, max_tokens=6,
                                          temperature=0)  # fmt: skip
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert asked.usage.prompt_tokens - 1 <= cached < warm.usage.prompt_tokens
    for word in ("the", "a", "cat", "dog", "mat"):  # 20 other rows, in the 16 cache slots
        filler = [{"role": "user", "content": f"{word} " * 40}]
        client.chat.completions.create(model=model, messages=filler, max_tokens=2, n=4)
    cold = client.chat.completions.create(model=model, messages=later, max_tokens=6,
                                          temperature=0)  # fmt: skip
    assert cold.usage.prompt_tokens_details.cached_tokens < cached
    assert cold.choices[0].message.content == warm.choices[0].message.content


def test_reset_prefix_cache_makes_the_next_request_cold(
    server, client: openai.OpenAI, model: str
) -> None:
    """vLLM's ``POST /reset_prefix_cache``: a request repeated right after finds its
    prompt cached (the metric counts it), and after the reset computes it again, with
    the same reply."""
    messages = [{"role": "user", "content": "big small big small red"}]

    def ask():
        return client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                              temperature=0)  # fmt: skip

    def cached_total() -> float:  # the metric of prompt tokens found cached, so far
        return metric(http(server.url + "/metrics")[1], "speculative_prompt_tokens_cached_total")

    first, before = ask(), cached_total()
    again = ask()
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert cached_total() - before == again.usage.prompt_tokens - 1
    assert http(server.url + "/reset_prefix_cache", "POST", {}, key=None)[0] == 401
    assert http(server.url + "/reset_prefix_cache", "POST", {}) == (200, {"reset": True})
    cold = ask()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == first.choices[0].message.content


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_greedy_completions_equal_generate(
    folder: Path, client: openai.OpenAI, model: str, draft: str
) -> None:
    for prompt in PROMPTS:
        expected = generate(folder, "--prompt", prompt, "--no-chat", "--max-new-tokens", "40")
        assert len(expected["token_ids"]) >= 15
        extra = {"speculative": {"draft": draft, "gamma": 3}}
        whole = client.completions.create(
            model=model, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra
        )
        assert whole.choices[0].text == expected["text"]
        reason = {"eos": "stop", "length": "length"}[expected["finish_reason"]]
        assert whole.choices[0].finish_reason == reason
        assert whole.usage.completion_tokens == len(expected["token_ids"])
        stats = whole.model_extra["speculative"]
        count = len(expected["token_ids"])
        assert stats["draft"] == draft and stats["completion_tokens"] == count
        if draft == "none":
            assert stats["drafted"] == 0 and stats["target_passes"] == count
        streamed = client.completions.create(
            model=model, prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body=extra,
        )  # fmt: skip
        text, parts, stats, streamed_reason = stream_text(streamed)
        assert text == expected["text"] and streamed_reason == reason and len(parts) > 1
        assert stats["completion_tokens"] == count


def test_greedy_chat_equals_generate(folder: Path, client: openai.OpenAI, model: str) -> None:
    for prompt in PROMPTS:
        expected = generate(folder, "--prompt", prompt, "--chat", "--max-new-tokens", "30")
        assert len(expected["token_ids"]) >= 15
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=30, temperature=0
        )
        assert whole.choices[0].message.content == expected["text"]
        assert whole.choices[0].message.role == "assistant"
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=30, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(streamed)
        assert chunks[0].choices[0].delta.role == "assistant"
        texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert all({"pieces", "alpha", "tau"} <= set(c.model_extra["speculative"]) for c in texts)
        count = len(expected["token_ids"])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
        text, _, stats, reason = stream_text(chunks)
        assert text == expected["text"]
        assert reason == {"eos": "stop", "length": "length"}[expected["finish_reason"]]
        assert 0 <= stats["alpha"] <= 1 and stats["tau"] >= 1


def test_load_aware_gamma_is_lossless(folder: Path) -> None:
    """--gamma auto: each round's γ is chosen for the load; the text does not change."""
    expected = generate(folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "40")
    with start_server(folder, gamma="auto") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        card = client.models.list().data[0]
        assert card.model_extra["speculative"]["gamma_policy"] == "load-aware"
        whole = client.completions.create(
            model=card.id, prompt=PROMPT, max_tokens=40, temperature=0
        )
        assert whole.choices[0].text == expected["text"]


def _record_model_threads(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The threads every native model forward (targets and draft models alike) runs on."""
    import threading

    from speculative.models.native.model import NativeLlama

    seen: set[int] = set()
    for name in ("forward", "forward_rows"):
        original = getattr(NativeLlama, name)

        def recorded(self, *args, _original=original, **kwargs):
            seen.add(threading.get_ident())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(NativeLlama, name, recorded)
    return seen


def test_a_loaded_server_does_all_model_work_on_one_thread(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_state loads, calibrates (γ auto), builds drafters and decodes on one compute
    thread: torch and the kernels share libgomp, which keeps a worker pool per thread that
    starts parallel work, and two pools on 2 cores made decoding 3.5x slower. Control: a
    state built on this thread (the scheduler then decodes on its own) is caught."""
    from speculative.server import ServerConfig, create_app, load_state
    from speculative.server.background import serve_in_background
    from speculative.server.state import build_state
    from speculative.targets import load_target

    config = ServerConfig(target=str(folder), drafts=("self-int4", "none"), gamma="auto")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    seen = _record_model_threads(monkeypatch)
    state = load_state(config)
    costs = state.pass_costs  # the load-aware policy's: one row's tokens and rows of one
    assert costs is not None and sorted(costs.rows) == list(range(1, config.max_batch + 1))
    assert max(costs.tokens) == 64 and costs.tokens[1] == costs.rows[1] == 1.0  # 8 rows × 9
    with serve_in_background(create_app(state)) as server:
        body["model"] = state.model_id
        assert http(server.url + "/v1/completions", "POST", body, key=None)[0] == 200
    assert seen == {state.compute.ident}
    seen.clear()
    control = build_state(config, load_target(str(folder), "native"))
    with serve_in_background(create_app(control)) as server:
        assert http(server.url + "/v1/completions", "POST", body, key=None)[0] == 200
    assert len(seen) == 2


def test_draft_model_instances_are_reused_not_reloaded(folder: Path) -> None:
    """A model drafter (the target at int4) is built once per concurrent row and reused by
    later requests; its output is still the target's greedy text."""
    expected = generate(folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "30")
    with start_server(folder, drafts=("self-int4", "ngram")) as server:
        pool = server.server.config.app.state.server.pools["self-int4"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for _ in range(3):
            whole = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=30, temperature=0
            )
            assert whole.choices[0].text == expected["text"]
            assert whole.model_extra["speculative"]["draft"] == "self-int4"
            assert whole.model_extra["speculative"]["drafted"] > 0
        assert pool.built == 1  # warmed at startup, then reused by all three requests


def test_seeded_sampling_is_reproducible(folder: Path, client: openai.OpenAI, model: str) -> None:
    settings = ["--no-chat", "--max-new-tokens", "30", "--temperature", "0.9", "--top-p", "0.95"]
    texts = {}
    for seed in (5, 6):
        expected = generate(folder, "--prompt", PROMPT, *settings, "--seed", str(seed))
        runs = [
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95, seed=seed,
                extra_body={"speculative": {"draft": draft}},
            ).choices[0].text
            for draft in ("ngram", "ngram", "none")
        ]  # fmt: skip
        # the same seed: the same sample, and the very sample of the single-sequence engine
        assert runs[0] == runs[1] == expected["text"]
        texts[seed] = runs[0]
    assert texts[5] != texts[6]  # control: the seed matters


def test_top_k_and_min_p_restrict_sampling(folder: Path, client: openai.OpenAI, model: str) -> None:
    """top_k = 1 keeps only the argmax, so any seed samples the greedy text; a min_p
    sample is `speculative generate --min-p`'s for that seed and drafter; without the cuts
    the same seeds sample other text (the controls)."""
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)

    def sample(seed: int, draft: str, **cut: float) -> str:
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=20, temperature=1.5, seed=seed,
            extra_body={**cut, "speculative": {"draft": draft}},
        ).choices[0].text  # fmt: skip

    uncut_differs = []
    for seed in (1, 2, 3):
        assert sample(seed, "ngram", top_k=1) == greedy.choices[0].text
        for draft in ("ngram", "none"):  # a seeded sample is the same drafter's
            expected = generate(
                folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "20",
                "--draft", draft, "--gamma", "4", "--temperature", "1.5", "--min-p", "0.3",
                "--seed", str(seed),
            )["text"]  # fmt: skip
            assert sample(seed, draft, min_p=0.3) == expected
        uncut = sample(seed, "none")
        uncut_differs += [uncut != greedy.choices[0].text, uncut != expected]
    assert all(uncut_differs[::2]) and any(uncut_differs[1::2])


def _chat_logprobs(client: openai.OpenAI, model: str, draft: str, stream: bool, **kw) -> list:
    """The chat response's per-token log-probability entries (a stream's, concatenated)."""
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=3, stream=stream,
        extra_body={"speculative": {"draft": draft}}, **kw,
    )  # fmt: skip
    if not stream:
        return [entry.model_dump() for entry in answer.choices[0].logprobs.content]
    entries = []
    for chunk in answer:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += [entry.model_dump() for entry in chunk.choices[0].logprobs.content]
    return entries


def test_logprobs_are_the_targets_whatever_the_drafter(client: openai.OpenAI, model: str) -> None:
    """Every greedy token comes with its log-probability, its likeliest alternatives first
    (the token itself, greedy); speculation does not change them (the target's logits are
    those of plain decoding, bit for bit) and a stream carries the same entries."""
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, extra_body={"speculative": {"draft": "none"}},
    )  # fmt: skip
    assert plain.choices[0].logprobs is None  # not asked for
    entries = _chat_logprobs(client, model, "none", stream=False)
    assert len(entries) == plain.usage.completion_tokens
    assert "".join(e["token"] for e in entries) == plain.choices[0].message.content
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert top[0]["logprob"] == entry["logprob"] <= 0.0
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]
    assert _chat_logprobs(client, model, "ngram", stream=False) == entries
    assert _chat_logprobs(client, model, "ngram", stream=True) == entries
    # a stop string: the tokens that start before it, streamed or not
    stop = plain.choices[0].message.content[10:14]
    cut = _chat_logprobs(client, model, "ngram", stream=False, stop=[stop])
    assert 0 < len(cut) < len(entries) and cut == entries[: len(cut)]
    assert _chat_logprobs(client, model, "ngram", stream=True, stop=[stop]) == cut


def test_completion_logprobs_give_tokens_and_offsets(client: openai.OpenAI, model: str) -> None:
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3, logprobs=2,
        extra_body={"speculative": {"draft": "ngram"}},
    )  # fmt: skip
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == answer.usage.completion_tokens == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == choice.text
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(choice.text[o:].startswith(t) for o, t in zip(offsets, logprobs.tokens, strict=True))
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 2 and token_logprob <= max(top.values()) <= 0.0


def _streamed_completion(stream) -> tuple[str, dict[str, list]]:
    """A streamed completion's text and its log-probabilities' lists, chunks joined."""
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in stream:
        if not chunk.choices:
            continue
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                lists[key] += values
    return text, lists


def test_echo_scores_the_prompt(folder: Path, client: openai.OpenAI, model: str) -> None:
    """``echo`` with ``logprobs`` returns the prompt's tokens before the completion's: the
    first with null log-probabilities, the others the target's after the tokens before
    them (what ``speculative generate --prompt-logprobs`` gives), then the completion's
    own, as the same request without echo gets them; offsets run over the echoed text.
    ``max_tokens`` 0 scores the prompt alone (how evaluation harnesses ask for a text's
    likelihood); a stream carries the same."""
    expected = generate(
        folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "0", "--draft", "none",
        "--prompt-logprobs", "2",
    )["prompt_logprobs"]  # fmt: skip
    scored = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0,
    )  # fmt: skip
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lists = choice.logprobs
    assert "".join(lists.tokens) == PROMPT
    assert lists.token_logprobs[0] is None and lists.top_logprobs[0] is None
    assert len(lists.token_logprobs) == len(expected) + 1 == scored.usage.prompt_tokens
    for got, want, top in zip(lists.token_logprobs[1:], expected, lists.top_logprobs[1:],
                              strict=True):  # fmt: skip
        assert abs(got - want["logprob"]) < 1e-5
        assert sorted(top.values(), reverse=True) == pytest.approx(
            [value for _, value in want["top"]], abs=1e-5
        )

    plain = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
        extra_body={"speculative": {"draft": "ngram"}},
    ).choices[0]  # fmt: skip
    echoed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, echo=True,
        extra_body={"speculative": {"draft": "ngram"}},
    ).choices[0]  # fmt: skip
    assert echoed.text == PROMPT + plain.text
    both = echoed.logprobs
    prompt_tokens = len(lists.tokens)
    assert both.tokens == lists.tokens + plain.logprobs.tokens
    assert both.token_logprobs[prompt_tokens:] == plain.logprobs.token_logprobs
    assert both.token_logprobs[:prompt_tokens] == lists.token_logprobs
    assert both.text_offset[prompt_tokens:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    assert all(
        echoed.text[o:].startswith(t) for o, t in zip(both.text_offset, both.tokens, strict=True)
    )
    text, streamed = _streamed_completion(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, echo=True,
        stream=True, extra_body={"speculative": {"draft": "ngram"}},
    ))  # fmt: skip
    assert text == echoed.text and streamed == both.model_dump()
    quiet = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True)
    assert quiet.choices[0].text == PROMPT and quiet.choices[0].logprobs is None


def test_several_prompts_and_token_ids_in_one_request(client: openai.OpenAI, model: str) -> None:
    """A list of prompts gets n choices each, prompt p's choice j at index p × n + j and
    the sample a request with that prompt alone and seed + j gets; a prompt given as
    token ids is answered as its text is; usage counts every prompt."""
    from tiny import tiny_tokenizer

    def texts(prompt, n: int = 1, seed: int = 5) -> list[str]:
        answer = client.completions.create(
            model=model, prompt=prompt, n=n, max_tokens=8, temperature=0.9, seed=seed,
            extra_body={"speculative": {"draft": "ngram"}},
        )  # fmt: skip
        assert [c.index for c in answer.choices] == list(range(len(answer.choices)))
        return [choice.text for choice in answer.choices]

    together = texts(PROMPTS, n=2)
    alone = [texts(prompt, seed=5 + j)[0] for prompt in PROMPTS for j in range(2)]
    assert together == alone and len(set(together)) > 1
    ids = [tiny_tokenizer()(prompt)["input_ids"] for prompt in PROMPTS]
    assert texts(ids[0]) == texts(PROMPTS[0]) and texts(ids, n=2) == together
    usage = client.completions.create(model=model, prompt=ids, max_tokens=2).usage
    assert usage.prompt_tokens == sum(len(i) for i in ids)


def test_lm_eval_loglikelihood_requests(client: openai.OpenAI, model: str) -> None:
    """lm-evaluation-harness's loglikelihood request (token-id prompts in a batch,
    ``echo``, ``max_tokens`` 1, ``logprobs`` 1, temperature 0), read as the harness reads
    it: each continuation's log-likelihood is the sum of ``token_logprobs[ctxlen:-1]``,
    the prompt-only scoring's sum, and "greedy" (each value its position's best) exactly
    where each token's text is its position's likeliest alternative."""
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    context = tokenizer("the cat sat on the")["input_ids"]
    continuations = [tokenizer(w)["input_ids"] for w in ("mat", "red blue")]
    prompts = [context + c for c in continuations]
    body = {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    answer = client.completions.create(**body)
    scored = client.completions.create(**{**body, "max_tokens": 0})
    for choice, whole, tokens in zip(answer.choices, scored.choices, prompts, strict=True):
        lists = choice.logprobs
        assert len(lists.token_logprobs) == len(tokens) + 1  # the prompt, then one token
        assert lists.token_logprobs[:-1] == whole.logprobs.token_logprobs
        likelihood = sum(lists.token_logprobs[len(context) : -1])
        expected = sum(whole.logprobs.token_logprobs[len(context) :])
        assert likelihood == expected < 0
        span = slice(len(context), -1)
        greedy = all(  # as the harness decides it, from the values
            lp == max(top.values())
            for lp, top in zip(lists.token_logprobs[span], lists.top_logprobs[span], strict=True)
        )
        likeliest = all(  # from the texts: each token is its position's likeliest
            token == max(top, key=top.get)
            for token, top in zip(lists.tokens[span], lists.top_logprobs[span], strict=True)
        )
        assert greedy == likeliest


def test_best_of_returns_the_likeliest_samples(client: openai.OpenAI, model: str) -> None:
    """``best_of`` 4 with ``n`` 2: the two of the four samples (seed + 0..3, each what a
    request with that seed gets alone) with the highest mean log-probability per token,
    likeliest first, without log-probabilities unless asked; usage counts all four."""

    def sample(seed: int, **kw):
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"speculative": {"draft": "ngram"}}, **kw,
        )  # fmt: skip

    alone = [sample(11 + j, logprobs=0) for j in range(4)]
    means = [
        sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
        for c in (a.choices[0] for a in alone)
    ]
    order = sorted(range(4), key=lambda j: means[j], reverse=True)[:2]
    assert order != [0, 1]  # the ranking picks other samples than the first two
    answer = sample(11, n=2, best_of=4)
    assert [c.text for c in answer.choices] == [alone[j].choices[0].text for j in order]
    assert all(c.logprobs is None for c in answer.choices)
    assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_penalties_are_served_exactly(folder: Path, client: openai.OpenAI, model: str) -> None:
    """Penalized greedy text is `speculative generate`'s with the same penalties, with any
    drafter; the penalties change it (the control)."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}
    expected = generate(
        folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "24", "--draft", "none",
        "--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--repetition-penalty", "1.3",
    )["text"]  # fmt: skip
    texts = {
        (draft, penalized): client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"speculative": {"draft": draft}, **(penalties if penalized else {})},
        ).choices[0].text
        for draft in ("ngram", "none")
        for penalized in (True, False)
    }  # fmt: skip
    assert texts[("ngram", True)] == texts[("none", True)] == expected
    assert texts[("none", False)] != expected


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, model: str) -> None:
    """+100 on a token makes greedy decoding emit only it; -100 on plain decoding's first
    token makes it emit another first; the same with a drafter."""
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()

    def texts(draft: str, bias: dict[str, float]) -> list[str]:
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
            extra_body={"speculative": {"draft": draft}, "logit_bias": bias},
        )  # fmt: skip
        return [text.strip() for text in answer.choices[0].logprobs.tokens]

    forced = tokenizer.decode([7]).strip()
    assert texts("ngram", {"7": 100}) == texts("none", {"7": 100}) == [forced] * 6
    plain = texts("none", {})
    first = tokenizer.convert_tokens_to_ids(plain[0])
    banned = texts("ngram", {str(first): -100})
    assert banned[0] != plain[0] and banned == texts("none", {str(first): -100})


def test_n_choices_are_rows_decoded_together(client: openai.OpenAI, model: str) -> None:
    """n choices: choice i is the sample a request with seed + i gets alone, whole or
    streamed (chunks carry their choice's index); greedy choices are all the greedy text;
    usage counts every choice's tokens."""
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9}
    singles = [client.completions.create(**kw, seed=7 + i) for i in range(3)]
    alone = [single.choices[0].text for single in singles]
    assert len(set(alone)) > 1  # control: the seeds give different samples
    whole = client.completions.create(**kw, seed=7, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == alone
    assert whole.usage.completion_tokens == sum(x.usage.completion_tokens for x in singles)
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.completions.create(**kw, seed=7, n=3, stream=True):
        for choice in chunk.choices:
            parts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert [parts[i] for i in range(3)] == alone and finished == {0, 1, 2}
    greedy = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0, n=2, extra_body={"speculative": {"draft": "ngram"}},
    )  # fmt: skip
    texts = [c.message.content for c in greedy.choices]
    assert texts[0] == texts[1] and greedy.model_extra["speculative"]["completion_tokens"] == 16


def test_stop_strings_cut_exactly_across_chunks(
    folder: Path, client: openai.OpenAI, model: str
) -> None:
    full = generate(folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "40")["text"]
    words = full.split(" ")
    stop = f"{words[5][1:]} {words[6]} {words[7][:2]}"  # spans three tokens, mid-word
    expected = full[: full.find(stop)]
    assert len(expected) > 10 and stop not in expected
    reference = generate(
        folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "40", "--stop", stop
    )
    assert reference["text"] == expected
    for draft in ("none", "ngram"):
        extra = {"speculative": {"draft": draft}}
        whole = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzz"],
            extra_body=extra,
        )  # fmt: skip
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
        streamed = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True,
            extra_body=extra,
        )  # fmt: skip
        text, parts, _, reason = stream_text(streamed)
        assert text == expected and reason == "stop"
        assert len(parts) >= 5  # many chunks: the cut lands inside the streamed text


def test_disconnect_frees_the_slot(server, client: openai.OpenAI, model: str) -> None:
    def scrape() -> str:
        return http(server.url + "/metrics")[1]

    before = metric(scrape(), "speculative_requests_total", 'endpoint="chat",status="cancelled"')
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    busy = scrape()
    assert metric(busy, "speculative_requests_running") == 1
    assert metric(busy, "speculative_free_cache_slots") == 3
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = scrape()
        if metric(text, "speculative_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(text, "speculative_requests_running") == 0
    assert metric(text, "speculative_free_cache_slots") == 4
    cancelled = metric(text, "speculative_requests_total", 'endpoint="chat",status="cancelled"')
    assert cancelled == before + 1  # it left as cancelled, not by finishing its 2000 tokens


def test_disconnect_without_streaming_frees_the_slot(server, model: str) -> None:
    import socket
    from urllib.parse import urlsplit

    def scrape() -> str:
        return http(server.url + "/metrics")[1]

    label = 'endpoint="completions",status="cancelled"'
    before = metric(scrape(), "speculative_requests_total", label)
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    ).encode()
    parts = urlsplit(server.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while metric(scrape(), "speculative_requests_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while metric(text := scrape(), "speculative_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(text, "speculative_requests_total", label) == before + 1
    assert metric(text, "speculative_free_cache_slots") == 4


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "MODEL"}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "MODEL"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "max_tokens": -5}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "temperature": -0.1},
        400,
        "temperature",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "temperature": 2.5},
        400,
        "temperature",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": [PROMPT, PROMPT], "n": 9}, 400, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "n": 3, "best_of": 2}, 400, "best_of"),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "best_of": 2, "stream": True},
        400,
        "best_of",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": [PROMPT] * 2, "best_of": 9}, 400, "best_of"),
    ("/v1/completions", {"model": "MODEL", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [3, 999999]}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [3, -1]}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": "the " * 100}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x" * 20000}, 413, None),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "stop": ["a"] * 5}, 400, "stop"),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "stop": [""]}, 400, "stop"),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "speculative": {"draft": "/etc/passwd"}},
        400,
        "speculative.draft",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "speculative": {"gamma": 0}},
        400,
        "speculative.gamma",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "x"}]},
        400,
        "messages.0.role",
    ),
    # options this server does not implement are refused by name, not ignored
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "logprobs": 6}, 400, "logprobs"),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "logit_bias": {"the": 10}},
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "logit_bias": {"999999": 10}},
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": "MODEL", "prompt": PROMPT, "logit_bias": {"5": 101}},
        400,
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "MODEL",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
        },
        400,
        "response_format",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": PROMPT, "top_k": -2}, 400, "top_k"),
]

# what clients send by default for those options: served as if left out
OPTIONS_OFF = {
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "logprobs": False,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "best_of": 1,
}


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(
    server, client: openai.OpenAI, model: str
) -> None:
    for path, body, status, param in BAD_INPUTS:
        if isinstance(body, dict):
            body = json.loads(json.dumps(body).replace("MODEL", model))
        got, answer = http(server.url + path, "POST", body)
        assert got == status, (path, body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)
        # the server still serves after each
        ok = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2
    chat = [{"role": "user", "content": "hi"}]
    served = client.chat.completions.create(
        model=model, messages=chat, max_tokens=3, temperature=0, extra_body=OPTIONS_OFF
    )
    alone = client.chat.completions.create(model=model, messages=chat, max_tokens=3, temperature=0)
    assert served.choices[0].message.content == alone.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 16"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=17)


def test_metrics_cover_the_issue_list(server, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    status, text = http(server.url + "/metrics")
    assert status == 200
    for name in (
        "speculative_requests_total", "speculative_prompt_tokens_total",
        "speculative_completion_tokens_total", "speculative_drafted_tokens_total",
        "speculative_accepted_tokens_total", "speculative_recovered_tokens_total",
        "speculative_bonus_tokens_total", "speculative_requests_running",
        "speculative_requests_waiting", "speculative_batch_size",
        "speculative_free_cache_slots", "speculative_time_to_first_token_seconds_bucket",
        "speculative_time_per_output_token_seconds_bucket",
        "speculative_e2e_request_latency_seconds_bucket",
        "speculative_tokens_per_target_pass_bucket", "speculative_acceptance_rate",
        'speculative_position_acceptance_rate{position="1"}',
    ):  # fmt: skip
        assert f"\n{name}" in text, name
    drafted = metric(text, "speculative_drafted_tokens_total")
    accepted = metric(text, "speculative_accepted_tokens_total")
    assert drafted > 0 and metric(text, "speculative_acceptance_rate") == pytest.approx(
        accepted / drafted
    )
    assert http(server.url + "/metrics", key=None)[0] == 401


def test_transformers_runtime_serves_batched_rows(folder: Path) -> None:
    """`serve --runtime hf`: rows padded into one transformers pass; greedy text equals
    `generate --runtime hf` alone, with requests in flight together."""
    from concurrent.futures import ThreadPoolExecutor

    expected = []
    for prompt in PROMPTS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            args = ["generate", "--target", str(folder), "--runtime", "hf", "--json"]
            assert main([*args, "--prompt", prompt, "--no-chat", "--max-new-tokens", "24"]) == 0
        expected.append(json.loads(out.getvalue().splitlines()[-1])["text"])
    with start_server(folder, runtime="hf") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: str) -> str:
            answer = client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0
            )
            return answer.choices[0].text

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected


def test_heads_draft_per_row_and_stay_exact(folder: Path) -> None:
    """An EAGLE head served (each row reading its own features from the shared pass):
    greedy text and the drafts themselves equal `generate --draft eagle:DIR` alone, with
    two requests in flight together."""
    from concurrent.futures import ThreadPoolExecutor

    from speculative.exactness.tiny import save_random_heads

    if not (folder / "eagle" / "config.json").is_file():  # heads next to the model
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        save_random_heads(folder, seed=0, vocab=vocab)
    draft = f"eagle:{folder / 'eagle'}"
    expected = [
        generate(folder, "--prompt", p, "--no-chat", "--max-new-tokens", "30", "--draft", draft)
        for p in PROMPTS
    ]
    with start_server(folder, drafts=(draft,)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: str):
            return client.completions.create(
                model=model, prompt=prompt, max_tokens=30, temperature=0
            )

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(complete, PROMPTS))
    for answer, alone in zip(answers, expected, strict=True):
        assert answer.choices[0].text == alone["text"]
        stats = answer.model_extra["speculative"]
        assert stats["drafted"] == alone["stats"]["drafted_tokens"] > 0
        assert stats["accepted"] == alone["stats"]["accepted_tokens"]


def test_serve_command_refuses_bad_setups(capsys: pytest.CaptureFixture) -> None:
    from speculative.cli.serve_cmd import is_loopback

    for args, reason in (
        (["--gamma", "heuristic"], "single-stream schedule"),
        (["--max-batch", "0"], "must be >= 1"),
        (["--port", "99999"], "a port is 0..65535"),
    ):  # refused before loading anything, with the reason
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", *args])
        assert exit_info.value.code == 2 and reason in capsys.readouterr().err
    with socket.socket() as taken:  # a port in use fails before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", "/no/such/model", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "loading" not in err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_greedy_equals_generate() -> None:
    """The default model: chat and completion, streamed and whole, equal what `generate`
    prints (its Speculator, on the same loaded model: loaded once); the streamed text
    (byte-level BPE, non-ASCII) arrives without broken characters."""
    from speculative.drafters.registry import build_drafter
    from speculative.models.loading import resolve_model
    from speculative.pipeline import Speculator
    from speculative.server import ServerConfig, create_app
    from speculative.server.background import serve_in_background
    from speculative.server.state import build_state
    from speculative.targets import load_target

    try:
        resolve_model("default")
    except Exception as exc:
        pytest.skip(f"the default model is not available: {exc}")
    prompt = "Write three short sentences in French about café, crème brûlée and naïveté."
    loaded = load_target("default")
    speculator = Speculator(loaded, build_drafter("ngram", loaded), gamma=4)
    chat = speculator.generate(prompt, chat=True, max_new_tokens=40)
    raw_prompt = "A list of French desserts: crème brûlée, tarte Tatin,"
    raw = speculator.generate(raw_prompt, chat=False, max_new_tokens=40)
    assert len(chat.token_ids) >= 20 and len(raw.token_ids) >= 20
    state = build_state(ServerConfig(drafts=("ngram", "none"), max_batch=4), loaded)
    with serve_in_background(create_app(state)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = state.model_id
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, temperature=0
        )
        assert whole.choices[0].message.content == chat.text
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, temperature=0, stream=True
        )
        text, parts, stats, _ = stream_text(streamed)
        assert text == chat.text and all("\ufffd" not in p for p in parts)
        assert stats["tau"] >= 1
        plain = client.completions.create(
            model=model, prompt=raw_prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={"speculative": {"draft": "none"}},
        )  # fmt: skip
        assert stream_text(plain)[0] == raw.text
    assert any(ord(c) > 127 for c in chat.text + raw.text)  # the check saw non-ASCII


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(
    client: openai.OpenAI, model: str
) -> None:
    """vLLM's ``stop_reason``: the stop string (as given) or ``stop_token_ids`` token that
    ended a choice, whole and streamed, completions and chat; None at the budget and at
    the model's end of sequence, even where that token is a stop token too."""
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()

    def ask(stream: bool = False, chat: bool = False, **extra) -> tuple[str | None, object]:
        common = {"model": model, "max_tokens": 16, "temperature": 0, "stream": stream,
                  "extra_body": extra}  # fmt: skip
        if chat:
            messages = [{"role": "user", "content": PROMPT}]
            answer = client.chat.completions.create(messages=messages, **common)
        else:
            answer = client.completions.create(prompt=PROMPT, **common)
        chunks = list(answer) if stream else [answer]
        last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        return last.finish_reason, last.model_extra["stop_reason"]

    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    ids = tokenizer(whole.choices[0].text, add_special_tokens=False)["input_ids"]
    word = tokenizer.decode(ids[2:3])
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
        temperature=0, extra_body={"ignore_eos": True},
    ).choices[0].message.content  # fmt: skip
    said = reply.split()[1]
    assert ask(ignore_eos=True) == ("length", None)
    for stream in (False, True):
        assert ask(stream, stop=["zzz", word], ignore_eos=True) == ("stop", word)
        assert ask(stream, stop_token_ids=[ids[2]], ignore_eos=True) == ("stop", ids[2])
        assert ask(stream, chat=True, stop=[said], ignore_eos=True) == ("stop", said)
    end = {"1": 100}  # the model's end of sequence at once
    assert ask(logit_bias=end) == ("stop", None)
    assert ask(logit_bias=end, stop_token_ids=[1]) == ("stop", None)
    assert ask(logit_bias=end, stop_token_ids=[1], ignore_eos=True) == ("stop", 1)


def test_stop_tokens_min_tokens_and_kept_stops(
    folder: Path, client: openai.OpenAI, model: str
) -> None:
    """vLLM's ``stop_token_ids`` end the output at a token (its text left out, or kept with
    ``include_stop_str_in_output``, which keeps a stop string too), streamed and whole;
    ``min_tokens`` holds end-of-sequence back (a +100 bias on it ends the output at once
    without; with, the output is min_tokens + 1 long, with a drafter or none, greedy or
    sampled) and lets no stop string end inside those tokens; refusals name their field."""
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    plain = generate(folder, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "16",
                     "--draft", "none")  # fmt: skip
    ids = plain["token_ids"]
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i] > 1)
    word = decode([ids[k]])

    def ask(stream: bool = False, **extra):
        speculative = {"draft": extra.pop("draft", "ngram")}
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=16, temperature=extra.pop("temperature", 0),
            stream=stream, seed=1, extra_body={"speculative": speculative, **extra},
        )  # fmt: skip
        if stream:
            text, _, _, reason = stream_text(answer)
            return text, reason, None
        choice = answer.choices[0]
        return choice.text, choice.finish_reason, answer.usage.completion_tokens

    assert ask()[0] == plain["text"]
    cut = ask(stop_token_ids=[ids[k]])
    assert cut == (decode(ids[:k]), "stop", k + 1)
    kept = ask(stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    assert kept == (decode(ids[: k + 1]), "stop", k + 1)
    assert ask(True, stop_token_ids=[ids[k]])[:2] == cut[:2]
    assert ask(True, stop_token_ids=[ids[k]], include_stop_str_in_output=True)[:2] == kept[:2]
    at = plain["text"].index(word)
    assert ask(stop=[word])[0] == plain["text"][:at]  # the control: the stop string left out
    # with min_tokens past token k, the stop string that token k made does not count
    quiet = len(decode(ids[: k + 1]))  # the first min_tokens - 1 tokens' text
    later = plain["text"].find(word, quiet - len(word) + 1)
    expected = plain["text"] if later < 0 else plain["text"][:later]
    for stream in (False, True):
        assert ask(stream, stop=[word], min_tokens=k + 2)[0] == expected
    with_stop = plain["text"][: at + len(word)]
    assert ask(stop=[word], include_stop_str_in_output=True)[0] == with_stop
    assert ask(True, stop=[word], include_stop_str_in_output=True)[0] == with_stop
    eos = {"1": 100}
    for draft in ("ngram", "none"):
        for temperature in (0, 1.0):
            settings = {"draft": draft, "temperature": temperature, "logit_bias": eos}
            assert ask(**settings)[1:] == ("stop", 1)  # end-of-sequence at once
            assert ask(**settings, min_tokens=5)[1:] == ("stop", 6)
    for bad, param in (({"min_tokens": 17}, "min_tokens"),
                       ({"stop_token_ids": [10**6]}, "stop_token_ids")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            ask(**bad)
        assert refused.value.body["param"] == param


def test_an_assistant_message_continued_and_template_variables(
    server, client: openai.OpenAI, model: str
) -> None:
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``) renders
    the conversation up to the end of the assistant's begun text, and the reply continues
    it: the same text as a completion of those prompt tokens; ``chat_template_kwargs``
    reach the template (a variable that changes it), a reserved name is refused."""
    from speculative.targets import TemplateOptions, encode_prompt
    from tiny import tiny_tokenizer

    url = server.url
    begun = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "a dog"}]
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    status, opened = http(url + "/tokenize", "POST", {"model": model, "messages": begun})
    status, continued = http(url + "/tokenize", "POST", {"messages": begun, **prefill})
    assert status == 200
    tokenizer = tiny_tokenizer()
    assert tokenizer.decode(continued["tokens"]).endswith("a dog")  # (roles are <unk> here)
    assert tokenizer.decode(opened["tokens"]).endswith("a dog then")  # the control
    reply = client.chat.completions.create(
        model=model, messages=begun, max_tokens=8, temperature=0, extra_body=prefill
    )
    same = client.completions.create(
        model=model, prompt=continued["tokens"], max_tokens=8, temperature=0
    )
    assert reply.usage.prompt_tokens == continued["count"]
    assert reply.choices[0].message.content == same.choices[0].text
    echoed = client.chat.completions.create(  # vLLM's echo: the prefill comes back too
        model=model, messages=begun, max_tokens=8, temperature=0,
        extra_body={**prefill, "echo": True},
    )  # fmt: skip
    assert echoed.choices[0].message.content == "a dog" + same.choices[0].text
    streamed = client.chat.completions.create(
        model=model, messages=begun, max_tokens=8, temperature=0, stream=True,
        extra_body={**prefill, "echo": True},
    )  # fmt: skip
    assert stream_text(streamed)[0] == echoed.choices[0].message.content
    alone = client.chat.completions.create(  # the last message the user's: nothing echoed
        model=model, messages=begun[:1], max_tokens=8, temperature=0, extra_body={"echo": True}
    )
    plain = client.chat.completions.create(model=model, messages=begun[:1], max_tokens=8,
                                           temperature=0)  # fmt: skip
    assert alone.choices[0].message.content == plain.choices[0].message.content
    for bad, param in [
        ({"continue_final_message": True}, "continue_final_message"),  # generation prompt on
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=begun, extra_body=bad)
        assert refused.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:  # the last message is the user's
        client.chat.completions.create(model=model, messages=begun[:1], extra_body=prefill)
    assert refused.value.body["param"] == "messages"
    shouting = tiny_tokenizer()
    shouting.chat_template = "{% if shout %}red {% endif %}{{ messages[0]['content'] }}"
    options = TemplateOptions(variables=(("shout", True),))
    assert tokenizer.decode(encode_prompt(shouting, PROMPT, template=options)).startswith("red")
    assert not tokenizer.decode(encode_prompt(shouting, PROMPT)).startswith("red")
