"""A bounded load test against an OpenAI-compatible server (``speculative bench-serve``).

``concurrency`` client threads each keep one streamed request in flight until
``requests`` have been sent in all. For every request: time to first token (first
chunk with text), completion tokens (from the usage chunk), end-to-end seconds. The
summary: errors, p50/p99 TTFT, mean and p50 tokens/s per stream, aggregate throughput
(all completion tokens ÷ wall time). With ``turns`` above 1 each thread holds
conversations: a prompt, then ``turns - 1`` follow-up messages, each request sending the
conversation so far with the replies the server gave; the summary then also gives the
later turns' TTFT and the share of their prompt tokens the server found in its cache.
Only the standard library on the client side.
"""

from __future__ import annotations

import http.client
import json
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class LoadSpec:
    """What to send: the request template and how many, how concurrently."""

    model: str
    concurrency: int = 8
    requests: int = 64
    max_tokens: int = 64
    temperature: float = 0.0
    draft: str | None = None  # the speculative extension's drafter (None: server default)
    gamma: int | None = None
    chat: bool = True
    ignore_eos: bool = True  # fixed-length outputs: comparable runs
    api_key: str | None = None
    turns: int = 1  # requests per conversation (chat): the later ones continue it
    extra: dict[str, Any] = field(default_factory=dict)  # more fields of every request body

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.turns > 1 and not self.chat:
            raise ValueError("conversations of several turns need chat requests")


# the user's message of each later turn (in turn, cycling)
FOLLOW_UPS = ("Please go on.", "Can you give an example?", "Why is that?", "Summarize it.")


@dataclass(frozen=True)
class RequestTiming:
    ttft: float | None  # seconds to the first text chunk
    seconds: float  # end to end
    tokens: int  # completion tokens
    error: str | None = None
    alpha: float | None = None  # the request's acceptance rate (server's speculative stats)
    tau: float | None = None  # its tokens per target pass
    turn: int = 0  # its place in its conversation (0: the first request)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its cache
    reply: str = ""  # the streamed text (the next turn sends it back)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LoadResult:
    spec: LoadSpec
    timings: list[RequestTiming] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def errors(self) -> list[str]:
        return [t.error for t in self.timings if t.error is not None]

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.timings if t.error is None]
        ttfts = sorted(t.ttft for t in ok if t.ttft is not None)
        rates = [t.tokens_per_second for t in ok]
        alphas = [t.alpha for t in ok if t.alpha is not None]
        taus = [t.tau for t in ok if t.tau is not None]
        tokens = sum(t.tokens for t in ok)
        return {
            "draft": self.spec.draft,
            "concurrency": self.spec.concurrency,
            "requests": len(self.timings),
            "errors": len(self.errors),
            "completion_tokens": tokens,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "stream_tokens_per_s_mean": statistics.fmean(rates) if rates else 0.0,
            "stream_tokens_per_s_p50": percentile(sorted(rates), 50),
            "aggregate_tokens_per_s": tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "wall_seconds": self.wall_seconds,
            "alpha_mean": statistics.fmean(alphas) if alphas else None,
            "tau_mean": statistics.fmean(taus) if taus else None,
        } | self._turns_summary(ok)

    def _turns_summary(self, ok: list[RequestTiming]) -> dict[str, Any]:
        """With conversations: first and later turns' TTFT p50, and the share of the
        later turns' prompt tokens found in the server's cache."""
        if self.spec.turns == 1:
            return {}
        later = [t for t in ok if t.turn > 0]
        first = sorted(t.ttft for t in ok if t.turn == 0 and t.ttft is not None)
        prompt = sum(t.prompt_tokens for t in later)
        return {
            "turns": self.spec.turns,
            "ttft_p50_s_first_turns": percentile(first, 50),
            "ttft_p50_s_later_turns": percentile(
                sorted(t.ttft for t in later if t.ttft is not None), 50
            ),
            "cached_share_later_turns": sum(t.cached_tokens for t in later) / prompt
            if prompt
            else 0.0,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted ``values`` (nearest rank); 0 when empty."""
    if not values:
        return 0.0
    rank = max(1, min(len(values), math.ceil(q / 100 * len(values))))
    return float(values[rank - 1])


def request_body(
    spec: LoadSpec, prompt: dict[str, Any], history: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """One request's body: ``prompt``'s, or (chat) ``history``'s messages where given."""
    body: dict[str, Any] = {
        "model": spec.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "seed": 0,
        "ignore_eos": spec.ignore_eos,
    }
    options = {}
    if spec.draft is not None:
        options["draft"] = spec.draft
    if spec.gamma is not None:
        options["gamma"] = spec.gamma
    if options:
        body["speculative"] = options
    body.update(spec.extra)
    if spec.chat:
        body["messages"] = history or opening_messages(prompt)
    else:
        body["prompt"] = prompt.get("prompt") or "\n".join(m["content"] for m in prompt["messages"])
    return body


def opening_messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    return list(prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}])


