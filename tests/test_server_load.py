"""A bounded load test: 32 concurrent streams, 200 requests, zero errors (tiny model).

Prints p50/p99 time to first token, tokens/s per stream and aggregate throughput (figures
of this machine and its load, for the log; the assertions are on correctness: no errors,
every request's full token count, every slot free afterwards).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_helpers import CONTINUING_TEMPLATE, http, metric, start_server, tiny_chat_folder
from speculative.bench.serve_load import (
    LoadSpec,
    model_id,
    percentile,
    reset_prefix_cache,
    run_load,
)

PROMPTS = [
    {"prompt": "the cat sat on the mat"},
    {"messages": [{"role": "user", "content": "red blue red blue red"}]},
    {"prompt": "a dog ran on the rug and then it sat"},
]


def test_percentile() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) == 0.0


def test_32_streams_200_requests_no_errors(tmp_path: Path) -> None:
    folder = tiny_chat_folder(tmp_path / "tiny")
    with start_server(folder, max_batch=8) as server:
        spec = LoadSpec(model_id(server.url), concurrency=32, requests=200, max_tokens=16)
        result = run_load(server.url, spec, PROMPTS)
        summary = result.summary()
        print("\nload test (tiny model, max_batch 8):", json.dumps(summary, indent=1))
        assert result.errors == []
        assert summary["requests"] == 200
        assert all(t.tokens == 16 for t in result.timings)  # ignore_eos: every token came
        assert summary["ttft_p99_s"] >= summary["ttft_p50_s"] > 0
        text = http(server.url + "/metrics", key=None)[1]
        assert metric(text, "speculative_requests_total", 'endpoint="chat",status="200"') == 200
        assert metric(text, "speculative_requests_running") == 0
        assert metric(text, "speculative_free_cache_slots") == 8
        assert metric(text, "speculative_batch_size") <= 8


@pytest.mark.parametrize("level", [1])
def test_plain_and_speculative_runs_report(tmp_path: Path, level: int) -> None:
    folder = tiny_chat_folder(tmp_path / "tiny")
    with start_server(folder) as server:
        model = model_id(server.url)
        for draft in ("ngram", "none"):
            spec = LoadSpec(model, concurrency=level, requests=3, max_tokens=8, draft=draft)
            summary = run_load(server.url, spec, PROMPTS).summary()
            assert summary["errors"] == 0 and summary["completion_tokens"] == 24
            assert summary["draft"] == draft


def test_conversations_send_each_reply_back_and_find_it_cached(tmp_path: Path) -> None:
    """``turns``: each thread's conversations continue with the server's replies; the later
    turns find most of their prompt (the earlier turns and replies) in the server's cache
    and report it; completions cannot hold a conversation."""
    folder = tiny_chat_folder(tmp_path / "tiny", CONTINUING_TEMPLATE)
    with start_server(folder) as server:
        words_only = {"logit_bias": {"0": -100, "1": -100}}  # (replies re-tokenize as made)
        spec = LoadSpec(model_id(server.url), concurrency=2, requests=7, max_tokens=8, turns=3,
                        extra=words_only)  # fmt: skip
        result = run_load(server.url, spec, PROMPTS)
        summary = result.summary()
        again = run_load(server.url, spec, PROMPTS)  # finds the last run's prompts ...
        assert reset_prefix_cache(server.url)
        cold = run_load(server.url, spec, PROMPTS)  # ... unless the cache was reset
    assert not reset_prefix_cache("http://127.0.0.1:9")  # (no server there)
    firsts = [[t for t in run.timings if t.turn == 0] for run in (result, again, cold)]
    assert all(t.cached_tokens >= t.prompt_tokens - 1 for t in firsts[1])
    assert all(t.cached_tokens <= 1 for t in firsts[0] + firsts[2])  # (the role token)
    assert result.errors == [] and summary["requests"] == 7
    assert sorted(t.turn for t in result.timings) == [0, 0, 0, 1, 1, 2, 2]  # 3 + 3 + 1 turns
    first = {t.prompt_tokens for t in result.timings if t.turn == 0}
    assert min(t.prompt_tokens for t in result.timings if t.turn) > max(first)
    later = [t for t in result.timings if t.turn]
    # all but the follow-up message (at most 7 tokens with its roles here) and the reply's
    # last token were cached: the earlier prompt and the 8-token reply, sent back as made
    assert all(t.cached_tokens >= t.prompt_tokens - 8 for t in later)
    share = sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later)
    assert summary["turns"] == 3 and summary["cached_share_later_turns"] == share
    assert summary["ttft_p50_s_later_turns"] > 0
    with pytest.raises(ValueError, match="chat"):
        LoadSpec("m", turns=2, chat=False)
