"""A live test server on loopback over a tiny native model with a word-level tokenizer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from speculative.server import ServerConfig, create_app
from speculative.server.background import BackgroundServer, serve_in_background
from speculative.server.state import build_state
from speculative.targets import load_target
from tiny import save_tiny, tiny_tokenizer

API_KEY = "sk-test-key"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}then{% endif %}"
)


# the tiny chat template with a generation prompt that starts the assistant's turn as a
# rendered assistant message does (as real templates do): a conversation's next prompt
# then begins with the last prompt and reply
CONTINUING_TEMPLATE = CHAT_TEMPLATE.replace("then{% endif %}", "assistant{% endif %}")


def tiny_chat_folder(folder: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A tiny Llama (native runtime) whose tokenizer has a chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return save_tiny(folder, seed=3, tokenizer=tokenizer)


def start_server(folder: Path, **config: Any) -> BackgroundServer:
    loaded = load_target(str(folder), config.get("runtime", "native"))
    # a fixed γ (serve's default is load-aware): the tiny model's rows draft every round,
    # and no pass-cost curves are measured per server
    settings = {
        "target": str(folder),
        "drafts": ("ngram", "none"),
        "max_batch": 4,
        "gamma": 4,
        **config,
    }
    state = build_state(ServerConfig(**settings), loaded)
    return serve_in_background(create_app(state))


def http(
    url: str,
    method: str = "GET",
    body: bytes | dict | None = None,
    key: str | None = API_KEY,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one Prometheus sample (0 when absent)."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0
