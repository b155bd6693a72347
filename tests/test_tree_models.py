"""Tree forwards, cache compaction and tree speculation on tiny real models (native, HF)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import broken
from speculative.drafters import DraftModelDrafter
from speculative.drafters.tree import TreeShape
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.tree import TreeRound
from speculative.models.hf import HFCausalLM
from speculative.models.native import load_native
from speculative.models.session import ModelSession
from speculative.sampling import SamplingParams, verify_tree
from test_native import require_kernels
from tiny import save_tiny, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 64
# root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {5}; 5 -> {6}
TOKENS = [11, 42, 7, 19, 33, 50, 5]
PARENTS = [-1, -1, 0, 0, 1, 2, 5]
PATHS = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5], 6: [0, 2, 5, 6]}
CATCH_UP = 3  # the session feeds 3 committed tokens (the root last) with the tree


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tree_tiny"), seed=0, layers=2, vocab=VOCAB)


@pytest.fixture(params=["kernels", "torch"])
def backend(request):
    if request.param == "kernels":
        require_kernels()
    return request.param


def context(length: int) -> list[int]:
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


def chain_logits(model, ctx, path_tokens, tail=()):
    """Reference: the committed context, then CATCH_UP + path tokens as one causal chain,
    then ``tail`` fed.   returns: chain logits [CATCH_UP + len(path), V], tail logits."""
    model.reset()
    model.forward(torch.tensor([ctx[:-CATCH_UP]]))
    chain = ctx[-CATCH_UP:] + path_tokens
    logits = model.forward(torch.tensor([chain]))[0]  # [len(chain), V]
    after = model.forward(torch.tensor([list(tail)]))[0] if tail else None
    return logits, after


def assert_same(a, b, exact, where=""):
    """Bitwise on the kernels (attention reads the visible slots in slot order, so a node
    sees exactly its chain's keys); the torch decoder reduces over every cache slot with
    masked ones zero, so a key's slot changes the rounding: fp32 noise, same argmax."""
    if exact:
        assert torch.equal(a, b), where
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), where


def tree_session(model, ctx):
    session = ModelSession(model)
    session.sync(ctx[:-CATCH_UP])
    logits = session.logits_for_tree(ctx, TOKENS, PARENTS)[0]  # [1 + n, V]
    return session, logits


@pytest.mark.parametrize("length", [8, 126])  # 126: the tree crosses a 128-slot chunk
def test_native_tree_logits_equal_chains(folder, backend, length):
    model = load_native(folder, max_length=256, backend=backend)
    ctx = context(length)
    _, tree = tree_session(model, ctx)
    for node, path in PATHS.items():
        chain, _ = chain_logits(model, ctx, [TOKENS[i] for i in path])
        assert_same(tree[node + 1], chain[-1], backend == "kernels", f"node {node}")
        assert_same(tree[0], chain[CATCH_UP - 1], backend == "kernels", "root")


def test_native_wide_tree_spans_attention_tiles(folder):
    """A tree of 37 nodes (40 rows with the catch-up: more than one 16-row tile of the
    kernels' attention) gives every node bitwise its chain's logits."""
    require_kernels()
    model = load_native(folder, max_length=256, backend="kernels")
    ctx = context(60)
    g = torch.Generator().manual_seed(3)
    nodes = 37
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) if i % 5 else -1
                      for i in range(1, nodes)]  # fmt: skip
    tokens = torch.randint(0, VOCAB, (nodes,), generator=g).tolist()
    session = ModelSession(model)
    session.sync(ctx[:-CATCH_UP])
    tree = session.logits_for_tree(ctx, tokens, parents)[0]  # [1 + nodes, V]
    for node in (0, 5, 16, 17, 29, 36):
        path, at = [], node
        while at >= 0:
            path.insert(0, at)
            at = parents[at]
        chain, _ = chain_logits(model, ctx, [tokens[i] for i in path])
        assert torch.equal(tree[node + 1], chain[-1]), f"node {node} (path {path})"


