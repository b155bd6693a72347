"""Drafting with a model of another vocabulary, through text (`--draft text:MODEL`): greedy
output identical to plain decoding, sampled output the target's law (with the check's
negative control), and drafts kept where the two models agree on the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculative.drafters.registry import build_drafter
from speculative.drafters.text_bridge import TextBridgeDrafter
from speculative.exactness import CheckConfig, run_check
from speculative.exactness.tiny import TINY_PROMPTS, tiny_target_folder
from speculative.models.loading import VocabularyMismatchError
from speculative.pipeline import Speculator
from speculative.targets import load_target
from tiny import WORDS, save_tiny, save_trained, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

# the target's words in another order, and two more: every id differs from the target's
OTHER_WORDS = ["zebra", *reversed(WORDS), "quux"]
ANSWERS = ["the cat sat on the mat and then it ran", "a big red dog was on the rug"]


def _answers(tokenizer, texts: list[str]) -> list[tuple[list[int], str]]:
    prompts = ["the cat", "a dog"]
    return [
        (tokenizer(prompt)["input_ids"], text) for prompt, text in zip(prompts, texts, strict=True)
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A target trained to answer two prompts, a draft of another vocabulary trained on
    the same answers, and one of that vocabulary trained on other answers (the control)."""
    root = tmp_path_factory.mktemp("bridge")
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer(OTHER_WORDS)
    shuffled = [" ".join(reversed(text.split())) for text in ANSWERS]
    return {
        "target": save_trained(root / "target", target_tok, _answers(target_tok, ANSWERS)),
        "draft": save_trained(root / "draft", draft_tok, _answers(draft_tok, ANSWERS), seed=3),
        "wrong": save_trained(root / "wrong", draft_tok, _answers(draft_tok, shuffled), seed=4),
    }


def _greedy(target, draft: str | None, prompt: str, gamma: int = 4):
    speculator = Speculator(target, build_drafter(draft, target), gamma)
    return speculator.generate(prompt, max_new_tokens=12, chat=False, temperature=0.0)


@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_a_draft_of_another_vocabulary_is_kept_where_it_agrees(
    trained: dict[str, Path], runtime: str
) -> None:
    """Greedy: token for token plain decoding; the draft model trained on the same answers
    in its own vocabulary has most of its drafts kept (its text, re-encoded, is the
    target's), the control trained on other answers few."""
    target = load_target(str(trained["target"]), runtime)
    drafter = build_drafter(f"text:{trained['draft']}", target)
    assert isinstance(drafter, TextBridgeDrafter) and drafter.name.startswith("text:")
    for prompt, answer in zip(["the cat", "a dog"], ANSWERS, strict=True):
        plain = _greedy(target, None, prompt)
        assert plain.text.strip().startswith(answer)  # the target learnt its answer
        bridged = _greedy(target, f"text:{trained['draft']}", prompt)
        control = _greedy(target, f"text:{trained['wrong']}", prompt)
        assert bridged.token_ids == plain.token_ids == control.token_ids
        kept = bridged.stats.accepted_tokens / bridged.stats.drafted_tokens
        kept_control = control.stats.accepted_tokens / max(1, control.stats.drafted_tokens)
        assert kept > 0.8 > 0.3 > kept_control, (kept, kept_control)
        assert bridged.stats.target_calls < plain.stats.target_calls / 2


def test_batched_rows_drafting_through_the_bridge_each_decode_as_alone(
    trained: dict[str, Path],
) -> None:
    """Rows of a batch, each with its own bridged drafter over one draft model (a cache
    slot each), decode what each decodes alone with plain greedy decoding, and draft."""
    import torch

    from speculative.engine.batch import BatchEngine, BatchRequest
    from speculative.engine.stopping import StopCriteria
    from speculative.sampling import SamplingParams

    target = load_target(str(trained["target"]), "native")
    prompts = [target.tokenizer(p)["input_ids"] for p in ("the cat", "a dog", "the cat sat")]
    greedy, stop = SamplingParams(temperature=0.0), StopCriteria(max_new_tokens=10)

    def requests(draft: str | None) -> list[BatchRequest]:
        return [
            BatchRequest(ids, greedy, stop, torch.Generator(), build_drafter(draft, target), 3)
            for ids in prompts
        ]

    alone = [BatchEngine(target.lm, max_batch=1).run([r])[0] for r in requests(None)]
    together = BatchEngine(target.lm, max_batch=3).run(requests(f"text:{trained['draft']}"))
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert sum(r.stats.accepted_tokens for r in together) > 10


