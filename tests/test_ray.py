"""Scale-out on Ray, on a local Ray instance started here (one for the whole module).

`speculative generate --prompts … --ray --workers 2` must write exactly what the local
batched job writes (each row's tokens do not depend on which worker or batch decoded it),
resume after a crash like the local job, and turn a worker's failure into one line.
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'speculative[ray]')")

from speculative.batch_jobs import BatchJob, RowDecoder  # noqa: E402
from speculative.scaleout.ray_batch import BatchWorker, RayJobError, check_reachable  # noqa: E402
from test_cli import last_json, run_cli  # noqa: E402
from tiny import save_tiny  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")
# what differs from run to run: timings, and how much of a prompt another live row held
TIMING = (
    "seconds",
    "prefill_seconds",
    "draft_seconds",
    "tokens_per_second",
    "cached_prompt_tokens",
)
RECORDS = [
    {"prompt": "the cat sat on the mat and the cat", "max_new_tokens": 12},
    {"prompt": "a dog ran", "temperature": 0.9, "seed": 4, "max_new_tokens": 9},
    {"messages": [{"role": "user", "content": "red blue red blue"}], "stop": ["end"]},
    {"prompt": "it was big", "temperature": 1.0, "top_p": 0.8, "seed": 1},
    {"prompt": "then the rug"},
]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance with 2 CPUs for every test here (start-up is paid once)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A tiny native model, a prompts file and the generate arguments (no --out)."""
    folder = tmp_path_factory.mktemp("ray_job")
    model = save_tiny(folder / "tiny", seed=2, layers=2)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    argv = ["generate", "--target", str(model), "--runtime", "native", "--no-chat"]
    argv += ["--prompts", str(prompts), "--batch-size", "2", "--json"]
    argv += ["--max-new-tokens", "10", "--draft", "ngram", "--gamma", "3"]
    return folder, argv


def _lines(path: Path) -> list[dict]:
    """The output lines without their timings (which differ from run to run)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        for key in TIMING:
            line["stats"].pop(key)
    return lines


@pytest.mark.slow
def test_ray_job_equals_the_local_job_and_resumes(local_ray, job, capsys) -> None:
    folder, argv = job
    local, spread = folder / "local.jsonl", folder / "ray.jsonl"
    code, out, err = run_cli(capsys, *argv, "--out", str(local))
    assert code == 0, err
    code, out, err = run_cli(capsys, *argv, "--out", str(spread), "--ray", "--workers", "2")
    assert code == 0, err
    summary = last_json(out)
    assert summary["rows"] == 5 and summary["workers"] == 2
    expected = _lines(local)
    assert [line["index"] for line in expected] == list(range(5))
    assert len({tuple(line["token_ids"]) for line in expected}) == 5  # rows are distinct
    assert _lines(spread) == expected
    assert summary["new_tokens"] == sum(len(line["token_ids"]) for line in expected)

    kept = spread.read_text().splitlines()
    spread.write_text("\n".join(kept[:2]) + "\n" + kept[2][:25])  # a crash mid-line
    code, out, err = run_cli(capsys, *argv, "--out", str(spread), "--ray", "--workers", "2")
    assert code == 0, err
    assert last_json(out)["rows"] == 3
    assert _lines(spread) == expected
    code, out, err = run_cli(capsys, *argv, "--out", str(spread), "--ray", "--workers", "2")
    assert code == 0 and last_json(out)["rows"] == 0  # all done: nothing runs
    assert _lines(spread) == expected


@pytest.mark.slow
def test_a_worker_failure_is_one_line(local_ray, job, capsys) -> None:
    """A worker that cannot load its target: its own error comes back, no traceback."""
    folder, argv = job
    missing = str(folder / "missing-model")
    at = argv.index("--target") + 1
    argv = [*argv[:at], missing, *argv[at + 1 :]]
    code, _, err = run_cli(capsys, *argv, "--out", str(folder / "x.jsonl"), "--ray")
    assert code == 2
    assert missing in err and "does not exist" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def _worker(model: Path, **settings) -> BatchWorker:
    job = BatchJob(target=str(model), runtime="native", chat=False, gamma=3, **settings)
    worker = BatchWorker(job, threads=1)
    worker.load()
    return worker


def test_worker_hands_over_every_row_then_done(job) -> None:
    """The actor class in-process: take() returns each finished row once, then done; the
    lines are the local job's."""
    folder, _ = job
    items = list(enumerate(RECORDS))
    worker = _worker(folder / "tiny", max_new_tokens=10, batch_size=2)
    assert worker.decoder is not None
    engine, passes_at_put = worker.decoder.engine, []

    class Recording(queue.Queue):  # the target passes run when each item is handed over
        def put(self, item, block=True, timeout=None):
            passes_at_put.append(engine.target_passes)
            super().put(item, block, timeout)

    worker.lines = Recording()
    worker.start(items)
    taken, done = [], False
    while not done:
        lines, done = worker.take()
        taken += lines
    local = list(RowDecoder(worker.job).run(items))
    assert sorted(line["index"] for line in taken) == list(range(5))
    by_index = {line["index"]: line["token_ids"] for line in taken}
    assert [by_index[line["index"]] for line in local] == [line["token_ids"] for line in local]
    # lines come as rows finish, not all at the end: the first is handed over while
    # passes for the other rows are still to run (a wait in take() cannot change this)
    assert len(passes_at_put) == 6 and passes_at_put[0] < passes_at_put[4]