@pytest.mark.parametrize("path", [[0, 2, 5, 6], [1, 4], [0, 3], []])
def test_native_compaction_continues_bitwise(folder, backend, path):
    model = load_native(folder, max_length=256, backend=backend)
    ctx = context(126)
    session, _ = tree_session(model, ctx)
    session.keep_path(path)
    path_tokens = [TOKENS[i] for i in path]
    assert session.cached == ctx + path_tokens
    assert model.cache_length == len(ctx) + len(path)
    # the features of the catch-up and of the kept nodes (what drafting heads read)
    # follow them, as if the accepted path had been fed as a chain
    features = session.features  # [len(ctx) + len(path), hidden]
    assert features is not None and features.shape[0] == len(ctx) + len(path)
    chain_session = ModelSession(load_native(folder, max_length=256, backend=backend))
    chain_session.sync(ctx[:-CATCH_UP])
    chain_session.sync(ctx + path_tokens)
    assert_same(features, chain_session.features, backend == "kernels", "features")
    tail = [9, 21, 4]
    after = session.logits_after(ctx + path_tokens + tail[:1], tail[1:])[0]  # [3, V]
    _, reference = chain_logits(model, ctx, path_tokens, tail)
    assert_same(after, reference, backend == "kernels")


def test_hf_tree_logits_and_compaction_match_chains():
    lm = HFCausalLM(tiny_llama(0, VOCAB, 2))
    reference = HFCausalLM(tiny_llama(0, VOCAB, 2))
    ctx = context(12)
    session, tree = tree_session(lm, ctx)
    for node, path in PATHS.items():
        path_tokens = [TOKENS[i] for i in path]
        chain, _ = chain_logits(reference, ctx, path_tokens)
        torch.testing.assert_close(tree[node + 1], chain[-1], atol=1e-5, rtol=1e-5)
    session.keep_path([0, 2, 5])
    path_tokens = [TOKENS[i] for i in (0, 2, 5)]
    assert lm.cache_length == len(ctx) + 3
    tail = [9, 21, 4]
    after = session.logits_after(ctx + path_tokens + tail[:1], tail[1:])[0]
    _, expected = chain_logits(reference, ctx, path_tokens, tail)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_keep_slots_validation(folder):
    model = load_native(folder, max_length=64, backend="torch")
    model.forward(torch.tensor([context(10)]))
    with pytest.raises(ValueError, match="increasing"):
        model.keep_slots(5, [7, 6])
    with pytest.raises(ValueError, match="lie in"):
        model.keep_slots(5, [4])
    session = ModelSession(model)
    with pytest.raises(ValueError, match="keep_path"):
        session.keep_path([0])


SHAPES = [TreeShape("static", branching=(2, 2, 1)), TreeShape("dynamic", depth=4, width=2)]


def tree_engine(target_lm, draft_lm, shape, budget=8, verifier=verify_tree):
    drafter = DraftModelDrafter(draft_lm, target_lm.vocab_size, "draft")
    drafter.set_tree_shape(shape)
    return SpeculativeEngine(target_lm, drafter, tree=TreeRound(drafter, budget, verifier))


def greedy_ids(engine, prompt, n=30):
    stop = StopCriteria(max_new_tokens=n)
    return engine.generate(prompt, SamplingParams(temperature=0), stop, torch.Generator())


