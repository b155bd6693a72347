"""Self-distillation data comes from the batched engine: every answer is the target's own
(the text single-sequence generation gives for the same settings and seed), sampled
answers take their own seeds, and a rerun answers only what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_helpers import tiny_chat_folder
from speculative.batch_jobs import BatchJob, RowDecoder
from speculative.pipeline import Speculator
from speculative.targets import load_target
from speculative.training.prompts import build_prompts
from speculative.training.selfdistill import (
    SAMPLED_EVERY,
    answer_prompts,
    answer_records,
    answered,
    first_turns,
    prompt_key,
    unanswered,
    write_transcripts,
)

PROMPTS = [[{"role": "user", "content": text}] for text in (
    "the cat sat", "red blue red", "a dog ran on the mat", "the end", "big small big",
)]  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    return load_target(str(tiny_chat_folder(tmp_path_factory.mktemp("distill"))), "native")


def test_batched_answers_are_the_targets_own(loaded, tmp_path: Path) -> None:
    decoder = RowDecoder(BatchJob(draft=None, batch_size=3), loaded)
    path = tmp_path / "selfdistill.jsonl"
    write_transcripts(path, answer_prompts(decoder, PROMPTS, 12, seed=5, progress=False))
    records = {prompt_key(r["messages"]): r for r in answer_records(PROMPTS, 12, 5)}
    assert sum(r["temperature"] > 0 for r in records.values()) == len(PROMPTS) // SAMPLED_EVERY
    speculator = Speculator(loaded, None)
    transcripts = [json.loads(line)["messages"] for line in path.open()]
    assert len(transcripts) == len(PROMPTS)
    for messages in transcripts:
        record = records[prompt_key(messages[:-1])]
        alone = speculator.generate(
            messages=record["messages"], max_new_tokens=12, temperature=record["temperature"],
            top_p=record["top_p"], seed=record["seed"],
        )  # fmt: skip
        assert messages[-1] == {"role": "assistant", "content": alone.text}
    assert answered(path) == set(records)
    # a rerun answers nothing more; a new prompt is the one left to answer
    assert unanswered(path, PROMPTS) == []
    extra = [{"role": "user", "content": "a cat"}]
    assert unanswered(path, [*PROMPTS, extra]) == [extra]


def test_prompts_drawn_by_an_earlier_run_are_not_drawn_again(tmp_path: Path) -> None:
    prose = ["One sentence here. Another one there. A third one.", "Cats sleep. Dogs bark."]
    code = ["def f(x):\n    y = x\n    return y"]
    earlier = build_prompts(400, seed=0, prose=prose, code=code)
    # an earlier run's files: its prompts, and transcripts whose first turn was answered
    # and then followed by a second user turn
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in earlier[:200])
    )
    answer = {"role": "assistant", "content": "ok"}
    follow = {"role": "user", "content": "and then?"}
    transcripts = [[*m, answer, follow, answer] for m in earlier[200:]]
    (tmp_path / "selfdistill.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in transcripts)
    )
    drawn = first_turns([tmp_path / "prompts.jsonl", tmp_path / "selfdistill.jsonl"])
    assert drawn == {prompt_key(m) for m in earlier}
    later = build_prompts(400, seed=1, prose=prose, code=code, exclude=drawn)
    keys = [prompt_key(m) for m in later]
    assert len(set(keys)) == 400 and not drawn.intersection(keys)
    # the control: without the exclusion the same seed repeats many earlier prompts
    again = {prompt_key(m) for m in build_prompts(400, seed=1, prose=prose, code=code)}
    assert len(drawn & again) > 40
