"""Predicted outputs: drafts from a text the reply is expected to resemble (OpenAI's
``prediction``). The drafter follows the prediction through edits; a right prediction
makes a greedy reply take far fewer target passes, a wrong one changes nothing but the
passes (the reply is plain decoding's either way); the server counts accepted and
rejected prediction tokens as OpenAI's usage does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server_helpers import http, start_server, tiny_chat_folder
from speculative.drafters.prediction import PredictionDrafter
from speculative.sampling import SamplingParams

PROMPT = "the cat sat on the mat"
GREEDY = SamplingParams(temperature=0)


def _propose(drafter: PredictionDrafter, context: list[int], gamma: int = 4) -> list[int]:
    return drafter.propose(context, gamma, GREEDY, torch.Generator()).tokens


def test_the_drafter_follows_the_prediction_through_edits() -> None:
    prediction = list(range(100, 140))  # 40 distinct tokens
    prompt = [1, 2, 3]
    drafter = PredictionDrafter(prediction, len(prompt))
    assert _propose(drafter, prompt) == [100, 101, 102, 103]  # the reply starts there
    drafter.observe([*prompt, 100, 101, 102, 103, 104], 4)  # all 4 kept, then a bonus
    assert (drafter.accepted, drafter.rejected) == (4, 0)
    reply = [100, 101, 102, 103, 104]
    assert _propose(drafter, prompt + reply) == [105, 106, 107, 108]
    drafter.observe(prompt + reply + [105, 7], 1)  # one kept, then the target's own token
    assert (drafter.accepted, drafter.rejected) == (5, 3)
    edited = [*reply, 105, 7, 8]  # the reply inserted 7 8 ...
    assert _propose(drafter, prompt + edited) == []  # new text: lookup finds nothing here
    edited += [106, 107]  # ... and went back to the prediction
    assert _propose(drafter, prompt + edited) == [108, 109, 110, 111]
    skipped = [*edited, 108, 120, 121]  # a deletion: 109..119 left out
    assert _propose(drafter, prompt + skipped) == [122, 123, 124, 125]
    assert _propose(drafter, prompt + list(range(100, 140))) == []  # at its end
    drafter.reset()
    assert (drafter.accepted, drafter.rejected, _propose(drafter, prompt)) == (
        0,
        0,
        [100, 101, 102, 103],
    )


def test_equal_matches_resolve_to_the_nearest_expected_place() -> None:
    block = [50, 51, 52, 53]
    prediction = [*block, 60, *block, 61, *block, 62]  # the same lines three times
    drafter = PredictionDrafter(prediction, 0)
    assert _propose(drafter, [], 5) == [*block, 60]
    drafter.observe([*block, 60, 50], 5)  # the reply goes on into the second copy
    assert _propose(drafter, [*block, 60, 50], 3) == [51, 52, 53]
    drafter.observe([*block, 60, 50, 51, 52, 53, 61], 3)
    assert _propose(drafter, [*block, 60, 50, 51, 52, 53, 61], 4) == block  # the third
    assert PredictionDrafter(prediction, 0).aligned([51, 52]) == 3  # nothing expected: first


def test_greedy_with_a_prediction_is_plain_greedy_and_a_right_one_saves_passes(
    tmp_path: Path, capsys
) -> None:
    from speculative.cli.main import main
    from speculative.pipeline import Speculator

    folder = tiny_chat_folder(tmp_path / "model")
    speculator = Speculator.load(str(folder), draft="none", gamma=8)
    plain = speculator.generate(PROMPT, chat=False, max_new_tokens=40)
    ids = plain.token_ids
    right = speculator.generate(PROMPT, chat=False, max_new_tokens=40, prediction=ids)
    edited = [*ids[:10], 9, 9, *ids[10:25], *ids[28:]]  # an insertion and a deletion
    near = speculator.generate(PROMPT, chat=False, max_new_tokens=40, prediction=edited)
    text = speculator.generate(PROMPT, chat=False, max_new_tokens=40, prediction=plain.text)
    wrong = speculator.generate(PROMPT, chat=False, max_new_tokens=40, prediction="dog ran " * 9)
    for output in (right, near, text, wrong):
        assert output.token_ids == ids  # plain decoding's reply, every time
    assert plain.stats.target_calls == 40
    assert right.stats.target_calls == 5  # γ 8: every draft kept, and a bonus token
    assert right.stats.target_calls < near.stats.target_calls < wrong.stats.target_calls
    # (the text, tokenized again, loses the <unk> tokens the reply holds: fewer kept)
    assert text.stats.target_calls < wrong.stats.target_calls
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(plain.text)
    argv = ["generate", "--target", str(folder), "--no-chat", "--max-new-tokens", "40",
            "--gamma", "8", "--json", PROMPT]  # fmt: skip
    assert main([*argv, "--prediction-file", str(prediction)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == ids
    assert out["stats"]["target_calls"] == text.stats.target_calls
    assert main([*argv, "--prediction-file", str(tmp_path / "missing")]) == 2
    assert "cannot read --prediction-file" in capsys.readouterr().err


def test_the_server_drafts_from_a_prediction_and_counts_its_tokens(tmp_path: Path) -> None:
    folder = tiny_chat_folder(tmp_path / "model")
    with start_server(folder, max_prompt_tokens=64) as server:
        url = server.url + "/v1/chat/completions"
        model = http(server.url + "/v1/models")[1]["data"][0]["id"]
        base = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 30, "temperature": 0, "speculative": {"gamma": 8}}  # fmt: skip
        status, plain = http(url, "POST", {**base, "speculative": {"draft": "none"}})
        text = plain["choices"][0]["message"]["content"]
        assert status == 200 and "completion_tokens_details" not in plain["usage"]
        for predicted, parts in ((text, False), ("dog ran " * 9, True)):
            content = [{"type": "text", "text": predicted}] if parts else predicted
            prediction = {"type": "content", "content": content}
            status, body = http(url, "POST", {**base, "prediction": prediction})
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == text
            details = body["usage"]["completion_tokens_details"]
            assert body["speculative"]["draft"] == "prediction"
            kept, lost = (
                details["accepted_prediction_tokens"],
                details["rejected_prediction_tokens"],
            )
            if predicted == text:  # (its <unk> tokens are not in the text: not all kept)
                assert kept >= 10 and kept > 2 * lost
            else:
                assert lost > kept
        status, refused = http(url, "POST", {**base, "prediction": {"type": "other"}})
        assert status == 400 and refused["error"]["param"].startswith("prediction")


@pytest.mark.parametrize("bad", [{"max_ngram": 1, "min_match": 2}, {"min_match": 0}])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="min_match"):
        PredictionDrafter([1, 2], 0, **bad)