@pytest.mark.parametrize("shape", SHAPES, ids=["static", "dynamic"])
@pytest.mark.parametrize("runtime", ["kernels", "torch", "hf"])
def test_greedy_tree_identical_to_plain(folder, shape, runtime):
    if runtime == "hf":
        target = HFCausalLM(tiny_llama(0, VOCAB, 2))
        draft = HFCausalLM(tiny_llama(0, VOCAB, 2)).to_dtype(torch.bfloat16)
    else:
        if runtime == "kernels":
            require_kernels()
        target = load_native(folder, max_length=256, backend=runtime)
        draft = load_native(folder, "int4", max_length=256, backend=runtime)
    prompt = context(9)
    plain = greedy_ids(SpeculativeEngine(target, None), prompt).token_ids
    result = greedy_ids(tree_engine(target, draft, shape), prompt)
    assert result.token_ids == plain
    assert result.stats.acceptance_rate > 0  # the tree actually contributed tokens
    assert result.stats.mean_accepted_length > 1.3


SMALL = 8  # vocabulary of the sampling tests: sequence space 8 ** 2


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """A flat target and an unrelated draft over 8 tokens (native, the fast runtime)."""
    base = tmp_path_factory.mktemp("tree_small")
    target = save_tiny(base / "t", seed=3, layers=2, vocab=SMALL, scale=0.3)
    draft = save_tiny(base / "d", seed=8, layers=2, vocab=SMALL, scale=0.6)
    return target, draft


def sampled_counts(engine, n, seed, length=2):
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(SMALL**length)
    stop = StopCriteria(max_new_tokens=length)
    for _ in range(n):
        out = engine.generate([2, 3], SamplingParams(), stop, g).token_ids
        counts[int(np.ravel_multi_index(out, (SMALL,) * length))] += 1
    return counts


def p_value(a, b):
    keep = (a + b) > 0
    return float(stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1])


def test_sampled_tree_sequences_match_plain_with_negative_control(small_models):
    """Sampled trees (static; dynamic with siblings at every depth) through the engine on
    a tiny model vs plain sampling (Bonferroni over the two); the same test at the same N
    rejects a verifier that keeps rejected siblings in q."""
    target_dir, draft_dir = small_models
    target = load_native(target_dir, max_length=64)
    draft = load_native(draft_dir, max_length=64)
    static = TreeShape("static", branching=(4, 2))
    dynamic = TreeShape("dynamic", depth=2, width=3, sibling_below=1.0)
    n, alpha = 1500, 1e-3 / 2
    plain = sampled_counts(SpeculativeEngine(target, None), n, seed=1)
    for shape in (static, dynamic):
        spec = sampled_counts(tree_engine(target, draft, shape), n, seed=2)
        assert p_value(plain, spec) > alpha, shape
    wrong_engine = tree_engine(target, draft, static, verifier=broken.tree_keep_rejected_in_q)
    wrong = sampled_counts(wrong_engine, n, seed=2)
    assert p_value(plain, wrong) < alpha


def run_cli(capsys, *argv):
    from speculative.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, *capsys.readouterr()


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_cli_generate_tree(folder, capsys, tree):
    import json

    base = ["generate", "--target", str(folder), "--runtime", "native", "--prompt", "the cat"]
    base += ["--no-chat", "--max-new-tokens", "12", "--json", "--no-color"]
    budget = ["--tree-budget", "auto" if tree == "dynamic" else "5"]
    code, out, err = run_cli(capsys, *base, "--draft", "self-int4", "--tree", tree, *budget)
    assert code == 0, err
    tree_ids = json.loads(out.strip().splitlines()[-1])["token_ids"]
    code, out, err = run_cli(capsys, *base, "--draft", "none")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == tree_ids


def test_cli_tree_errors(folder, capsys):
    code, _, err = run_cli(
        capsys, "generate", "--target", str(folder), "--prompt", "the", "--tree", "bushy"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--tree" in err
    code, _, err = run_cli(
        capsys, "generate", "--target", str(folder), "--prompt", "the", "--tree-budget", "0"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--tree-budget" in err
    from speculative.pipeline import Speculator

    with pytest.raises(ValueError, match="tree must be one of"):
        Speculator.load(str(folder), "ngram", tree="forest")
    with pytest.raises(ValueError, match="tree budget"):
        Speculator.load(str(folder), "ngram", tree="static", tree_budget=0)
