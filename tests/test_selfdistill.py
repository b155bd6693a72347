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
from speculative.training.selfdistill import (
    SAMPLED_EVERY,
    answer_prompts,
    answer_records,
    answered,
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
