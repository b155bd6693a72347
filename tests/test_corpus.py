"""Corpus lookup: the suffix index against a brute-force search, the vote, the stored
corpus and its tokenizer check, `build-corpus`, and the drafter on a tiny seeded model
(lossless, and right where the corpus holds the target's own answers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from speculative.cli.main import main
from speculative.corpora.store import (
    SEPARATOR,
    CorpusMismatch,
    join_documents,
    load_corpus,
    save_corpus,
    tokenizer_fingerprint,
)
from speculative.drafters.corpus import CorpusDrafter, SuffixIndex
from speculative.drafters.registry import build_drafter
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.models.markov import MarkovLM, stochastic_matrix
from speculative.sampling import SamplingParams
from speculative.targets import load_target
from tiny import WORDS, save_tiny, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0)


def brute_longest(corpus: list[int], context: list[int], limit: int) -> tuple[int, list[int]]:
    """(the longest suffix of ``context`` of at most ``limit`` tokens found in ``corpus``,
    the corpus indices right after each of its occurrences)."""
    best, after = 0, []
    for length in range(1, min(limit, len(context)) + 1):
        pattern = context[-length:]
        found = [
            i + length for i in range(len(corpus) - length + 1) if corpus[i : i + length] == pattern
        ]
        if not found:
            break
        best, after = length, found
    return best, after


def test_suffix_index_agrees_with_a_brute_force_search():
    """Longest match, its occurrences and where their continuations start, on random
    corpora of a 4-token vocabulary with document separators (no match may cross one)."""
    rng = np.random.default_rng(0)
    for trial in range(6):
        corpus = rng.integers(0, 4, 600)
        corpus[rng.random(600) < 0.03] = SEPARATOR
        index, listed = SuffixIndex(corpus), corpus.tolist()
        for _ in range(60):
            context = rng.integers(0, 4, 30).tolist()
            match = index.match(context, 12)
            length, after = brute_longest(listed, context, 12)
            assert (match.length if match else 0) == length, (trial, context)
            if match is not None:
                assert match.occurrences == len(after)
                assert sorted(index.starts(match, voters=10**6)) == after


def test_the_vote_takes_what_most_occurrences_continue_with_and_stops_at_a_document_end():
    corpus = join_documents([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [7, 1, 2]])
    index = SuffixIndex(corpus)
    match = index.match([9, 1, 2], 8)
    assert (match.length, match.occurrences) == (2, 4)
    assert index.vote(match, 3) == [3, 4]  # 2 of 3 go on with 3; the documents end after 4
    assert index.continuations(match, 3, limit=4) == [[3, 4], [5, 6]]
    lone = index.match([7, 1, 2], 8)  # only the last document: it ends right there
    assert (lone.length, index.vote(lone, 3)) == (3, [])


def test_a_stored_corpus_refuses_another_tokenizer(tmp_path):
    tokenizer = tiny_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer, len(tokenizer.get_vocab()))
    tokens = join_documents([[3, 4, 5], [6, 7]])
    save_corpus(tmp_path / "c", tokens, fingerprint, "tiny", "test")
    loaded = load_corpus(tmp_path / "c", fingerprint)
    assert torch.equal(torch.from_numpy(loaded.tokens), torch.from_numpy(tokens))
    assert loaded.documents == 2
    other = tiny_tokenizer(list(reversed(WORDS)))  # same size, other ids
    with pytest.raises(CorpusMismatch, match="tokenized for 'tiny'"):
        load_corpus(tmp_path / "c", tokenizer_fingerprint(other, len(other.get_vocab())))


def _answers(folder: Path, path: Path, records: int, seed: int) -> Path:
    """The target's own greedy continuations of random word prompts (JSONL of ids)."""
    rng = random.Random(seed)
    target = load_target(str(folder), "native", "fp32", "torch")
    engine = SpeculativeEngine(target.lm, None)
    lines = []
    for _ in range(records):
        prompt = [rng.randrange(2, len(WORDS) + 2) for _ in range(4)]
        out = engine.generate(prompt, GREEDY, StopCriteria(max_new_tokens=40), torch.Generator())
        lines.append(json.dumps({"ids": prompt + out.token_ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model, corpora of its own answers and of another model's (built with the
    CLI), and fresh prompts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before single_thread
    root = tmp_path_factory.mktemp("corpus")
    model = save_tiny(root / "model", seed=0, layers=2)
    other = save_tiny(root / "other", seed=7, layers=2)
    out = {"model": model}
    for name, folder in (("own", model), ("others", other)):
        data = _answers(folder, root / f"{name}.jsonl", records=60, seed=1)
        code = main(["build-corpus", "--target", str(model), "--data", str(data),
                     "--out", str(root / name), "--json"])  # fmt: skip
        assert code == 0
        out[name] = root / name
    torch.set_num_threads(threads)
    return out


def _run(target, drafter, prompts, gamma=4):
    """Outputs and (drafted, accepted) over the prompts."""
    engine = SpeculativeEngine(target.lm, drafter, gamma)
    outputs, drafted, accepted = [], 0, 0
    for prompt in prompts:
        result = engine.generate(prompt, GREEDY, StopCriteria(max_new_tokens=40), torch.Generator())
        outputs.append(result.token_ids)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return outputs, drafted, accepted


def test_corpus_drafts_change_no_token_of_a_tiny_llama(tiny):
    """Fresh prompts, greedy, native kernels: every output equals plain decoding's, with a
    corpus of the target's own answers and with one of another model's."""
    target = load_target(str(tiny["model"]), "native", "fp32")
    rng = random.Random(99)
    prompts = [[rng.randrange(2, len(WORDS) + 2) for _ in range(4)] for _ in range(12)]
    plain, _, _ = _run(target, None, prompts)
    for name in ("own", "others"):
        drafter = build_drafter(f"corpus:{tiny[name]}", target)
        assert isinstance(drafter, CorpusDrafter)
        outputs, drafted, _ = _run(target, drafter, prompts)
        assert outputs == plain, name
        assert drafted > 0, name  # the corpus did draft: the equality tested something


def markov_samples(matrix: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` sequences sampled from a Markov chain, as one corpus."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        token, doc = int(rng.integers(len(matrix))), []
        for _ in range(length):
            doc.append(token)
            token = int(rng.choice(len(matrix), p=matrix[token]))
        documents.append(doc)
    return join_documents(documents)


def test_a_corpus_of_the_targets_own_samples_drafts_right():
    """Sampling at temperature 1 from a Markov target: drafts voted from its own samples
    are accepted far more often than drafts from another chain's samples (the control),
    and sampling stays exact either way (tests/test_engine_markov.py)."""
    target_matrix = stochastic_matrix(np.random.default_rng(2), 5, 0.3)
    other_matrix = stochastic_matrix(np.random.default_rng(9), 5, 0.3)
    rates = {}
    for name, matrix in (("own", target_matrix), ("other", other_matrix)):
        drafter = CorpusDrafter(SuffixIndex(markov_samples(matrix, 300, 30, seed=1)))
        engine = SpeculativeEngine(MarkovLM(target_matrix), drafter, 3)
        generator = torch.Generator().manual_seed(0)
        drafted = accepted = 0
        for _ in range(200):
            result = engine.generate(
                [0, 3], SamplingParams(), StopCriteria(max_new_tokens=12), generator
            )
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
        rates[name] = accepted / drafted
    assert rates["own"] > rates["other"] + 0.3, rates  # measured: 0.60 and 0.09


def test_corpus_names_resolve_and_fail_clearly(tiny, tmp_path, capsys):
    target = load_target(str(tiny["model"]), "hf", "fp32")
    with pytest.raises(ValueError, match="no corpus ships for"):
        build_drafter("corpus", target)
    with pytest.raises(ValueError, match="is not a drafting corpus"):
        build_drafter(f"corpus:{tmp_path}", target)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = ["build-corpus", "--target", str(tiny["model"]), "--data", str(empty), "--out"]
    assert main([*args, str(tmp_path / "x")]) == 2
    assert "the data holds no records" in capsys.readouterr().err
