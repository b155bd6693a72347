"""OpenAI's Batch API file format for `speculative generate --prompts FILE.jsonl`.

A file of OpenAI batch requests (one JSON object a line: ``custom_id``, ``method``
"POST", ``url`` "/v1/chat/completions" or "/v1/completions", ``body`` the request, as
uploaded for ``/v1/batches``; vLLM's ``run_batch`` reads the same) is decoded like any
prompts file, and each row is written as OpenAI's batch output line: ``id``,
``custom_id``, ``response`` (``status_code`` 200, ``request_id``, ``body`` the
``chat.completion`` or ``text_completion`` object with its ``usage``) and ``error``.
A line asking for what the batched job does not serve (several choices, tools,
log-probabilities, another endpoint) stops the job before anything is loaded, naming it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from speculative.batch_jobs import Record, ResultLine, openai_batch_line
from speculative.cli.common import CliError
from speculative.engine.stopping import openai_finish_reason

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# request fields taken: the body's name -> the prompts record's
TAKEN = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}
# fields a row cannot serve, with the value that asks for nothing
REFUSED = {
    "n": 1,
    "tools": None,
    "functions": None,
    "logprobs": None,
    "top_logprobs": None,
    "stream": False,
    "echo": False,
    "best_of": None,
    "suffix": None,
}


def is_batch_request(record: Any) -> bool:
    """Whether a prompts line is an OpenAI batch request (it has ``custom_id``)."""
    return isinstance(record, dict) and "custom_id" in record


def prompts_record(request: dict[str, Any], where: str) -> Record:
    """The prompts record that decodes one batch request (``where``: its file and line,
    for errors)."""
    url, body = request.get("url"), request.get("body")
    if request.get("method", "POST") != "POST" or url not in URLS:
        raise CliError(f"{where}: url must be one of {', '.join(URLS)} (POST), got {url!r}")
    if not isinstance(body, dict):
        raise CliError(f"{where}: body must be a request object")
    for name, off in REFUSED.items():
        if body.get(name) not in (None, False, [], off):
            raise CliError(f"{where}: {name} is not served by a batched job")
    record: Record = {"chat": URLS[url] == "chat"}
    if record["chat"]:
        record["messages"] = body.get("messages")
    else:
        record["prompt"] = _prompt(body.get("prompt"), where)
    if not (record.get("messages") or record.get("prompt")):
        raise CliError(f"{where}: the body has no {'messages' if record['chat'] else 'prompt'}")
    record |= {ours: body[theirs] for theirs, ours in TAKEN.items() if body.get(theirs) is not None}
    stop = body.get("stop")
    if stop is not None:
        record["stop"] = [stop] if isinstance(stop, str) else list(stop)
    schema = _schema(body.get("response_format"), where)
    if schema is not None:
        record["json_schema"] = schema
    return record


def _prompt(prompt: Any, where: str) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise CliError(f"{where}: prompt must be one string")
    return prompt


def _schema(response_format: Any, where: str) -> dict[str, Any] | None:
    """``response_format``'s JSON schema (``json_object``: any object), or None for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return response_format.get("json_schema", {}).get("schema", {"type": "object"})
    raise CliError(f"{where}: response_format type {kind!r} is not served")


def batch_output(line: ResultLine, request: dict[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's batch output line for a finished row."""
    chat = URLS[request["url"]] == "chat"
    finish = openai_finish_reason(line["finish_reason"])
    completion = len(line["token_ids"])
    usage = {
        "prompt_tokens": line["prompt_tokens"],
        "completion_tokens": completion,
        "total_tokens": line["prompt_tokens"] + completion,
    }
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": line["text"]},
                  "logprobs": None, "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": line["text"], "logprobs": None, "finish_reason": finish}
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request["body"].get("model") or model,
        "choices": [choice],
        "usage": usage,
    }
    return openai_batch_line(request["custom_id"], 200, body)