def test_worker_error_reaches_take(job) -> None:
    """A row that cannot run (an empty prompt, after a good one) fails the worker's take()
    with the decoder's own error, instead of hanging the driver."""
    folder, _ = job
    worker = _worker(folder / "tiny", max_new_tokens=4, batch_size=2)
    worker.start([(0, {"prompt": "the cat"}), (1, {"prompt": "  "})])
    with pytest.raises(ValueError, match="empty"):
        while not worker.take()[1]:
            pass


def test_missing_ray_is_a_clear_error(job, capsys, monkeypatch) -> None:
    folder, argv = job
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    code, _, err = run_cli(capsys, *argv, "--out", str(folder / "y.jsonl"), "--ray")
    assert code == 2 and "speculative[ray]" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "serve", "--replicas", "2", "--target", str(folder))
    assert code == 2 and "speculative[ray]" in err and "Traceback" not in err


def test_ray_flags_need_their_companions(job, capsys) -> None:
    folder, argv = job
    code, _, err = run_cli(capsys, *argv, "--out", str(folder / "z.jsonl"), "--workers", "2")
    assert code == 2 and "need --ray" in err
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--ray")
    assert code == 2 and "--ray needs --prompts" in err
    code, _, err = run_cli(capsys, "serve", "--replicas", "2", "--port", "0")
    assert code == 2 and "fixed --port" in err


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_replicas_answer_like_the_single_server(local_ray, tmp_path_factory) -> None:
    """`serve --replicas 2`: greedy completions, chat and streams through the one Ray Serve
    endpoint equal the single uvicorn server's, and both replicas are running."""
    openai = pytest.importorskip("openai")
    from ray import serve

    from server_helpers import API_KEY, tiny_chat_folder
    from speculative.scaleout.ray_serve import APP_NAME, served, server_app
    from speculative.server import ServerConfig
    from speculative.server.background import serve_in_background

    folder = tiny_chat_folder(tmp_path_factory.mktemp("ray_serve"))
    config = ServerConfig(
        target=str(folder), drafts=("ngram", "none"), max_batch=4, api_key=API_KEY, gamma=4
    )

    def answers(url: str) -> list[str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        texts = []
        for prompt in ("the cat sat on the mat", "red blue red blue red", "a dog ran"):
            texts.append(
                client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
                .choices[0]
                .text
            )
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "the dog sat"}],
            max_tokens=10,
            temperature=0,
            extra_body={"speculative": {"draft": "none"}},
        )
        texts.append(chat.choices[0].message.content)
        stream = client.completions.create(
            model=model, prompt="the cat sat", max_tokens=12, temperature=0, stream=True
        )
        texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        return texts

    def conversation(url: str) -> list[str]:  # each turn may reach either replica
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        texts, previous = [], None
        for turn in ("the cat sat", "a dog ran", "red blue", "the mat", "it was big"):
            answer = client.responses.create(
                model=model, input=turn, previous_response_id=previous, max_output_tokens=6,
                temperature=0,
            )  # fmt: skip
            previous = answer.id
            texts.append(client.responses.retrieve(answer.id).output_text)
        return texts

    with serve_in_background(server_app(config)) as single:
        expected = answers(single.url), conversation(single.url)
    assert all(expected[0]) and len(set(expected[0])) > 1
    with served(config, 2, port=_free_port()) as url:
        status = serve.status().applications[APP_NAME].deployments
        assert [d.replica_states for d in status.values()] == [{"RUNNING": 2}]
        assert (answers(url), conversation(url)) == expected