def test_sampling_through_the_bridge_is_the_targets_law(tmp_path: Path) -> None:
    """`speculative check` on the tiny fixture with a random draft model of another
    vocabulary: the drafts are point masses the verifier treats as such, so the sampled
    continuations follow the target's enumerated law; the accept-all control (every draft
    kept) is detected, so the check could see a broken rule here."""
    target_folder = tiny_target_folder(tmp_path)
    draft = save_tiny(tmp_path / "draft", seed=5, tokenizer=tiny_tokenizer(OTHER_WORDS))
    target = load_target(str(target_folder), "native", "fp32")
    config = CheckConfig(f"text:{draft}", samples=400, length=2, temperature=1.0)
    report = run_check(target, config, [list(TINY_PROMPTS[0])])
    assert report.exact and report.control_detected
    assert report.min_p(report.comparisons) > 1e-3 > report.min_p(report.control)


@pytest.mark.real_model
def test_the_draft_encoding_grows_as_a_whole_encoding_would() -> None:
    """The draft tokenizer's ids of a text growing by a few characters a round (the
    default model's byte-level BPE), re-encoding only the end, equal the whole text's
    encoding every round, and the characters re-encoded do not grow with the text; the
    control, keeping every token whose text did not change (none re-encoded before the
    change), differs from the whole encoding."""
    import random

    from speculative.drafters import text_bridge
    from speculative.targets import load_target

    tokenizer = load_target("default").tokenizer
    text = Path(__file__).with_name("test_native.py").read_text()[:6000]
    rng = random.Random(0)
    cuts = [*sorted(rng.sample(range(1, len(text)), 300)), len(text)]
    encoding = text_bridge._DraftEncoding(tokenizer)
    encoded: list[int] = []  # characters encoded each round

    def encode(piece: str):
        encoded.append(len(piece))
        return original(piece)

    original, encoding._encode = encoding._encode, encode
    for cut in cuts:
        assert encoding.ids_for(text[:cut]) == tokenizer.encode(
            text[:cut], add_special_tokens=False
        )
    assert max(encoded[-100:]) < 200 < len(text)
    careless = text_bridge._DraftEncoding(tokenizer)
    kept = text_bridge._REENCODED
    text_bridge._REENCODED = 0
    try:
        wrong = sum(
            careless.ids_for(text[:cut]) != tokenizer.encode(text[:cut], add_special_tokens=False)
            for cut in cuts
        )
    finally:
        text_bridge._REENCODED = kept
    assert wrong > 10


def test_a_bridged_drafter_is_costed_by_its_proposals_and_stops_at_its_context(
    tmp_path: Path,
) -> None:
    """c of a bridged drafter whose vocabulary is smaller than the target's is measured
    (its proposals timed: the draft model never sees target ids); past the draft model's
    context it drafts nothing, and decoding goes on exactly."""
    from speculative.drafters.base import draft_model_of

    target = load_target(str(tiny_target_folder(tmp_path)), "native", "fp32")
    small = tiny_tokenizer(["the", "cat", "dog", "sat"])  # 6 ids: target ids reach 19
    draft = save_tiny(tmp_path / "small", seed=2, tokenizer=small, max_positions=16)
    drafter = build_drafter(f"text:{draft}", target)
    assert draft_model_of(drafter) is None
    speculator = Speculator(target, drafter, 3)
    speculator.calibrate(max_k=3, repeats=1)
    assert speculator.draft_cost is not None and speculator.draft_cost > 0
    from speculative.models.native import load_native

    short = TextBridgeDrafter(  # a draft model whose cache holds 16 positions
        load_native(draft, max_length=16), small, target.tokenizer, frozenset({1})
    )
    kwargs = {"max_new_tokens": 8, "chat": False, "temperature": 0.0}
    plain = Speculator(target, None, 1)
    for words, drafts in ((4, True), (24, False)):  # 24 draft tokens > 16
        prompt = " ".join((["the", "cat", "sat", "on", "the", "mat"] * 4)[:words])
        bridged = Speculator(target, short, 3).generate(prompt, **kwargs)
        assert bridged.token_ids == plain.generate(prompt, **kwargs).token_ids
        assert (bridged.stats.drafted_tokens > 0) == drafts


def test_a_mismatched_draft_names_the_bridge_and_a_bare_text_is_an_error(
    trained: dict[str, Path],
) -> None:
    target = load_target(str(trained["target"]), "native")
    with pytest.raises(VocabularyMismatchError, match="--draft text:"):
        build_drafter(str(trained["draft"]), target)
    with pytest.raises(ValueError, match="names the draft model"):
        build_drafter("text", target)
