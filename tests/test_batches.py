"""OpenAI's Files and Batch APIs with the real ``openai`` client: a batch's answers are
the answers the same requests get alone (chat, completions, Responses; greedy and
seeded), in input order, with failing requests in the error file; a malformed file fails
the batch naming its lines; a cancelled batch's rows leave the batch and the answers it
has are written out; files are listed, read and deleted."""

from __future__ import annotations

import io
import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("multipart")

from server_helpers import start_server, tiny_chat_folder  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 8}
THROUGH = {"ignore_eos": True, "logit_bias": {"0": -100, "1": -100}}  # words, no end


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_chat_folder(tmp_path_factory.mktemp("batches"))
    with start_server(folder, max_batch=4) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        yield server, client, client.models.list().data[0].id


def _upload(client, lines: list[dict]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch").id


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _create(client, file_id: str, endpoint: str = "/v1/chat/completions"):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def _finished(client, batch_id: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} still {batch.status}")


def _jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_as_its_requests_alone_do(served) -> None:
    _server, client, model = served
    bodies = [
        {**CHAT, "model": model, "temperature": 0, **THROUGH},
        {**CHAT, "model": model, "temperature": 0.9, "seed": 5, **THROUGH},
        {**CHAT, "model": "no-such-model"},  # fails: into the error file
        {**CHAT, "model": model, "temperature": 0, "max_tokens": 3},
    ]
    lines = [_line(f"chat-{i}", "/v1/chat/completions", body) for i, body in enumerate(bodies)]
    batch = _create(client, _upload(client, lines))
    assert batch.status == "in_progress" and batch.request_counts.total == 4
    batch = _finished(client, batch.id)
    assert batch.status == "completed" and batch.completed_at is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    answers = _jsonl(client, batch.output_file_id)
    assert [a["custom_id"] for a in answers] == ["chat-0", "chat-1", "chat-3"]  # input order
    for answer, body in zip(answers, [bodies[0], bodies[1], bodies[3]], strict=True):
        alone = client.chat.completions.create(**{k: v for k, v in body.items()
                                                  if k not in THROUGH}, extra_body={
            k: v for k, v in body.items() if k in THROUGH})  # fmt: skip
        made = answer["response"]["body"]
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
        assert made["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert made["usage"]["completion_tokens"] == alone.usage.completion_tokens
    (failed,) = _jsonl(client, batch.error_file_id)
    assert failed["custom_id"] == "chat-2" and failed["response"]["status_code"] == 404
    assert "no-such-model" in failed["error"]["message"]
    # completions and the Responses API likewise
    text = {"model": model, "prompt": "the cat sat on", "max_tokens": 6, "temperature": 0}
    asked = {"model": model, "input": "the cat sat", "max_output_tokens": 6, "temperature": 0}
    for url, body, read in [
        ("/v1/completions", text, lambda b: b["choices"][0]["text"]),
        ("/v1/responses", asked, lambda b: b["output"][0]["content"][0]["text"]),
    ]:
        made = _finished(client, _create(client, _upload(client, [_line("x", url, body)]), url).id)
        (answer,) = _jsonl(client, made.output_file_id)
        alone = (client.completions.create(**body).choices[0].text if url == "/v1/completions"
                 else client.responses.create(**body).output_text)  # fmt: skip
        assert read(answer["response"]["body"]) == alone
    listed = client.batches.list(limit=2).data
    assert listed[0].id == made.id and len(listed) == 2  # newest first


def test_a_malformed_file_fails_its_batch_naming_the_lines(served) -> None:
    _server, client, model = served
    good = _line("a", "/v1/chat/completions", {**CHAT, "model": model})
    elsewhere = {**good, "custom_id": "b", "url": "/v1/completions"}
    texts = [json.dumps(good), "not json", json.dumps(elsewhere), json.dumps(good)]
    data = "".join(text + "\n" for text in texts).encode()
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    batch = _create(client, uploaded.id)
    assert batch.status == "failed" and batch.output_file_id is None
    assert [(e.line, e.message.split(" ")[0]) for e in batch.errors.data] == [
        (2, "not"), (3, "url"), (4, "custom_id")
    ]  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        _create(client, uploaded.id, "/v1/embeddings")
    with pytest.raises(openai.NotFoundError):
        _create(client, "file-nope")
    kept = client.files.retrieve(uploaded.id)
    assert kept.bytes == len(data) and kept.filename == "bad.jsonl"
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(uploaded.id).content == data
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_cancelled_batch_frees_its_rows_and_keeps_what_it_answered(served, monkeypatch) -> None:
    import threading

    server, client, model = served
    scheduler = server.server.config.app.state.scheduler
    step, asked, after = scheduler.engine.step, threading.Event(), []

    def held_step():  # once the long rows decode, they wait for the cancel
        if scheduler.running and all(job.request.stop.max_new_tokens > 2
                                     for job in scheduler._jobs.values()):  # fmt: skip
            after.extend([1] if asked.is_set() else [])
            asked.wait(30)
        return step()

    monkeypatch.setattr(scheduler.engine, "step", held_step)
    short = {**CHAT, "model": model, "temperature": 0, "max_tokens": 2}
    long = {**CHAT, "model": model, "max_tokens": 2000, **THROUGH}
    lines = [_line("short", "/v1/chat/completions", short),
             *(_line(f"long-{i}", "/v1/chat/completions", long) for i in range(3))]  # fmt: skip
    batch = _create(client, _upload(client, lines))
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch.id).request_counts.completed < 1 or not scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        cancelled = client.batches.cancel(batch.id)
    finally:
        asked.set()
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    deadline = time.monotonic() + 30
    while scheduler.running:  # its rows left the batch ...
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(after) <= 1  # ... within a round, not at their end
    assert [a["custom_id"] for a in _jsonl(client, cancelled.output_file_id)] == ["short"]