def test_servers_over_shared_records_answer_for_each_other(local_ray, tmp_path_factory) -> None:
    """Two servers whose Responses answers live in one Ray actor (as `serve --replicas`'
    do): a follow-up, retrieval, input items, a background response's progress and its
    cancel, a background stream resumed, a deletion and a conversation's turns, each
    through the server that did not make the response. The
    control, each server with its own records, cannot find the other's response."""
    openai = pytest.importorskip("openai")
    import threading

    from server_helpers import API_KEY, CONTINUING_TEMPLATE, tiny_chat_folder
    from speculative.scaleout.ray_serve import shared_records
    from speculative.server import ServerConfig, create_app
    from speculative.server.background import serve_in_background
    from speculative.server.state import build_state
    from speculative.targets import load_target

    folder = tiny_chat_folder(tmp_path_factory.mktemp("shared"), CONTINUING_TEMPLATE)
    config = ServerConfig(
        target=str(folder), drafts=("ngram", "none"), max_batch=4, api_key=API_KEY, gamma=4,
        replicas=2,
    )  # fmt: skip

    def app(records):
        return create_app(build_state(config, load_target(str(folder), "native")), records)

    def client(server):
        return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

    records = shared_records(10)
    with serve_in_background(app(records)) as one, serve_in_background(app(records)) as two:
        first, second = client(one), client(two)
        model = first.models.list().data[0].id
        asked = {"model": model, "max_output_tokens": 8, "temperature": 0}
        opening = first.responses.create(input="the cat sat", **asked)
        here = first.responses.create(input="a dog", previous_response_id=opening.id, **asked)
        there = second.responses.create(input="a dog", previous_response_id=opening.id, **asked)
        assert there.output_text == here.output_text
        assert second.responses.retrieve(opening.id).output_text == opening.output_text
        items = second.responses.input_items.list(there.id, order="asc").data
        assert [item.content[0].text for item in items] == [
            "the cat sat", opening.output_text, "a dog"
        ]  # fmt: skip

        scheduler = one.server.config.app.state.scheduler
        step, released, after = scheduler.engine.step, threading.Event(), []

        def held_step():  # the row cannot finish before the cancel
            result = step()
            after.extend([1] if released.is_set() else [])
            released.wait(30)
            return result

        scheduler.engine.step = held_step
        try:
            long = first.responses.create(
                model=model, input="the cat", max_output_tokens=2000, background=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            _wait(lambda: second.responses.retrieve(long.id).status == "in_progress")
            cancelled = second.responses.cancel(long.id)  # (the first server decodes it)
        finally:
            released.set()
        assert cancelled.status == "cancelled"
        _wait(lambda: scheduler.running == 0)
        scheduler.engine.step = step
        assert len(after) <= 1  # the row left at once
        assert first.responses.retrieve(long.id).status == "cancelled"

        second.responses.delete(opening.id)
        with pytest.raises(openai.NotFoundError):
            first.responses.retrieve(opening.id)

        # a background stream read through the first server, resumed through the second
        step, released, rounds = scheduler.engine.step, threading.Event(), []

        def after_one_round():
            released.wait(30 if rounds else 0)
            rounds.append(1)
            return step()

        scheduler.engine.step = after_one_round
        try:
            seen = []
            with first.responses.create(model=model, input="the cat", max_output_tokens=8,
                                        background=True, stream=True) as stream:  # fmt: skip
                for event in stream:
                    seen.append(event)
                    if len(seen) == 3:
                        break
            events_id = seen[0].response.id + "/events"
            _wait(lambda: len(ray.get(records.actor.items_after.remote(events_id, 0))) >= 3)
        finally:
            released.set()
        rest = second.responses.retrieve(seen[0].response.id, stream=True,
                                         starting_after=seen[-1].sequence_number)  # fmt: skip
        resumed = [*seen, *rest]
        assert [event.sequence_number for event in resumed] == list(range(len(resumed)))
        assert resumed[-1].type in ("response.completed", "response.incomplete")
        scheduler.engine.step = step

        talk = second.conversations.create(items=[{"role": "user", "content": "the cat sat"}])
        turn = first.responses.create(conversation=talk.id, input="a dog", **asked)
        kept = second.conversations.items.list(talk.id, order="asc").data
        assert [item.content[0].text for item in kept] == [
            "the cat sat", "a dog", turn.output_text
        ]  # fmt: skip
        first.conversations.items.delete(kept[0].id, conversation_id=talk.id)
        assert len(second.conversations.items.list(talk.id).data) == 2

    with serve_in_background(app(None)) as one, serve_in_background(app(None)) as two:
        made = client(one).responses.create(input="the cat sat", **asked)
        with pytest.raises(openai.NotFoundError, match="2 replicas"):
            client(two).responses.retrieve(made.id)


def _wait(condition) -> None:
    import time

    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_unreachable_cluster_fails_fast() -> None:
    """Ray retries a dead address for minutes; the job says so at once."""
    port = _free_port()  # nothing listens there now
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(RayJobError, match="cannot reach Ray"):
            check_reachable(address, timeout_s=2)
    for address in (None, "auto", "local"):
        check_reachable(address)  # local instances: nothing to check