def stream_once(connection: http.client.HTTPConnection, path: str, body: dict, key: str | None):
    """One streamed request; returns its RequestTiming (errors caught and returned)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    started = time.perf_counter()
    ttft, tokens, stats, usage, pieces = None, 0, {}, {}, []
    try:
        connection.request("POST", path, json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode("utf-8", "replace")[:200]
            return RequestTiming(
                None, time.perf_counter() - started, 0, f"{response.status}: {text}"
            )
        done = False
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                return RequestTiming(
                    ttft, time.perf_counter() - started, 0, chunk["error"]["message"]
                )
            text = _chunk_text(chunk)
            if ttft is None and text:
                ttft = time.perf_counter() - started
            pieces.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = int(usage["completion_tokens"])
            if "tau" in (chunk.get("speculative") or {}):
                stats = chunk["speculative"]
        if not done:
            return RequestTiming(ttft, time.perf_counter() - started, tokens, "no [DONE]")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestTiming(ttft, time.perf_counter() - started, tokens, repr(exc))
    seconds = time.perf_counter() - started
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return RequestTiming(
        ttft, seconds, tokens, None, stats.get("alpha"), stats.get("tau"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)), cached_tokens=int(cached),
        reply="".join(pieces),
    )  # fmt: skip


def _chunk_text(chunk: dict[str, Any]) -> str:
    for choice in chunk.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            return text
    return ""


def run_load(url: str, spec: LoadSpec, prompts: Sequence[dict[str, Any]]) -> LoadResult:
    """Send ``spec.requests`` streamed requests from ``spec.concurrency`` threads."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    result = LoadResult(spec)
    lock = threading.Lock()
    next_index = [0]

    conversations = math.ceil(spec.requests / spec.turns)

    def worker() -> None:
        connection = http.client.HTTPConnection(host, port, timeout=600)
        while True:
            with lock:
                index = next_index[0]
                if index >= conversations:
                    break
                next_index[0] += 1
            prompt = prompts[index % len(prompts)]
            history = opening_messages(prompt) if spec.turns > 1 else None
            for turn in range(min(spec.turns, spec.requests - index * spec.turns)):
                body = request_body(spec, prompt, history)
                timing = replace(stream_once(connection, path, body, spec.api_key), turn=turn)
                with lock:
                    result.timings.append(timing)
                if timing.error is not None:  # a fresh connection after any failure
                    connection.close()
                    connection = http.client.HTTPConnection(host, port, timeout=600)
                    break
                if history is not None:
                    follow = FOLLOW_UPS[turn % len(FOLLOW_UPS)]
                    history += [{"role": "assistant", "content": timing.reply},
                                {"role": "user", "content": follow}]  # fmt: skip
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(spec.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_seconds = time.perf_counter() - started
    return result


def reset_prefix_cache(url: str, api_key: str | None = None) -> bool:
    """Ask the server to forget its finished requests' cached prompts (vLLM's and this
    server's ``POST /reset_prefix_cache``), so that a run does not find the last run's;
    False where the server has no such endpoint."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        connection.request("POST", "/reset_prefix_cache", headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def model_id(url: str, api_key: str | None = None) -> str:
    """The first model the server lists."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connection.request("GET", "/v1/models", headers=headers)
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    if response.status != 200:
        raise ValueError(f"GET /v1/models: {response.status} {body}")
    return body["data"][0]["id"]
