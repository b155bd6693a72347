"""`speculative serve` as a process: SIGTERM stops taking connections and lets the stream
in flight finish before the process exits (what a rolling restart needs)."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from server_helpers import tiny_chat_folder


def _started(proc: subprocess.Popen) -> str:
    """The URL a starting server prints on stderr (its port was 0: any free one)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        found = re.search(r"on (http://\S+) ", line)
        if found:
            return found[1]
        assert line or proc.poll() is None, "the server exited before serving"
    raise AssertionError("the server did not start")


def _interrupted_stream(folder: Path, sent: signal.Signals) -> tuple[list[str], int]:
    """Start `speculative serve`, open a 200-token stream, send ``sent`` to the server
    after its first chunk; returns the stream's events after that and the exit code."""
    command = [sys.executable, "-m", "speculative.cli.main", "serve", "--target", str(folder),
               "--port", "0", "--gamma", "4", "--draft", "ngram", "--log-level", "warning",
               "--timeout-graceful-shutdown", "60"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = _started(proc)
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as models:
            model = json.load(models)["data"][0]["id"]
        body = {"model": model, "prompt": "the", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as stream:
            assert stream.readline().startswith(b"data: ")
            proc.send_signal(sent)  # mid-stream
            try:
                rest = stream.read().decode()
            except http.client.IncompleteRead as cut:
                rest = cut.partial.decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        code = proc.wait(timeout=60)
        try:  # the port no longer takes requests
            urllib.request.urlopen(url + "/health", timeout=5)
            raise AssertionError("the server still answered after its shutdown")
        except urllib.error.URLError:
            pass
        return events, code
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_sigterm_lets_the_stream_in_flight_finish(tmp_path: Path) -> None:
    folder = tiny_chat_folder(tmp_path / "model")
    events, code = _interrupted_stream(folder, signal.SIGTERM)
    assert events[-1] == "[DONE]"  # the stream ran to its end
    finished = [json.loads(e)["choices"] for e in events[:-1]]
    assert [c[0]["finish_reason"] for c in finished if c][-1] == "length"
    # then it exits (uvicorn re-raises the signal it caught once it has shut down)
    assert code in (0, -signal.SIGTERM)
    # the control: a server killed outright leaves the stream cut
    events, code = _interrupted_stream(folder, signal.SIGKILL)
    assert "[DONE]" not in events and code == -signal.SIGKILL
