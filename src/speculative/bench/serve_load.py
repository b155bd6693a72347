"""A bounded load test against an OpenAI-compatible server (``speculative bench-serve``).

``concurrency`` client threads each keep one streamed request in flight until
``requests`` have been sent in all. For every request: time to first token (first
chunk with text), completion tokens (from the usage chunk), end-to-end seconds. The
summary: errors, p50/p99 TTFT, mean and p50 tokens/s per stream, aggregate throughput
(all completion tokens ÷ wall time). Only the standard library on the client side.
"""

from __future__ import annotations

import http.client
import json
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class RequestTiming:
    ttft: float | None  # seconds to the first text chunk
    seconds: float  # end to end
    tokens: int  # completion tokens
    error: str | None = None
    alpha: float | None = None  # the request's acceptance rate (server's speculative stats)
    tau: float | None = None  # its tokens per target pass

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
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted ``values`` (nearest rank); 0 when empty."""
    if not values:
        return 0.0
    rank = max(1, min(len(values), math.ceil(q / 100 * len(values))))
    return float(values[rank - 1])


def request_body(spec: LoadSpec, prompt: dict[str, Any]) -> dict[str, Any]:
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
    if spec.chat:
        body["messages"] = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
    else:
        body["prompt"] = prompt.get("prompt") or "\n".join(m["content"] for m in prompt["messages"])
    return body


def stream_once(connection: http.client.HTTPConnection, path: str, body: dict, key: str | None):
    """One streamed request; returns its RequestTiming (errors caught and returned)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    started = time.perf_counter()
    ttft, tokens, stats = None, 0, {}
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
            if ttft is None and _chunk_text(chunk):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if "tau" in (chunk.get("speculative") or {}):
                stats = chunk["speculative"]
        if not done:
            return RequestTiming(ttft, time.perf_counter() - started, tokens, "no [DONE]")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestTiming(ttft, time.perf_counter() - started, tokens, repr(exc))
    seconds = time.perf_counter() - started
    return RequestTiming(ttft, seconds, tokens, None, stats.get("alpha"), stats.get("tau"))


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

    def worker() -> None:
        connection = http.client.HTTPConnection(host, port, timeout=600)
        while True:
            with lock:
                index = next_index[0]
                if index >= spec.requests:
                    break
                next_index[0] += 1
            body = request_body(spec, prompts[index % len(prompts)])
            timing = stream_once(connection, path, body, spec.api_key)
            if timing.error is not None:  # a fresh connection after any failure
                connection.close()
                connection = http.client.HTTPConnection(host, port, timeout=600)
            with lock:
                result.timings.append(timing)
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(spec.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_seconds = time.perf_counter() - started
    return result


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
