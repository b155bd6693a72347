"""Drafting heads (EAGLE, Medusa, auto) on tiny seeded models trained in-process: features
through the model protocol, lossless greedy and sampled generation, trees, registry,
train-draft end to end, and the wrong-target check."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

import speculative.models.session as session_module
from speculative.drafters.auto import AutoDrafter
from speculative.drafters.eagle import EagleDrafter
from speculative.drafters.registry import REGISTRY, build_drafter
from speculative.drafters.tree import TreeDrafter
from speculative.engine import BatchEngine, BatchRequest, SpeculativeEngine, StopCriteria
from speculative.heads.store import HeadMismatch, load_head
from speculative.models.base import SupportsHiddenStates
from speculative.models.markov import MarkovLM
from speculative.models.native.ckernels import KernelsUnavailable, load_kernels
from speculative.models.session import ModelSession, SlotPool
from speculative.sampling import SamplingParams, verify
from speculative.targets import load_target
from speculative.training.train_draft import TrainDraftOptions, train_draft
from test_engine_markov import NoRepeat
from tiny import WORDS, save_tiny

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [3, 4, 5, 6, 3, 4, 5, 7, 8, 3, 4]
GREEDY = SamplingParams(temperature=0.0)


def write_corpus(path: Path, folder: Path, records: int = 60, seed: int = 0) -> Path:
    """Self-distillation data, as for the real model: the target's own greedy
    continuations of random word prompts (pre-tokenized JSONL)."""
    rng = random.Random(seed)
    target = load_target(str(folder), "native", "fp32", "torch")
    lines = []
    for _ in range(records):
        prompt = [rng.randrange(2, len(WORDS) + 2) for _ in range(4)]
        out = generate(target, None, GREEDY, n=40, prompt=prompt)
        lines.append(json.dumps({"ids": prompt + out.token_ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama folder plus an EAGLE and a Medusa head trained on its features."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("heads")
    model = save_tiny(root / "model", seed=0, layers=2)
    data = write_corpus(root / "data.jsonl", model)
    out = {"model": model, "data": data}
    # "eagle" fuses the target's layer 0 with its feature (EAGLE-3, the default's "auto" on
    # two layers); "eagle-last" reads the last layer's feature alone (EAGLE-1/2); "medusa"
    # trains on "eagle"'s cached features, as the README's recipe does
    for name, method, layers in (
        ("eagle", "eagle", "auto"), ("eagle-last", "eagle", "none"), ("medusa", "medusa", "auto")
    ):  # fmt: skip
        cache = out["eagle"] if method == "medusa" else None
        out[name] = train_small_head(root / name, method, model, data, layers, cache)
    torch.set_num_threads(threads)
    return out


def train_small_head(
    out: Path, method: str, model: Path, data: Path, layers: str, cache_of: Path | None = None
) -> Path:
    """train_draft on the tiny model (60 steps); with ``cache_of`` it resumes on that
    head's cached features (a link to its features folder) instead of extracting."""
    options = TrainDraftOptions(
        out=out, method=method, target=str(model), data=[data], steps=60, draft_vocab=16,
        batch_tokens=1024, lr=3e-3, progress=False, feature_layers=layers,
        matmul_precision="fp32",  # the same heads on every CPU (auto: bf16 where native)
    )  # fmt: skip
    if cache_of is not None:
        out.mkdir(parents=True)
        (out / "features").symlink_to(cache_of / "features", target_is_directory=True)
        options.resume = True
    train_draft(options)
    return out


def target_on(runtime: str, folder: Path):
    if runtime == "hf":
        return load_target(str(folder), "hf", "fp32")
    backend = runtime.removeprefix("native-")
    if backend == "kernels":
        from test_native import require_kernels

        require_kernels()
    return load_target(str(folder), "native", "fp32", backend)


def generate(target, drafter, params, gamma=4, n=40, seed=0, prompt=PROMPT):
    engine = SpeculativeEngine(target.lm, drafter, gamma)
    stop = StopCriteria(max_new_tokens=n)
    return engine.generate(prompt, params, stop, torch.Generator().manual_seed(seed))


# ---- features through the model protocol ------------------------------------------------


@pytest.mark.parametrize("runtime", ["native-kernels", "native-torch", "hf"])
def test_features_give_the_logits_and_follow_the_cache(trained, runtime):
    target = target_on(runtime, trained["model"])
    lm = target.lm
    assert isinstance(lm, SupportsHiddenStates)
    ids = torch.tensor([PROMPT])
    lm.reset()
    logits, features = lm.forward_with_hidden(ids)
    assert features.shape == (1, len(PROMPT), lm.hidden_size)
    assert torch.allclose(features @ lm.output_embedding().T, logits, atol=1e-4)
    lm.reset()
    assert torch.equal(lm.forward(ids), logits)  # the plain forward is unchanged
    session = ModelSession(lm)
    session.logits_after(PROMPT, [9, 10])
    assert session.features.shape[0] == len(PROMPT) + 2
    session.logits_after([*PROMPT[:-1], 11])  # rollback by common prefix, then catch up
    assert session.features.shape[0] == len(PROMPT)
    lm.reset()
    _, fresh = lm.forward_with_hidden(torch.tensor([[*PROMPT[:-1], 11]]))
    assert torch.allclose(session.features, fresh[0], atol=1e-5)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("layers") / "model", seed=1, layers=4)


@pytest.mark.parametrize("runtime", ["native-kernels", "native-torch", "hf"])
def test_layer_features_carry_the_states_after_those_layers(four_layers, runtime):
    """With feature layers (SupportsLayerFeatures) every feature carries, after the usual
    one, the residual stream after each chosen layer: transformers' own hidden states of
    those layers from an independent forward. The logits and the usual feature stay bit
    for bit, and a batch's rows get the features each gets alone."""
    from transformers import AutoModelForCausalLM

    from speculative.models.base import RowInput, SupportsLayerFeatures

    reference = AutoModelForCausalLM.from_pretrained(four_layers).float().eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        states = reference(input_ids=ids, output_hidden_states=True).hidden_states
    assert not torch.allclose(states[1], states[3], atol=1e-2)  # layers tell apart
    lm = target_on(runtime, four_layers).lm
    assert isinstance(lm, SupportsLayerFeatures) and lm.num_layers == 4
    h = lm.hidden_size
    plain_logits, plain = lm.forward_with_hidden(ids)
    lm.set_feature_layers((0, 2))
    lm.reset()
    logits, features = lm.forward_with_hidden(ids)
    assert features.shape == (1, len(PROMPT), 3 * h)
    assert torch.equal(logits, plain_logits) and torch.equal(features[..., :h], plain)
    for i, layer in enumerate((0, 2), 1):
        got = features[0, :, i * h : (i + 1) * h]
        assert torch.allclose(got, states[layer + 1][0], rtol=1e-4, atol=1e-4)
    slots = [lm.acquire_slot(), lm.acquire_slot()]
    tails = (PROMPT[:4], PROMPT)
    rows = [RowInput(slot, torch.tensor(t)) for slot, t in zip(slots, tails, strict=True)]
    _, together = lm.forward_rows_with_hidden(rows)
    assert together.shape == (4 + len(PROMPT), 3 * h)
    assert torch.allclose(together[4:], features[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(together[:4], features[0, :4], rtol=1e-5, atol=1e-5)
    if runtime.startswith("native"):  # rows are computed alone: the same bits
        assert torch.equal(together[4:], features[0])
    for slot in slots:
        lm.release_slot(slot)
    lm.set_feature_layers(())
    lm.reset()
    assert torch.equal(lm.forward_with_hidden(ids)[1], plain)
    with pytest.raises(ValueError, match="increasing indices in \\[0, 3\\)"):
        lm.set_feature_layers((3,))  # the last layer's state is the usual feature
    with pytest.raises(ValueError, match="increasing"):
        lm.set_feature_layers((2, 0))


def test_eagle3_layers_are_a_low_a_middle_and_a_high_layer():
    from speculative.models.base import eagle3_layers

    assert eagle3_layers(30) == (2, 15, 27)  # the default model
    assert eagle3_layers(32) == (2, 16, 29)
    assert eagle3_layers(4) == (1, 2)  # below the last layer, without repeats
    assert eagle3_layers(2) == (0,)
    assert eagle3_layers(1) == ()


def test_a_fused_head_sets_its_layers_and_refuses_what_cannot_give_them(trained, tmp_path):
    """Loading a head that fuses middle layers has the target give them; a runtime
    without them, another head's layers, or resuming features of other layers are clear
    errors."""
    from speculative.heads.store import give_layer_features

    config = json.loads((trained["eagle"] / "config.json").read_text())
    assert config["head"]["feature_layers"] == [0]  # "auto" on two layers
    assert config["training"]["feature_layers"] == [0]
    assert (
        json.loads((trained["eagle-last"] / "config.json").read_text())["head"]["feature_layers"]
        == []
    )
    lm = target_on("native-kernels", trained["model"]).lm
    assert lm.feature_layers == ()
    head = load_head(trained["eagle"], lm)
    assert head.config.feature_layers == (0,) and lm.feature_layers == (0,)
    with pytest.raises(ValueError, match="already gives the states of layers \\[0\\]"):
        give_layer_features(lm, (1,))
    with pytest.raises(ValueError, match="cannot give middle-layer features"):
        give_layer_features(MarkovLM(torch.full((4, 4), 0.25)), (0,))
    options = TrainDraftOptions(
        out=tmp_path / "head", target=str(trained["model"]), data=[trained["data"]], steps=2,
        draft_vocab=16, batch_tokens=512, progress=False, feature_layers="none",
    )  # fmt: skip
    train_draft(options)
    options.resume, options.feature_layers = True, "auto"
    with pytest.raises(ValueError, match="holds features of layers none"):
        train_draft(options)
    options.resume, options.feature_layers = False, "0,1"
    with pytest.raises(ValueError, match="increasing indices in \\[0, 1\\)"):
        train_draft(options)


@pytest.mark.parametrize(("method", "reference"), [("medusa", "medusa"), ("eagle", "eagle-last")])
def test_a_head_of_no_layers_trains_the_same_on_a_fused_cache(trained, tmp_path, method, reference):
    """A head that reads the last layer's feature alone (Medusa; EAGLE with
    --feature-layers none) resumes on a cache that also holds middle layers ("eagle"'s,
    where "medusa" trained) and learns exactly what it learns on a cache of the feature
    alone ("eagle-last"'s): the same weights, bit for bit."""
    cache = trained["eagle"] if method == "eagle" else trained["eagle-last"]
    wide = json.loads((trained["eagle"] / "features" / "meta.json").read_text())
    assert wide["feature_layers"] == [0]
    layers = "none" if method == "eagle" else "auto"
    head = train_small_head(tmp_path / "head", method, trained["model"], trained["data"],
                            layers, cache)  # fmt: skip
    target = target_on("native-torch", trained["model"])
    got = load_head(head, target.lm).module.state_dict()
    want = load_head(trained[reference], target.lm).module.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_session_computes_features_only_when_asked(trained):
    """Plain decoding does not pay for features: a session told not to keep them gives the
    same logits and none; asked again over cached positions that have none, it starts
    afresh and its features equal a fresh session's."""
    lm = target_on("native-kernels", trained["model"]).lm
    kept = ModelSession(lm)
    want = kept.logits_after(PROMPT, [9, 10])
    want_features = kept.features.clone()
    session = ModelSession(lm)
    session.keep_features(False)
    assert torch.equal(session.logits_after(PROMPT, [9, 10]), want)
    assert session.features is None
    session.keep_features(True)
    assert torch.equal(session.logits_after(PROMPT, [9, 10]), want)
    assert torch.equal(session.features, want_features)


def test_a_model_without_features_is_a_clear_error(trained):
    from speculative.heads.store import require_features

    with pytest.raises(ValueError, match="cannot return its hidden states"):
        require_features(MarkovLM(torch.full((4, 4), 0.25)))


# ---- lossless generation -----------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["native-kernels", "native-torch", "hf"])
@pytest.mark.parametrize("name", ["eagle", "eagle-last", "medusa", "auto"])
def test_greedy_equals_plain_greedy(trained, runtime, name):
    target = target_on(runtime, trained["model"])
    folder = trained[name if name in ("medusa", "eagle-last") else "eagle"]
    drafter = build_drafter(f"{name.removesuffix('-last')}:{folder}", target)
    plain = generate(target, None, GREEDY).token_ids
    for gamma in (1, 4):
        out = generate(target, drafter, GREEDY, gamma)
        assert out.token_ids == plain
    if name == "auto":  # drafts only where it pays (here: the head's explore rounds at
        # least; the tiny target's steps cost little beside the head's)
        assert out.stats.drafted_tokens > 0
    else:
        assert out.stats.accepted_tokens > 0  # the head is really drafting


ROW_PROMPTS = ([3, 4, 5, 6, 3, 4], [7, 8, 9, 3, 4, 5, 6, 7], [5, 5, 6, 9, 10])
ROW_PARAMS = (GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9))


class ShiftedFeaturesPool(SlotPool):
    """Negative control: a pool that hands every row its features one position off (the
    feature of the previous token at each position), so a head drafts from misaligned
    features."""

    def _keep_features(self, sessions, rows, features):
        sizes = [row.input_ids.numel() for row in rows]
        shifted = [part.roll(1, dims=0) for part in features.split(sizes)]
        super()._keep_features(sessions, rows, torch.cat(shifted))


def row_drafter(target, name, folder, window=None):
    """A row's own head drafter (EAGLE: with catch-up ``window`` if given)."""
    drafter = build_drafter(f"{name}:{folder}", target)
    if window is not None:
        drafter.window = window
    return drafter


def batch_rows(target, name, folder, pool=None, n=30, window=None):
    """The three ROW_PROMPTS decoded together (each with its own head instance, sampling
    settings and seed); returns their results."""
    engine = BatchEngine(target.lm, max_batch=3, pool=pool)
    requests = [
        BatchRequest(prompt, params, StopCriteria(max_new_tokens=n),
                     torch.Generator().manual_seed(10 + i),
                     row_drafter(target, name, folder, window), 3)
        for i, (prompt, params) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS, strict=True))
    ]  # fmt: skip
    return engine.run(requests)


@pytest.mark.parametrize("runtime", ["native-kernels", "native-torch", "hf"])
@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_batched_rows_draft_from_their_own_features(trained, runtime, name):
    """In a batch each row's head reads its own row's features from its cache slot: every
    row's tokens, drafts and acceptances are those of the row decoded alone (greedy and
    seeded sampling rows side by side). Control: a pool that hands each row its features
    one position off changes the drafts."""
    target = target_on(runtime, trained["model"])
    folder = trained[name]
    alone = []
    for i, (prompt, params) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS, strict=True)):
        drafter = build_drafter(f"{name}:{folder}", target)
        alone.append(generate(target, drafter, params, 3, n=30, seed=10 + i, prompt=prompt))
    together = batch_rows(target, name, folder)
    drafts = lambda r: (r.stats.drafted_tokens, r.stats.accepted_tokens, r.stats.positions.accepted)  # noqa: E731
    assert sum(r.stats.accepted_tokens for r in together) > 0  # the heads really draft
    for one, row in zip(alone, together, strict=True):
        assert row.token_ids == one.token_ids
        if runtime != "hf":  # native rows are bitwise their runs alone; hf pads (rounding)
            assert drafts(row) == drafts(one)
    if runtime != "hf":
        swapped = batch_rows(target, name, folder, ShiftedFeaturesPool(target.lm))
        assert [drafts(r) for r in swapped] != [drafts(r) for r in together]
        assert swapped[0].token_ids == together[0].token_ids  # still lossless (greedy row)


def test_batched_rows_with_windowed_catch_ups_draft_as_alone(trained):
    """Rows whose heads each skipped pairs of their own prompt (a catch-up window of 4:
    each row's cache starts at its own pair, so a shared head step takes each row's
    positions from its own start) draft in a batch bitwise as alone."""
    target = target_on("native-kernels", trained["model"])
    folder = trained["eagle"]
    alone = []
    for i, (prompt, params) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS, strict=True)):
        drafter = row_drafter(target, "eagle", folder, window=4)
        alone.append(generate(target, drafter, params, 3, n=30, seed=10 + i, prompt=prompt))
    together = batch_rows(target, "eagle", folder, window=4)
    drafts = lambda r: (r.stats.drafted_tokens, r.stats.accepted_tokens, r.stats.positions.accepted)  # noqa: E731
    assert sum(r.stats.accepted_tokens for r in together) > 0
    for one, row in zip(alone, together, strict=True):
        assert row.token_ids == one.token_ids and drafts(row) == drafts(one)
    whole = batch_rows(target, "eagle", folder)  # the window changes the drafts
    assert [drafts(r) for r in whole] != [drafts(r) for r in together]


class OtherRowsSlot:
    """Negative control: a head runner seen through a proxy whose cache slot is another
    row's, as a shared step that mixed up the rows' caches would use."""

    def __init__(self, runner, slot: int) -> None:
        self.runner, self.slot = runner, slot

    @property
    def length(self) -> int:
        return self.runner.length

    @length.setter
    def length(self, value: int) -> None:
        self.runner.length = value


def mix_rows_in_shared_steps(monkeypatch, name: str) -> None:
    """Negative control: the shared head step hands rows each other's state (EAGLE: every
    row reads and writes the first row's cache slot; Medusa: each row gets the next
    row's feature)."""
    from speculative.heads.runners import KernelEagleHead, KernelMedusaRunner

    if name == "eagle":
        step_rows = KernelEagleHead.step_rows

        def mixed(self, runners, *inputs):
            proxies = [OtherRowsSlot(r, runners[0].slot) for r in runners]
            return step_rows(self, proxies, *inputs)

        monkeypatch.setattr(KernelEagleHead, "step_rows", mixed)
    else:
        many = KernelMedusaRunner.many
        monkeypatch.setattr(
            KernelMedusaRunner, "many", lambda self, f, counts: many(self, f.roll(1, 0), counts)
        )


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_rows_of_one_head_draft_in_shared_steps(trained, name, monkeypatch):
    """On the C kernels the rows' heads share one packed copy (the registry builds it once
    per target) and draft in shared steps: one call per draft position for every row,
    each weight read once. Each row's drafts, acceptances and draft-call counts are still
    bitwise those it gets alone. Control: a shared step that mixes the rows' states up
    changes the drafts (and stays lossless)."""
    from speculative.heads.runners import KernelEagleHead, KernelMedusaRunner

    target = target_on("native-kernels", trained["model"])
    folder = trained[name]
    first, second = (build_drafter(f"{name}:{folder}", target) for _ in range(2))
    assert first.row_group() is not None and first.row_group() is second.row_group()
    alone = []
    for i, (prompt, params) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS, strict=True)):
        drafter = build_drafter(f"{name}:{folder}", target)
        alone.append(generate(target, drafter, params, 3, n=30, seed=10 + i, prompt=prompt))
    shared = [0]
    step = {"eagle": (KernelEagleHead, "step_rows"), "medusa": (KernelMedusaRunner, "many")}
    kind, method = step[name]
    original = getattr(kind, method)

    def counted(self, *args):
        shared[0] += 1
        return original(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(kind, method, counted)
        together = batch_rows(target, name, folder)
    rounds = max(len(r.rounds) for r in together)
    assert shared[0] >= rounds - 2  # nearly every round drafts in shared calls
    own = lambda r: (r.token_ids, r.stats.drafted_tokens, r.stats.accepted_tokens,  # noqa: E731
                     r.stats.positions.accepted, r.stats.draft_calls)  # fmt: skip
    assert [own(r) for r in together] == [own(r) for r in alone]
    mix_rows_in_shared_steps(monkeypatch, name)
    mixed = batch_rows(target, name, folder)
    assert [own(r)[1:] for r in mixed] != [own(r)[1:] for r in together]
    assert mixed[0].token_ids == together[0].token_ids  # still lossless (greedy row)


def test_head_cache_slots_are_freed_with_their_drafters(trained):
    """A drafter's head runner holds a cache slot of the target's shared head kernels
    until the drafter is dropped: building and dropping drafters one after another reuses
    the same slot, and slots grow only while drafters are alive."""
    import gc

    target = target_on("native-kernels", trained["model"])
    spec = f"eagle:{trained['eagle']}"
    kernels = build_drafter(spec, target).row_group()
    gc.collect()
    for _ in range(20):
        drafter = build_drafter(spec, target)
        generate(target, drafter, GREEDY, 3, n=4)
        del drafter
    gc.collect()
    assert kernels.slots <= 2  # the chain's slot, freed and taken again (plus growth)
    alive = [build_drafter(spec, target) for _ in range(5)]
    assert len({d.chain.runner.slot for d in alive}) == 5 and kernels.slots >= 5


def test_auto_rows_choosing_the_head_draft_in_one_shared_step(trained, monkeypatch):
    """``auto`` rows of a batch each choose for themselves (their own estimates, n-gram
    matches and timings: a learner, so not bitwise their runs alone); the rows that
    choose the head in a round draft in one shared call. Greedy rows stay plain greedy
    decoding's tokens."""
    from speculative.heads.runners import KernelEagleHead

    target = target_on("native-kernels", trained["model"])
    folder = trained["eagle"]
    plain = [generate(target, None, GREEDY, n=30, prompt=p).token_ids for p in ROW_PROMPTS]
    rows = [0]
    step_rows = KernelEagleHead.step_rows

    def counted(self, runners, *inputs):
        rows[0] = max(rows[0], len(runners))
        return step_rows(self, runners, *inputs)

    monkeypatch.setattr(KernelEagleHead, "step_rows", counted)
    engine = BatchEngine(target.lm, max_batch=3)
    drafters = [build_drafter(f"auto:{folder}", target) for _ in ROW_PROMPTS]
    requests = [
        BatchRequest(prompt, GREEDY, StopCriteria(max_new_tokens=30), torch.Generator(), d, 3)
        for prompt, d in zip(ROW_PROMPTS, drafters, strict=True)
    ]
    results = engine.run(requests)
    assert [r.token_ids for r in results] == plain
    assert sum(d.choices["head"] for d in drafters) > 0
    assert rows[0] >= 2  # rows that chose the head in the same round drafted together


def test_auto_rows_the_load_keeps_from_drafting_shed_the_features(trained, monkeypatch):
    """``auto`` rows beside others whose load-aware γ stays 0 (a curve where a token costs
    a step) shed the head after SHED_AFTER rounds: the passes stop copying the target's
    features out, the rows go on as plain greedy decoding's tokens, and a reset brings
    the head back. Control: under a policy that lets every row draft (the tiny head
    costs about a tiny target step, so no curve makes the real policy draft here), no
    row sheds and every pass copies the features."""
    from speculative.engine import LoadAwareGamma
    from speculative.engine.batch import SHED_AFTER

    target = target_on("native-kernels", trained["model"])
    n = SHED_AFTER + 12
    plain = [generate(target, None, GREEDY, n=n, prompt=p).token_ids for p in ROW_PROMPTS]
    with_features = []
    counted = type(target.lm).forward_rows_with_hidden

    def counting(self, rows):
        with_features.append(len(rows))
        return counted(self, rows)

    monkeypatch.setattr(type(target.lm), "forward_rows_with_hidden", counting)

    class Generous(LoadAwareGamma):
        def choose(self, rows, *args, **kwargs):
            return [row.max_gamma for row in rows]

    def run(load):
        with_features.clear()
        engine = BatchEngine(target.lm, max_batch=3, load=load)
        drafters = [build_drafter(f"auto:{trained['eagle']}", target) for _ in ROW_PROMPTS]
        requests = [
            BatchRequest(prompt, GREEDY, StopCriteria(max_new_tokens=n), torch.Generator(), d)
            for prompt, d in zip(ROW_PROMPTS, drafters, strict=True)
        ]
        results = engine.run(requests)
        assert [r.token_ids for r in results] == plain
        return drafters, engine.target_passes, len(with_features)

    drafters, passes, featured = run(LoadAwareGamma(lambda k: float(k)))  # no draft pays
    assert all(d.head_shed and d.choices["head"] == 0 for d in drafters)
    # the prefill pass and the SHED_AFTER - 1 rounds before the one that sheds
    assert featured == SHED_AFTER < passes
    drafters[0].reset()
    assert not drafters[0].head_shed
    drafters, passes, featured = run(Generous(lambda k: float(k)))
    assert not any(d.head_shed for d in drafters)
    assert featured == passes and sum(d.choices["head"] for d in drafters) > 0


def test_slot_features_equal_the_single_sequence_features(trained):
    """A slot session's features after a batched pass, a rollback and a catch-up are
    bitwise those of a single-sequence session on the same tokens. A row whose drafter
    reads no features keeps none, even in a pass that computes them for others."""
    target = target_on("native-kernels", trained["model"])
    lm = target.lm
    single = ModelSession(lm)
    single.logits_after([*PROMPT[:-1], 11])
    expected = single.features.clone()
    pool = SlotPool(lm)
    a, b, plain = pool.open(features=True), pool.open(features=True), pool.open()
    rows = [a.request(PROMPT, [9, 10]), b.request(PROMPT[:5]), plain.request(PROMPT)]
    for session, logits in zip((a, b, plain), pool.forward_rows(rows), strict=True):
        session.receive(logits)
    assert plain.features is None and len(plain.cached) == len(PROMPT)
    row = a.request([*PROMPT[:-1], 11])  # rollback by common prefix (into the first
    a.receive(pool.forward_rows([row])[0])  # pass's rows, not yet read), then catch up
    assert len(a.cached) == len(PROMPT) and a.feature_count == len(PROMPT)
    assert torch.equal(a.features, expected)
    assert b.feature_count == 5
    assert torch.equal(b.features, expected[:5])
    a.release(), b.release(), plain.release()


def test_slot_features_read_late_equal_those_read_every_pass(trained, monkeypatch):
    """A batch's rows keep their features as references to the passes' outputs until a
    head reads them (and copy them once a store holds ``MAX_CHUNKS`` of them): a row
    read only at the end, after passes, rollbacks into them and a bound reached, holds
    bitwise the features of a row read after every pass, on the same tokens."""
    monkeypatch.setattr(session_module, "MAX_CHUNKS", 3)
    target = target_on("native-kernels", trained["model"])
    pool = SlotPool(target.lm)
    late, every = pool.open(features=True), pool.open(features=True)
    contexts = [PROMPT, [*PROMPT, 9], [*PROMPT, 9, 4], [*PROMPT, 9, 5], [*PROMPT, 9, 5, 6]]
    drafts = [[7, 8], [], [3], [2, 2], []]  # fed after each context (rolled back after)
    for context, new in zip(contexts, drafts, strict=True):
        rows = [late.request(context, new), every.request(context, new)]
        for session, logits in zip((late, every), pool.forward_rows(rows), strict=True):
            session.receive(logits)
        assert late.feature_count == every.features.shape[0] == len(every.cached)
    final = [*contexts[-1], 1]
    rows = [late.request(final), every.request(final)]  # rolls the last drafts back
    for session, logits in zip((late, every), pool.forward_rows(rows), strict=True):
        session.receive(logits)
    assert late.feature_count == len(final)
    assert torch.equal(late.features, every.features)
    features = late.features.clone()
    late.release(), every.release()
    single = ModelSession(target.lm)  # and both are the single sequence's
    single.logits_after(final)
    assert torch.equal(features, single.features)


def test_trained_heads_agree_with_the_target(trained):
    report = json.loads((trained["eagle"] / "report.json").read_text())
    assert report["heldout_top1"][0] > 0.2  # chance: ~1/16
    assert report["heldout_accepted"] > 0.3


def sequence_counts(target, drafter, params, runs, n, seed, constrained=False):
    counts: dict[tuple[int, ...], int] = {}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(runs):
        engine = SpeculativeEngine(target.lm, drafter, 3)
        constraint = NoRepeat(PROMPT) if constrained else None
        stop = StopCriteria(max_new_tokens=n)
        out = engine.generate(PROMPT, params, stop, generator, None, constraint)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def p_value(a: dict, b: dict) -> float:
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]])
    return float(stats.chi2_contingency(table)[1])


class MisreportedEagle(EagleDrafter):
    """Negative control: draws from the head's q but reports a flattened q' to the
    accept test (q' = (q + uniform over the draft vocabulary) / 2)."""

    def propose(self, context, gamma, params, generator):
        draft = super().propose(context, gamma, params, generator)
        q = draft.dense_probs()  # [1, γ, vocab]
        if q is None:
            return draft
        support = torch.zeros_like(q)
        support[..., self.head.draft_to_target] = 1.0 / self.head.draft_to_target.numel()
        return type(draft)(tokens=draft.tokens, probs=0.5 * q + 0.5 * support)


@pytest.mark.slow
@pytest.mark.parametrize("constrained", [False, True])
def test_sampling_matches_plain_and_catches_a_misreported_q(trained, constrained):
    """EAGLE's sampled sequences follow plain decoding's law, and a head that misreports
    its q is caught; the same under a token constraint (the target restricted to the
    allowed tokens; the head drafts refused tokens too, which verification rejects)."""
    target = target_on("native-torch", trained["model"])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    head = load_head(trained["eagle"], target.lm)
    vocab = target.lm.vocab_size
    # (the constraint leaves the misreport less to show: more runs to see it)
    runs = {"params": params, "runs": 1600 if constrained else 800, "n": 2,
            "constrained": constrained}  # fmt: skip
    plain = sequence_counts(target, None, seed=1, **runs)
    honest = sequence_counts(target, EagleDrafter(head, vocab), seed=2, **runs)
    wrong = sequence_counts(target, MisreportedEagle(head, vocab), seed=2, **runs)
    if constrained:  # no sample repeats a token
        assert all(
            a != b for key in honest for a, b in zip((PROMPT[-1], *key[:-1]), key, strict=True)
        )
    assert p_value(plain, honest) > 1e-3
    assert p_value(plain, wrong) < 1e-3


@pytest.mark.parametrize("runtime", ["native-torch", "native-kernels"])
def test_sampled_q_is_the_distribution_tokens_come_from(trained, runtime):
    target = target_on(runtime, trained["model"])
    params = SamplingParams(temperature=0.8, top_p=0.95)
    for name in ("eagle", "medusa"):
        drafter = build_drafter(f"{name}:{trained[name]}", target)
        session = ModelSession(target.lm)
        session.sync(PROMPT[:-1])
        drafter.prime(session)
        draft = drafter.propose(PROMPT, 3, params, torch.Generator().manual_seed(0))
        probs = draft.dense_probs()[0]  # [γ, vocab]
        assert torch.allclose(probs.sum(-1), torch.ones(len(draft.tokens)), atol=1e-5)
        outside = torch.ones(probs.shape[-1], dtype=torch.bool)
        outside[drafter.head.draft_to_target] = False
        assert probs[:, outside].sum() == 0
        assert all(probs[i, t] > 0 for i, t in enumerate(draft.tokens))


@pytest.mark.parametrize("runtime", ["native-torch", "native-kernels"])
def test_sparse_head_q_verifies_as_the_dense_q(trained, runtime):
    """EAGLE hands its top-p q to the verifier as sparse rows over target ids
    (``Draft.rows``); decoding with the one-row rule reading them emits, seed for seed,
    the tokens of the batched ``verify`` reading the dense q (``Draft.dense_probs``, the
    scatter into the vocabulary that was the only form before). Control: a q whose rows
    are shifted one position (row j reports row j + 1's q) changes the tokens."""
    target = target_on(runtime, trained["model"])
    params = SamplingParams(temperature=0.8, top_p=0.95)
    head = load_head(trained["eagle"], target.lm)

    def run(drafter, seed, verifier=None):
        engine = SpeculativeEngine(target.lm, drafter, 3, verifier=verifier)
        stop = StopCriteria(max_new_tokens=24)
        generator = torch.Generator().manual_seed(seed)
        return engine.generate(PROMPT, params, stop, generator).token_ids

    drafter = EagleDrafter(head, target.lm.vocab_size)
    session = ModelSession(target.lm)
    session.sync(PROMPT[:-1])
    drafter.prime(session)
    draft = drafter.propose(PROMPT, 3, params, torch.Generator().manual_seed(0))
    assert draft.probs is None and draft.rows is not None and len(draft.rows) == 3
    exact = [run(EagleDrafter(head, target.lm.vocab_size), seed) for seed in range(4)]
    dense = [run(EagleDrafter(head, target.lm.vocab_size), s, verify) for s in range(4)]
    assert exact == dense
    shifted = [run(ShiftedQEagle(head, target.lm.vocab_size), seed) for seed in range(4)]
    assert shifted != exact


class ShiftedQEagle(EagleDrafter):
    """Negative control: reports q rows one position late (row j gets row j + 1's, the
    last keeps its own), sparse as the honest drafter does."""

    def propose(self, context, gamma, params, generator):
        draft = super().propose(context, gamma, params, generator)
        if draft.rows is None or len(draft.rows) < 2:
            return draft
        rows = (*draft.rows[1:], draft.rows[-1])
        return type(draft)(tokens=draft.tokens, rows=rows, vocab=draft.vocab)


# ---- the catch-up window -----------------------------------------------------------------


def counting_pairs(drafter: EagleDrafter) -> list[int]:
    """The number of pairs of each step the drafter's chain runner takes (appended as it
    runs)."""
    runner, counts = drafter.chain.runner, []
    step = runner.step

    def counted(embeds, *args, **kwargs):
        counts.append(embeds.shape[0])
        return step(embeds, *args, **kwargs)

    runner.step = counted
    return counts


def primed_eagle(target, folder: Path, window: int | None) -> tuple[EagleDrafter, ModelSession]:
    drafter = build_drafter(f"eagle:{folder}", target)
    assert isinstance(drafter, EagleDrafter)
    drafter.window = window
    session = ModelSession(target.lm)
    drafter.prime(session)
    return drafter, session


def first_draft(drafter, session, context, params, seed=0):
    """The drafter's 4-token draft after the target's session scored ``context``."""
    session.logits_after(context)
    return drafter.propose(context, 4, params, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("runtime", ["native-torch", "native-kernels"])
def test_a_long_catch_up_runs_only_the_window_and_stays_lossless(trained, runtime):
    """A head far behind the context (a long prompt) runs only the last ``window`` true
    pairs (the work of a catch-up is bounded; its backlog says so), then drafts on top of
    them; generation stays exactly plain decoding. A context that changed inside the
    skipped pairs starts the cache over: the drafts are a fresh drafter's, bitwise."""
    target = target_on(runtime, trained["model"])
    long_prompt = PROMPT * 4  # 44 tokens
    runs = {}
    for window in (8, None):  # one session on the target at a time
        drafter, session = primed_eagle(target, trained["eagle"], window)
        session.logits_after(long_prompt)
        backlog = drafter.draft_backlog(long_prompt)
        counts = counting_pairs(drafter)
        drafter.propose(long_prompt, 4, GREEDY, torch.Generator())
        runs[window] = (backlog, counts, drafter)
    assert runs[8][:2] == (8 - 1, [8, 1, 1, 1])  # the catch-up, then a step per draft
    assert runs[None][:2] == (len(long_prompt) - 2, [len(long_prompt) - 1, 1, 1, 1])
    windowed = runs[8][2]
    plain = generate(target, None, GREEDY, prompt=long_prompt).token_ids
    windowed.reset()
    out = generate(target, windowed, GREEDY, prompt=long_prompt)
    assert out.token_ids == plain and out.stats.accepted_tokens > 0

    params = SamplingParams(temperature=1.0)
    changed = [*long_prompt[:10], 9, *long_prompt[11:]]  # a token the window skipped
    shorter = changed[:15]  # no longer than the window: all its pairs run, from slot 0
    for context in (changed, shorter):
        fresh, fresh_session = primed_eagle(target, trained["eagle"], 16)
        want = first_draft(fresh, fresh_session, context, params, seed=1)
        drafter, own = primed_eagle(target, trained["eagle"], 16)
        first_draft(drafter, own, long_prompt, params)
        got = first_draft(drafter, own, context, params, seed=1)
        assert got.tokens == want.tokens
        for a, b in zip(got.rows, want.rows, strict=True):
            assert torch.equal(a.dense(target.lm.vocab_size), b.dense(target.lm.vocab_size))


def test_a_windowed_head_drafts_trees_from_its_own_cache(trained):
    """Trees read the windowed cache as chains do (slot i at position i): after a catch-up
    that skipped pairs, the tree's expansion of its best child (the chain's first draft)
    predicts what the chain's next step does, and the greedy tree holds the chain of two.
    (Positions off by the skipped pairs would rotate the expansion's query against the
    cached keys: its logits would differ.)"""
    target = target_on("native-torch", trained["model"])
    drafter, session = primed_eagle(target, trained["eagle"], 8)
    context = PROMPT * 4
    session.logits_after(context)
    outputs: dict[str, list[torch.Tensor]] = {"tree": [], "chain": []}
    for key, cache in (("tree", drafter.tree_cache), ("chain", drafter.chain)):
        step = cache.runner.step

        def kept(*args, step=step, key=key, **kwargs):
            out, logits = step(*args, **kwargs)
            outputs[key].append(logits)
            return out, logits

        cache.runner.step = kept
    tree = drafter.propose_tree(context, 16, GREEDY, torch.Generator())
    chain = drafter.propose(context, 2, GREEDY, torch.Generator())
    assert drafter.tree_cache.first == drafter.chain.first == len(context) - 1 - 8
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()

    def path(node: int) -> list[int]:
        return [] if node < 0 else [*path(parents[node]), tokens[node]]

    assert tokens[0] == chain.tokens[0]
    # the calls: a catch-up, then the tree's first expansion (its best child first) / the
    # chain's step after its first draft
    assert torch.allclose(outputs["tree"][1][0], outputs["chain"][1][0], atol=1e-5)
    assert chain.tokens in [path(node) for node in range(len(tokens))]


# ---- trees -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["eagle", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_proposals_are_well_formed(trained, name, temperature):
    target = target_on("native-torch", trained["model"])
    drafter = build_drafter(f"{name}:{trained[name]}", target)
    assert isinstance(drafter, TreeDrafter)
    session = ModelSession(target.lm)
    session.sync(PROMPT[:-1])
    drafter.prime(session)
    params = SamplingParams(temperature=temperature)
    tree = drafter.propose_tree(PROMPT, 8, params, torch.Generator().manual_seed(3))
    n = tree.tokens.numel()
    assert 2 <= n <= 8
    assert all(-1 <= int(p) < i for i, p in enumerate(tree.parents))  # parents first
    for parent in set(tree.parents.tolist()):  # siblings are distinct
        siblings = tree.tokens[tree.parents == parent].tolist()
        assert len(siblings) == len(set(siblings))
    if temperature == 0:
        assert tree.q is None
        chain = drafter.propose(PROMPT, 1, params, torch.Generator())
        assert int(tree.tokens[0]) == chain.tokens[0]  # the best child comes first
    else:
        assert tree.q is not None and tree.q.shape == (n, target.lm.vocab_size)
        assert torch.allclose(tree.q.sum(-1), torch.ones(n), atol=1e-5)
        assert all(tree.q[i, t] > 0 for i, t in enumerate(tree.tokens.tolist()))


def test_tree_children_are_draws_without_replacement(trained):
    """The first child of the root is distributed as q itself (Gumbel-top-k), the second
    as q conditioned on differing from the first."""
    target = target_on("native-torch", trained["model"])
    drafter = build_drafter(f"medusa:{trained['medusa']}", target)
    session = ModelSession(target.lm)
    session.sync(PROMPT[:-1])
    drafter.prime(session)
    params = SamplingParams(temperature=1.5)
    generator = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(3000):
        tree = drafter.propose_tree(PROMPT, 3, params, generator)
        firsts.append(int(tree.tokens[0]))
    q = tree.q[0]
    support = q.nonzero().squeeze(1)
    observed = np.array([firsts.count(int(t)) for t in support])
    expected = q[support].double().numpy()
    expected = expected / expected.sum() * len(firsts)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


# ---- auto --------------------------------------------------------------------------------


def test_auto_uses_both_and_is_lossless(trained):
    target = target_on("native-torch", trained["model"])
    drafter = build_drafter(f"auto:{trained['eagle']}", target)
    assert isinstance(drafter, AutoDrafter)
    repetitive = PROMPT * 4
    plain = generate(target, None, GREEDY, prompt=repetitive, n=60).token_ids
    assert generate(target, drafter, GREEDY, prompt=repetitive, n=60).token_ids == plain
    assert drafter.choices["ngram"] > 0 and drafter.choices["head"] > 0


def _timed_auto(curve: dict[int, float], ngram_alpha: float, head_alpha: float) -> AutoDrafter:
    """An AutoDrafter whose verification times V(k) are ``curve`` (seconds) and whose
    options have the given α, n-gram drafting at 1 % and the head at 15 % of V(1)."""
    from speculative.round_costs import VerifyTimes

    drafter = AutoDrafter(head=None)  # type: ignore[arg-type]  # choose() never calls it
    drafter.verify = VerifyTimes(curve[1], {k: v / curve[1] for k, v in curve.items()})
    for estimate in drafter.ngram.values():
        estimate.alpha, estimate.seconds = ngram_alpha, 0.01 * curve[1]
    drafter.model.alpha, drafter.model.seconds = head_alpha, 0.15 * curve[1]
    return drafter


FLAT = {k: 0.005 for k in range(1, 10)}  # fp32 / AVX-512: k tokens cost one step
STEEP = {k: 0.005 * (1 + 0.5 * (k - 1)) for k in range(1, 10)}  # each token half a step


def test_auto_drafts_the_length_that_pays_on_the_measured_verify_curve():
    """The choice follows tokens per second: a good cheap guess drafts all γ on a flat
    curve; on a steep one a weak guess drafts nothing (verifying it costs more than it
    brings) while a near-certain one still drafts, fewer tokens than γ."""
    flat_good = _timed_auto(FLAT, ngram_alpha=0.9, head_alpha=0.5).choose(4, 8, gamma=8)
    assert (flat_good.option, flat_good.drafts) == ("ngram", 8)
    weak = _timed_auto(STEEP, ngram_alpha=0.3, head_alpha=0.3).choose(4, 8, gamma=8)
    assert weak.option == "none"
    # the control: the same weak guesses on the flat curve do draft
    assert _timed_auto(FLAT, ngram_alpha=0.3, head_alpha=0.3).choose(4, 8, 8).option != "none"
    sure = _timed_auto(STEEP, ngram_alpha=0.95, head_alpha=0.3).choose(4, 8, gamma=8)
    assert sure.option == "ngram" and 1 <= sure.drafts < 8


def test_auto_prefers_the_option_with_more_tokens_per_second():
    """Equal α: the cheaper option wins; a much better head beats a cheap weak n-gram;
    without a match only the head or a plain step can be chosen; after EXPLORE rounds
    without it the head drafts one token in the next round that would otherwise be a plain
    step, never in place of an n-gram draft that pays."""
    from speculative.drafters.auto import EXPLORE

    assert _timed_auto(FLAT, 0.7, 0.7).choose(4, 4, 4).option == "ngram"
    assert _timed_auto(FLAT, 0.1, 0.9).choose(4, 4, 4).option == "head"
    assert _timed_auto(FLAT, 0.9, 0.9).choose(0, 0, 4).option == "head"
    drafter = _timed_auto(FLAT, 0.9, 0.0)
    assert drafter.choose(4, 4, 4).option == "ngram"
    assert drafter.choose(0, 0, 4).option == "none"  # a hopeless head: a plain step
    drafter._since_head = EXPLORE
    assert drafter.choose(4, 4, 4).option == "ngram"  # the n-gram draft is not displaced
    assert (drafter.choose(0, 0, 4).option, drafter.choose(0, 0, 4).drafts) == ("head", 1)


def test_auto_observe_without_a_proposal_changes_nothing(trained):
    """A round the γ policy gave 0 drafts calls observe() without propose(): it must not
    count the previous round's draft again (it used to lower that option's α twice)."""
    target = target_on("native-torch", trained["model"])
    drafter = AutoDrafter(build_drafter(f"eagle:{trained['eagle']}", target))
    for estimate in drafter.ngram.values():
        estimate.alpha = 0.9  # the n-gram option wins over a head with no features
    context = [3, 4, 5, 6, 7, 3, 4, 5]
    draft = drafter.propose(context, 2, GREEDY, torch.Generator().manual_seed(0))
    assert draft.tokens == [6, 7] and drafter.choices["ngram"] == 1
    drafter.observe([*context, 6, 9], 1)
    situation = drafter.ngram[3]
    after_round = (situation.alpha, situation.seconds, drafter.verify.scale)
    assert situation.alpha < 0.9  # the round counted once: 1 of 2 accepted
    drafter.observe([*context, 6, 9, 2], 0)  # no proposal this round
    assert (situation.alpha, situation.seconds, drafter.verify.scale) == after_round


def test_auto_verify_times_follow_the_machine_at_every_length():
    """V(k): the prior shape until timed; a slowdown seen at one length moves every
    length (a V(1) timed early and never again must not stay stale); one pass five times
    as slow moves V(k) by less than half and normal rounds bring it back."""
    from speculative.round_costs import PRIOR_SLOPE, VerifyTimes

    times = VerifyTimes()
    assert times.at(3) == pytest.approx(1 + 2 * PRIOR_SLOPE)  # units of V(1) before any
    times.record(2, 0.011)
    assert times.at(1) == pytest.approx(0.011 / (1 + PRIOR_SLOPE))  # the prior shape
    times.record(1, 0.004)
    for _ in range(30):
        times.record(5, 0.006)
    before = times.at(1)
    for _ in range(60):  # the machine gets twice as slow; only k = 5 is chosen from now
        times.record(5, 2 * 0.006)
    assert times.at(1) == pytest.approx(2 * before, rel=0.15)  # most of it
    assert times.at(5) == pytest.approx(2 * 0.006, rel=0.02)  # what it measures
    steady = times.at(5)
    times.record(5, 5 * steady)  # one cold pass
    assert times.at(5) < 1.5 * steady
    for _ in range(30):
        times.record(5, steady)
    assert times.at(5) == pytest.approx(steady, rel=0.1)


def test_auto_learns_the_verify_shape_of_the_length_most_rounds_use():
    """Rounds of 2 tokens take 1.2x a plain one, 9 rounds in 10 verify 2, and the prior (a
    calibration) says 0.97. Learnt from adjacent plain and 2-token rounds, the shape
    reaches 1.2; learnt against the scale (the control, the rule before), it stays near
    1.08, where a 1-token draft looks cheaper than it is."""
    from speculative.round_costs import VerifyTimes
    from speculative.theory import decayed_average

    class AgainstScale(VerifyTimes):
        def record(self, k: int, seconds: float) -> None:
            shape = self.shape_at(k)
            self.scale = decayed_average(self.scale, seconds / shape, self.decay)
            if k > 1:
                self.shape[k] = 0.99 * shape + 0.01 * seconds / self.scale

    prior = {1: 1.0, 2: 0.97, 3: 0.97}
    learnt, control = VerifyTimes(prior=dict(prior)), AgainstScale(prior=dict(prior))
    rng = random.Random(0)
    for _ in range(1200):
        k = 1 if rng.random() < 0.1 else 2
        seconds = (1.0 if k == 1 else 1.2) * 3.5e-3 * rng.uniform(0.85, 1.15)
        learnt.record(k, seconds)
        control.record(k, seconds)
    assert learnt.shape_at(2) == pytest.approx(1.2, rel=0.03)
    assert learnt.at(1) == pytest.approx(3.5e-3, rel=0.05)
    assert control.shape_at(2) < 1.1


def test_gamma_auto_hands_auto_the_measured_curve_and_a_cap():
    """--gamma auto: a drafter that chooses its own length gets the measured T(k) as the
    prior of its timings and a fixed cap; other drafters keep the adaptive policy."""
    from speculative.drafters.ngram import PromptLookupDrafter
    from speculative.engine import AdaptiveGamma
    from speculative.engine.gamma import AUTO_LENGTH_CAP, make_gamma_policy
    from speculative.round_costs import prior_shape

    curve = {1: 1.0, 2: 1.05, 3: 1.3, 4: 1.6, 5: 2.0}  # steeper than the default prior
    drafter = AutoDrafter(head=None)  # type: ignore[arg-type]  # only its timings are used
    assert make_gamma_policy("auto", 0.1, curve, drafter) == min(AUTO_LENGTH_CAP, 4)
    drafter.verify.record(1, 0.01)
    assert drafter.verify.at(4) == pytest.approx(0.016)  # V(1) x the measured T(4)
    assert prior_shape(7, curve) == pytest.approx(2.0 + 2 * 0.4)  # the last step, extended
    sparse = {1: 1.0, 4: 1.2, 8: 2.0}  # measured at a few lengths: linear between them
    assert [prior_shape(k, sparse) for k in (2, 6, 9)] == pytest.approx([1.0 + 0.2 / 3, 1.6, 2.2])
    assert prior_shape(4) != pytest.approx(1.6)  # the control: without a curve, the default
    assert isinstance(make_gamma_policy("auto", 0.1, curve, PromptLookupDrafter()), AdaptiveGamma)
    assert isinstance(make_gamma_policy("auto", 0.1, None, drafter), AdaptiveGamma)


# ---- registry, storage, CLI --------------------------------------------------------------


def test_registry_resolves_every_name(trained):
    target = target_on("hf", trained["model"])
    expected = {
        "none": type(None),
        "ngram": "PromptLookupDrafter",
        "self-bf16": "DraftModelDrafter",
        "self-exit:1": "DraftModelDrafter",
        f"eagle:{trained['eagle']}": "EagleDrafter",
        f"medusa:{trained['medusa']}": "MedusaDrafter",
        f"auto:{trained['eagle']}": "AutoDrafter",
        str(trained["model"]): "DraftModelDrafter",
    }
    for name, kind in expected.items():
        drafter = build_drafter(name, target)
        got = type(drafter) if kind is type(None) else type(drafter).__name__
        assert got == kind, name
    prefixes = {entry.prefix for entry in REGISTRY}
    assert {"none", "ngram", "self", "self-exit", "eagle", "medusa", "auto"} <= prefixes
    with pytest.raises(ValueError, match="no eagle head ships"):
        build_drafter("eagle", target)
    with pytest.raises(ValueError, match="holds a medusa head"):
        build_drafter(f"eagle:{trained['medusa']}", target)
    # a self-drafter must be cheaper than the target (fp32 here): fp32 cannot help
    with pytest.raises(ValueError, match="cannot speed up this fp32 target"):
        build_drafter("self-fp32", target)


def test_loading_against_another_target_fails_clearly(trained, tmp_path):
    other = load_target(str(save_tiny(tmp_path / "other", seed=5, layers=2)), "hf", "fp32")
    with pytest.raises(HeadMismatch, match="was trained for 'model', not this target"):
        load_head(trained["eagle"], other.lm)


def test_head_folder_is_small_and_stores_no_target_rows(trained):
    from safetensors.torch import load_file

    tensors = load_file(str(trained["eagle"] / "head.safetensors"))
    assert tensors["draft_to_target"].dtype == torch.int64
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k != "draft_to_target")
    vocab_rows = [k for k, t in tensors.items() if t.dim() == 2 and t.shape[0] == 16]
    assert not vocab_rows  # the draft vocabulary's output rows come from the target
    config = json.loads((trained["eagle"] / "config.json").read_text())
    assert config["target"]["name"] == "model"


def test_train_draft_cli_json_resume_and_errors(trained, tmp_path, capsys):
    from speculative.cli.main import main

    out = tmp_path / "head"
    args = [
        "train-draft", "--target", str(trained["model"]), "--data", str(trained["data"]),
        "--draft-vocab", "16", "--batch-tokens", "512", "--out", str(out), "--json",
    ]  # fmt: skip
    assert main([*args, "--steps", "5"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 5 and report["train_tokens"] > 0
    assert len(report["heldout_top1"]) == 5 and 0 <= report["heldout_accepted"] <= 5
    assert report["heldout_acceptance_rate"] == pytest.approx(report["heldout_accepted"] / 5, 1e-3)
    assert report["heldout_source"] == "split of the training data"
    assert main([*args, "--steps", "8", "--resume"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["steps"] == 8
    assert main([*args[:-3], "--out", str(tmp_path / "x"), "--data", "/nonexistent.jsonl"]) == 2
    assert "cannot read training data" in capsys.readouterr().err
    held = write_corpus(tmp_path / "eval.jsonl", trained["model"], records=3, seed=1)
    separate = [*args[:-3], "--out", str(tmp_path / "e"), "--eval-data", str(held), "--json"]
    assert main([*separate, "--steps", "2", "--matmul-precision", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["heldout_source"] == "eval data" and report["matmul_precision"] == "bf16"
    from speculative.training.soft_ce import soft_cross_entropy_for_this_machine

    assert report["soft_cross_entropy"] == soft_cross_entropy_for_this_machine().name
    assert report["heldout_tokens"] == 3 * 44  # all of it (4 prompt + 40 answer tokens each)
    assert report["train_tokens"] == 60 * 44  # every --data record trains


def fine_tune(trained: dict[str, Path], out: Path, init: str | None, steps: int, lr=1e-3, **kw):
    """A few steps of train-draft on fresh text of the tiny target (seed 7), from
    ``init`` (a head folder) or from a fresh head; returns (report, saved head)."""
    data = out.parent / "fresh.jsonl"
    if not data.is_file():
        write_corpus(data, trained["model"], records=30, seed=7)
    options = TrainDraftOptions(
        out=out, target=str(trained["model"]), data=[data], steps=steps, batch_tokens=512,
        lr=lr, progress=False, init=init, **{"matmul_precision": "fp32", **kw},
    )  # fmt: skip
    report = train_draft(options)
    return report, load_head(out, target_on("native-torch", trained["model"]).lm)


def reversed_map_copy(folder: Path, out: Path) -> Path:
    """The head in ``folder`` with its draft vocabulary listed in reverse: the same
    drafts (its rows are the target's, taken through the map), but not the order a
    fresh head's map from counts of the data would have."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("features", "*.pt"))
    tensors = load_file(str(out / "head.safetensors"))
    tensors["draft_to_target"] = tensors["draft_to_target"].flip(0).contiguous()
    save_file(tensors, str(out / "head.safetensors"))
    return out


def test_a_fine_tune_starts_from_the_trained_head(trained, tmp_path):
    """train-draft --init continues the given head: its weights, draft vocabulary and
    feature layers, scored on the held-out split before and after (its "before" score is
    the starting head's own). Five steps from the trained head agree with the target
    far more often than five steps from a fresh one (the control)."""
    start = reversed_map_copy(trained["eagle"], tmp_path / "start")
    init = load_head(start, target_on("native-torch", trained["model"]).lm)
    zero, kept = fine_tune(trained, tmp_path / "zero", str(start), 1, lr=0.0)
    got, want = kept.module.state_dict(), init.module.state_dict()
    assert all(torch.equal(got[key], want[key]) for key in want)  # lr 0: unchanged
    assert zero["init_heldout_top1"] == zero["heldout_top1"]
    assert zero["init_training"]["steps"] == 60 and zero["init"] == str(start)
    tuned_report, tuned = fine_tune(trained, tmp_path / "tuned", str(start), 5)
    fresh_report, fresh = fine_tune(trained, tmp_path / "fresh", None, 5, draft_vocab=16)
    assert torch.equal(tuned.draft_to_target, init.draft_to_target)
    assert not torch.equal(fresh.draft_to_target, init.draft_to_target)  # the data's order
    assert tuned.config.feature_layers == init.config.feature_layers == (0,)
    assert tuned_report["init_heldout_top1"] == zero["init_heldout_top1"]
    mean = [sum(r["heldout_top1"]) / 5 for r in (tuned_report, fresh_report)]
    assert mean[0] > mean[1] + 0.06  # 0.32 against 0.20 when written


def test_a_fine_tune_keeps_the_shape_of_its_head(trained, tmp_path):
    """Another method, draft vocabulary or set of feature layers than the --init head's,
    or a head that does not exist, is a clear error before any work."""
    eagle = str(trained["eagle"])
    with pytest.raises(ValueError, match="holds a medusa head, not eagle"):
        fine_tune(trained, tmp_path / "a", str(trained["medusa"]), 1)
    with pytest.raises(ValueError, match="drafts over 16 tokens"):
        fine_tune(trained, tmp_path / "b", eagle, 1, draft_vocab=12)
    with pytest.raises(ValueError, match="reads layers 0, and a fine-tune keeps them"):
        fine_tune(trained, tmp_path / "c", eagle, 1, feature_layers="none")
    with pytest.raises(ValueError, match="layers auto: the --init head reads layers none"):
        fine_tune(trained, tmp_path / "f", str(trained["eagle-last"]), 1, feature_layers="auto")
    with pytest.raises(ValueError, match="no eagle head ships for 'model'"):
        fine_tune(trained, tmp_path / "d", "shipped", 1)
    with pytest.raises(ValueError, match="no such folder"):
        fine_tune(trained, tmp_path / "e", str(tmp_path / "missing"), 1)


def test_bf16_matmuls_train_the_head_as_fp32_does(trained, tmp_path):
    """--matmul-precision bf16 (autocast) trains a fresh head as far as fp32 does in the
    same steps, far beyond the untrained head (lr 0, the control); its loss on a batch is
    fp32's to bf16 rounding but not fp32's own (the products really ran in bf16); the
    saved head is float32 and the report names the precision."""
    from speculative.training.features import chunk_paths, iterate_chunks
    from speculative.training.trainer import LossPlan, batch_loss, collate

    runs = {}
    for name, precision, lr in (("fp32", "fp32", 3e-3), ("bf16", "bf16", 3e-3), ("ctl", "fp32", 0)):
        report, head = fine_tune(
            trained, tmp_path / name, None, 40, lr=lr, draft_vocab=16, matmul_precision=precision
        )
        assert report["matmul_precision"] == precision
        assert all(p.dtype == torch.float32 for p in head.module.parameters())
        runs[name] = (sum(report["heldout_top1"]) / 5, head)
    assert runs["bf16"][0] == pytest.approx(runs["fp32"][0], abs=0.05)
    assert min(runs["fp32"][0], runs["bf16"][0]) > runs["ctl"][0] + 0.1
    weights = [dict(runs[name][1].module.named_parameters()) for name in ("fp32", "bf16")]
    assert not all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    head = runs["fp32"][1]
    batch = collate([next(iterate_chunks(chunk_paths(tmp_path / "fp32" / "features", "train")))])
    rows = head.head_rows
    exact, _ = batch_loss(head.module, batch, head.embedding, rows, LossPlan(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = batch_loss(head.module, batch, head.embedding, rows, LossPlan(3))
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
    assert float(rounded.detach()) == pytest.approx(float(exact.detach()), rel=0.02)


def per_step_loss(module, batch, embedding, rows, steps, fraction):
    """The distillation loss written plainly (the reference for ``batch_loss``): each
    draft step computes the target's distribution at the rows it scores."""
    from speculative.heads.modules import shifted
    from speculative.training.trainer import (
        REGRESSION_WEIGHT,
        STEP_DECAY,
        _loss_rows,
        predictions,
    )

    total = torch.zeros(())
    last = batch.features[..., : rows.shape[1]]
    for s, (pred, offset) in enumerate(predictions(module, batch, embedding, steps)):
        t = pred.shape[1]
        target = shifted(last, offset, t).reshape(-1, rows.shape[1])
        chosen = _loss_rows(torch.arange(t) + offset < batch.lengths.unsqueeze(1), fraction)
        pred_rows, target_rows = pred.reshape(-1, rows.shape[1])[chosen], target[chosen]
        p = torch.softmax(target_rows @ rows.T, -1)
        loss = -(p * torch.log_softmax(pred_rows @ rows.T, -1)).sum(-1).mean()
        loss = loss + REGRESSION_WEIGHT * torch.nn.functional.smooth_l1_loss(pred_rows, target_rows)
        total = total + STEP_DECAY**s * loss
    return total


@pytest.mark.parametrize("loss", ["torch", "kernel"])
@pytest.mark.parametrize("fraction", [1.0, 0.4])
def test_the_loss_computes_each_target_distribution_once_and_equals_the_plain_loss(
    trained, fraction, loss
):
    """batch_loss scores the target's distribution once per position that any draft step
    needs (three steps overlap on most positions); it equals the loss written step by
    step, on the same rows drawn from the same seed, with the torch soft cross-entropy and
    with the C kernel's. Scoring each row against the position before its own (an
    off-by-one in the position map) breaks the equality: the control."""
    import speculative.training.trainer as trainer_module
    from speculative.training.features import chunk_paths, iterate_chunks
    from speculative.training.soft_ce import KernelSoftCrossEntropy, torch_soft_cross_entropy

    soft_ce = torch_soft_cross_entropy
    if loss == "kernel":
        try:
            soft_ce = KernelSoftCrossEntropy(load_kernels())
        except KernelsUnavailable as error:
            pytest.skip(f"C kernels unavailable: {error}")
    head = load_head(trained["eagle"], target_on("native-torch", trained["model"]).lm)
    items = iterate_chunks(chunk_paths(trained["eagle"] / "features", "train"))
    batch = trainer_module.collate([next(items), next(items)])
    args = (head.module, batch, head.embedding, head.head_rows, 3, fraction)
    torch.manual_seed(5)
    want = float(per_step_loss(*args).detach())
    losses = []
    for off_by_one in (False, True):
        pick = trainer_module._pick

        def broken(*a, pick=pick, shift=int(off_by_one)):
            rows, at = pick(*a)
            return rows, at - shift

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(trainer_module, "_pick", broken)
            torch.manual_seed(5)
            plan = trainer_module.LossPlan(3, fraction, soft_ce=soft_ce)
            losses.append(float(trainer_module.batch_loss(*args[:4], plan)[0].detach()))
    assert losses[0] == pytest.approx(want, rel=1e-5)
    assert abs(losses[1] - want) > 0.02 * want


def test_matmul_precision_auto_asks_the_cpu_for_native_bf16():
    """auto trains in bf16 only where the CPU has bf16 dot products (AVX512-BF16 or AMX)
    and ONEDNN_MAX_CPU_ISA leaves oneDNN them; an explicit setting is kept anywhere; a
    trainer takes only a resolved one."""
    from speculative.hardware import CpuInfo
    from speculative.training.precision import resolve_matmul_precision

    def cpu(*isa: str, **settings: str) -> CpuInfo:
        return CpuInfo("cpu", "AuthenticAMD", "25", 2, isa, settings=settings)

    zen4 = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
    assert resolve_matmul_precision("auto", cpu(*zen4)) == "bf16"
    assert resolve_matmul_precision("auto", cpu("avx2", "fma")) == "fp32"  # AVX2-only EPYC
    assert resolve_matmul_precision("auto", cpu("avx2", "avx512f", "avx512bw")) == "fp32"
    assert resolve_matmul_precision("auto", cpu(*zen4, ONEDNN_MAX_CPU_ISA="AVX2")) == "fp32"
    limited = cpu(*zen4, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    assert resolve_matmul_precision("auto", limited) == "bf16"
    assert resolve_matmul_precision("auto", cpu("amx_bf16", "amx_tile")) == "bf16"
    assert resolve_matmul_precision("bf16", cpu("avx2")) == "bf16"
    assert resolve_matmul_precision("fp32", cpu(*zen4)) == "fp32"
    with pytest.raises(ValueError, match="choose one of auto, fp32, bf16"):
        resolve_matmul_precision("fp16", cpu(*zen4))
    from speculative.heads.modules import EagleHead, HeadConfig
    from speculative.training.trainer import Trainer, TrainSettings

    config = HeadConfig("eagle", 64, 16, intermediate_size=128, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="must be fp32 or bf16, not 'auto'"):  # unresolved
        Trainer(config, EagleHead(config), torch.zeros(4, 64), torch.zeros(16, 64),
                TrainSettings(matmul_precision="auto"))  # fmt: skip


def test_the_unrolled_pass_computes_only_the_rows_the_loss_reads():
    """The loss draws its rows first and the head computes, at each draft step, those
    rows and the rows later steps read (3 steps, 40 % of rows: at most 1 - 0.6**k of a
    step's rows), with the predictions of the full pass at them and the same loss and
    gradients. The control: a step that computes its own rows and the next step's but
    forgets those two steps on reads gives other predictions at that step."""
    import speculative.heads.modules as modules
    from speculative.heads.modules import EagleHead, HeadConfig
    from speculative.training.features import Sequence_
    from speculative.training.trainer import LossPlan, _pick, batch_loss, collate, predictions

    torch.manual_seed(0)
    config = HeadConfig("eagle", 64, 16, intermediate_size=128, num_heads=4, num_kv_heads=2,
                        feature_layers=(0,))  # fmt: skip
    head = EagleHead(config)
    embedding, rows = torch.randn(40, 64), torch.randn(16, 64)
    batch = collate([Sequence_(torch.randint(0, 40, (n,)), torch.randn(n, 128),
                               torch.randint(0, 40, (n,))) for n in (30, 17, 24)])  # fmt: skip
    steps, per_sequence = 3, batch.tokens.shape[1] - 1
    wanted = [_pick(s + 1, per_sequence, batch, 0.4)[0] for s in range(steps)]
    computed: list[int] = []
    hook = head.down.register_forward_hook(lambda m, i, o: computed.append(o.shape[0]))
    with torch.no_grad():
        full = predictions(head, batch, embedding, steps)
        computed.clear()
        part = predictions(head, batch, embedding, steps, wanted)
    hook.remove()
    later = [set(w.tolist()) for w in wanted]
    assert computed == [len(later[0] | later[1] | later[2]), len(later[1] | later[2]),
                        len(later[2])]  # fmt: skip
    assert computed[0] < 0.8 * 3 * per_sequence and computed[2] < 0.45 * 3 * per_sequence
    for (a, _), (b, _), w in zip(full, part, wanted, strict=True):
        assert torch.allclose(b.reshape(-1, 64)[w], a.reshape(-1, 64)[w], atol=1e-5)

    def loss_and_grads(dense: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(3)
        with pytest.MonkeyPatch.context() as patch:
            if dense:  # every row of every step, as before
                dense_pass = head.unrolled
                patch.setattr(head, "unrolled", lambda e, f, s, w=None: dense_pass(e, f, s))
            loss, _ = batch_loss(head, batch, embedding, rows, LossPlan(steps, 0.4))
        return loss, list(torch.autograd.grad(loss, list(head.parameters())))

    (loss, grads), (dense_loss, dense_grads) = loss_and_grads(False), loss_and_grads(True)
    assert float(loss.detach()) == pytest.approx(float(dense_loss.detach()), rel=1e-6)
    for g, want in zip(grads, dense_grads, strict=True):
        assert torch.allclose(g, want, rtol=1e-4, atol=1e-6)

    def next_step_only(wanted_rows, steps, rows):  # forgets what the step after next reads
        return [torch.unique(torch.cat(wanted_rows[i : i + 2])) for i in range(steps)]

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(modules, "_needed_rows", next_step_only)
        broken = predictions(head, batch, embedding, steps, wanted)
    differs = [not torch.allclose(b.reshape(-1, 64)[w], a.reshape(-1, 64)[w], atol=1e-3)
               for (a, _), (b, _), w in zip(full, broken, wanted, strict=True)]  # fmt: skip
    assert differs == [False, False, True]


def test_shared_loss_rows_are_one_draw_for_every_unrolled_step():
    """--loss-rows shared: step 0 scores a random 40 % of its valid rows and each later
    step the same rows, less those past their sequence's end at its offset; the head then
    computes only those rows at every step, with the loss and gradients of the dense
    pass. Independent draws (the control, and the default) compute more rows at step 0
    for the rows later steps read. A trainer refuses any other choice."""
    from speculative.heads.modules import EagleHead, HeadConfig
    from speculative.training.features import Sequence_
    from speculative.training.trainer import (
        LossPlan,
        Trainer,
        TrainSettings,
        _draw_rows,
        batch_loss,
        collate,
    )

    torch.manual_seed(0)
    config = HeadConfig("eagle", 64, 16, intermediate_size=128, num_heads=4, num_kv_heads=2)
    head = EagleHead(config)
    embedding, rows = torch.randn(40, 64), torch.randn(16, 64)
    batch = collate([Sequence_(torch.randint(0, 40, (n,)), torch.randn(n, 64),
                               torch.randint(0, 40, (n,))) for n in (30, 17, 24)])  # fmt: skip
    t = batch.tokens.shape[1] - 1

    def draw(shared: bool, fraction: float = 0.4) -> list[tuple[torch.Tensor, torch.Tensor]]:
        plan = LossPlan(3, fraction, shared_rows=shared)
        return _draw_rows(t, batch, plan, torch.Generator().manual_seed(4))

    picks = draw(True)
    first = picks[0][0]
    assert first.numel() == int(0.4 * sum(int(n) - 1 for n in batch.lengths))
    for offset, (chosen, at) in enumerate(picks, start=1):
        inside = first % t + offset < batch.lengths[first // t]
        assert torch.equal(chosen, first[inside])
        assert torch.equal(at, (chosen // t) * batch.tokens.shape[1] + chosen % t + offset)
    # every row drawn: each step keeps exactly its own valid rows, as independent draws do
    for (a, at_a), (b, at_b) in zip(draw(True, 1.0), draw(False, 1.0), strict=True):
        assert torch.equal(a, b) and torch.equal(at_a, at_b)

    def rows_computed_and_loss(shared: bool, dense: bool = False):
        computed: list[int] = []
        hook = head.down.register_forward_hook(lambda m, i, o: computed.append(o.shape[0]))
        with pytest.MonkeyPatch.context() as patch:
            if dense:
                dense_pass = head.unrolled
                patch.setattr(head, "unrolled", lambda e, f, s, w=None: dense_pass(e, f, s))
            plan, draws = LossPlan(3, 0.4, shared_rows=shared), torch.Generator().manual_seed(4)
            loss, _ = batch_loss(head, batch, embedding, rows, plan, draws)
        hook.remove()
        return computed, loss, torch.autograd.grad(loss, list(head.parameters()))

    computed, loss, grads = rows_computed_and_loss(True)
    assert computed == [p[0].numel() for p in picks]
    _, dense_loss, dense_grads = rows_computed_and_loss(True, dense=True)
    assert float(loss.detach()) == pytest.approx(float(dense_loss.detach()), rel=1e-6)
    for g, want in zip(grads, dense_grads, strict=True):
        assert torch.allclose(g, want, rtol=1e-4, atol=1e-6)
    independent, _, _ = rows_computed_and_loss(False)
    assert independent[0] > 1.5 * computed[0]
    with pytest.raises(ValueError, match="loss rows must be one of independent, shared"):
        Trainer(config, head, embedding, rows, TrainSettings(loss_rows="alternate"))
    with pytest.raises(TypeError, match="Linear is not a head the trainer can train"):
        Trainer(config, torch.nn.Linear(64, 64), embedding, rows, TrainSettings())


def test_a_trainer_draws_its_loss_rows_from_its_own_seeded_generator(tmp_path):
    """Trainers of one seed train the same head bit for bit whatever else draws from
    torch's global generator between their steps (the loss's rows come from the trainer's
    own generator), and a resumed run (its checkpoint carries the generator) ends where the
    uninterrupted one does; another seed draws other rows and trains another head (the
    control)."""
    from speculative.heads.modules import EagleHead, HeadConfig
    from speculative.training.features import Sequence_
    from speculative.training.trainer import Trainer, TrainSettings, collate

    config = HeadConfig("eagle", 64, 16, intermediate_size=128, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    start = EagleHead(config).state_dict()
    embedding, rows = torch.randn(40, 64), torch.randn(16, 64)
    batches = [collate([Sequence_(torch.randint(0, 40, (n,)), torch.randn(n, 64),
                                  torch.randint(0, 40, (n,))) for n in (30, 17)])
               for _ in range(3)]  # fmt: skip

    def trainer(seed: int) -> Trainer:
        module = EagleHead(config)
        module.load_state_dict(start)
        settings = TrainSettings(lr=1e-2, loss_fraction=0.4, seed=seed)
        return Trainer(config, module, embedding, rows, settings, tmp_path / f"{seed}.pt")

    def train(run: Trainer, batches: list, noise: int) -> dict[str, torch.Tensor]:
        for batch in batches:
            torch.manual_seed(noise)
            torch.rand(noise)  # other draws from the global generator
            run._step(batch, 3)
        return run.module.state_dict()

    first = train(trainer(0), batches, 1)
    again = train(trainer(0), batches, 7)
    assert all(torch.equal(first[k], again[k]) for k in first)
    interrupted = trainer(0)
    train(interrupted, batches[:1], 3)
    interrupted.save(tmp_path / "0.pt")
    resumed = trainer(0)
    resumed.load(tmp_path / "0.pt")
    resumed_end = train(resumed, batches[1:], 5)
    assert all(torch.equal(first[k], resumed_end[k]) for k in first)
    other = train(trainer(1), batches, 1)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_eagle_drafting_runs_the_head_as_it_was_trained():
    """Incremental steps over the head's cache (true pairs, then its own predictions)
    reproduce the unrolled training pass row by row, across a cache reallocation."""
    from speculative.heads.modules import EagleHead, HeadConfig

    torch.manual_seed(0)
    config = HeadConfig("eagle", 64, 16, intermediate_size=128, num_heads=4, num_kv_heads=2)
    head = EagleHead(config).eval()
    length, steps = 12, 3
    embeds, features = torch.randn(1, length + steps - 1, 64), torch.randn(1, length, 64)
    with torch.no_grad():
        trained = head.unrolled(embeds, features, steps)
    for t in (3, 11):
        cache = head.new_cache(4)  # smaller than needed: grows on the way
        pred = head.step(cache, embeds[0, : t + 1], features[0, : t + 1], torch.arange(t + 1))
        pred = pred[-1]
        assert torch.allclose(pred, trained[0][0, t], atol=1e-5)
        for s in range(1, steps):
            step_input = (embeds[0, t + s : t + s + 1], pred[None], torch.tensor([t + s]))
            pred = head.step(cache, *step_input)[-1]
            assert torch.allclose(pred, trained[s][0, t], atol=1e-5)


# ---- heads on the target's C kernels ----------------------------------------------------


def int4_round_trip(head):
    """``head`` with every weight the int4 runners quantize (the layers' and the draft
    vocabulary's rows) replaced by its 4-bit value, as kernels.c decodes it."""
    import copy
    import dataclasses

    from speculative.models.native.quant import quantize_group4

    def four_bits(weight: torch.Tensor) -> torch.Tensor:
        return quantize_group4(weight.detach().float()).dequantize()

    module = copy.deepcopy(head.module)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(four_bits(layer.weight))
    return dataclasses.replace(head, module=module, head_rows=four_bits(head.head_rows))


@pytest.mark.parametrize("eagle_name", ["eagle", "eagle-last"])
@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_kernel_runners_compute_the_heads(trained, precision, eagle_name):
    """The C runners compute what the PyTorch heads compute: at the head's own bf16 values
    (fp32 target) to bf16 rounding of the rows; at int4 (int4 target) what the head with
    its weights rounded to 4 bits computes, to the int8 rounding of the layers' inputs. The
    EAGLE runner's cache carries over calls and takes a [k, k] mask among new pairs and a
    [k, length + k] one over cached pairs too (a tree node that must not see a sibling)."""
    from speculative.heads.runners import (
        KernelEagleRunner,
        KernelMedusaRunner,
        TorchEagleRunner,
        TorchMedusaRunner,
    )

    target = target_on("native-kernels", trained["model"])
    library = target.lm.kernel_library()
    tolerance = 5e-3 if precision == "fp32" else 0.05  # bf16 rows: 3 digits; int8 inputs
    eagle = load_head(trained[eagle_name], target.lm)
    reference = eagle if precision == "fp32" else int4_round_trip(eagle)
    fast, slow = KernelEagleRunner.of(eagle, library, precision, 64), TorchEagleRunner(reference)
    torch.manual_seed(0)
    embeds = eagle.embedding[torch.randint(0, target.lm.vocab_size, (8,))]
    # true pairs read the target's features (with a fused head's layers: wider), drafted
    # pairs the head's own [H] predictions
    true_features = torch.randn(8, eagle.config.feature_width)
    features = torch.randn(8, embeds.shape[1])
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)  # a parent and its child
    child = torch.ones(1, 8, dtype=torch.bool)
    child[0, 6] = False  # the child of pair 5, beside pair 6: it must not see pair 6
    calls = [(slice(0, 5), torch.arange(5), None), (slice(5, 7), torch.tensor([5, 6]), tree),
             (slice(7, 8), torch.tensor([6]), child)]  # fmt: skip
    for rows, positions, mask in calls:
        read = true_features[rows] if mask is None else features[rows]
        got = fast.step(embeds[rows], read, positions, mask)
        want = slow.step(embeds[rows], read, positions, mask)
        for a, b in zip(got, want, strict=True):
            assert (a - b).norm() <= tolerance * b.norm()
    assert fast.length == slow.length == 8
    medusa = load_head(trained["medusa"], target.lm)
    feature = features[0]
    got = KernelMedusaRunner(medusa, library, precision)(feature, 3)
    want = TorchMedusaRunner(medusa if precision == "fp32" else int4_round_trip(medusa))(feature, 3)
    assert got.shape == want.shape == (3, medusa.config.draft_vocab)
    assert (got - want).norm() <= tolerance * want.norm()
    # each runner refuses the other kind of head, in one line naming both
    refusals = [(lambda h: KernelMedusaRunner(h, library, precision), eagle),
                (TorchMedusaRunner, eagle), (TorchEagleRunner, medusa),
                (lambda h: KernelEagleRunner.of(h, library, precision, 64), medusa)]  # fmt: skip
    for make, wrong in refusals:
        with pytest.raises(ValueError, match=f"the head is a .*\\({wrong.config.method}\\)"):
            make(wrong)


def test_kernel_tree_masks_hide_cached_pairs_bitwise(trained):
    """kernels.c's visibility over cached pairs (spec_forward's mask_base): a tree node
    whose mask hides a cached sibling computes bitwise what it computes when the sibling
    was never cached; the control, the same mask showing the sibling, differs."""
    from speculative.heads.runners import KernelEagleRunner

    target = target_on("native-kernels", trained["model"])
    eagle = load_head(trained["eagle"], target.lm)
    runner = KernelEagleRunner.of(eagle, target.lm.kernel_library(), "fp32", 64)
    torch.manual_seed(1)
    embeds = eagle.embedding[torch.randint(0, target.lm.vocab_size, (8,))]  # [8, H]
    features = torch.randn(8, embeds.shape[1])
    siblings = torch.eye(2, dtype=torch.bool)  # pairs 5 and 6: two children of pair 4

    def child_of_5(mask: torch.Tensor | None, cache_sibling: bool):
        run = runner.sibling()
        run.step(embeds[:5], features[:5], torch.arange(5))
        if cache_sibling:
            run.step(embeds[5:7], features[5:7], torch.tensor([5, 5]), siblings)
        else:
            run.step(embeds[5:6], features[5:6], torch.tensor([5]))
        return run.step(embeds[7:8], features[7:8], torch.tensor([6]), mask)

    hide = torch.ones(1, 8, dtype=torch.bool)
    hide[0, 6] = False
    want = child_of_5(None, cache_sibling=False)
    got = child_of_5(hide, cache_sibling=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    shown = child_of_5(torch.ones(1, 8, dtype=torch.bool), cache_sibling=True)
    assert not torch.equal(shown[0], want[0])


def test_registry_runs_heads_on_the_kernels_of_a_kernels_target(trained):
    from speculative.heads.runners import KernelEagleRunner, KernelMedusaRunner

    target = target_on("native-kernels", trained["model"])
    assert isinstance(build_drafter(f"eagle:{trained['eagle']}", target).chain.runner,
                      KernelEagleRunner)  # fmt: skip
    assert isinstance(build_drafter(f"medusa:{trained['medusa']}", target).runner,
                      KernelMedusaRunner)  # fmt: skip
    torch_target = target_on("native-torch", trained["model"])
    assert target_kernels_of(torch_target) is None


def target_kernels_of(target):
    from speculative.drafters.head_common import target_kernels

    return target_kernels(target.lm)


# ---- drafting sees what the training metric scores ---------------------------------------


class ShiftedFeatures:
    """Negative control: the target's session with every feature one position late
    (position t reads f_{t-1}), as a head fed features off by one would see them."""

    def __init__(self, session: ModelSession) -> None:
        self.session = session

    @property
    def cached(self) -> list[int]:
        return self.session.cached

    @property
    def features(self) -> torch.Tensor:
        f = self.session.features  # [n, hidden]
        return torch.cat([f[:1], f[:-1]])

    @property
    def feature_count(self) -> int:
        return self.session.feature_count


def guesses_of(head, tokens, features, greedy):
    """The held-out metric's step-0 guesses on ``tokens`` (trainer.predictions over the
    teacher-forced features, as trainer.evaluate): row t's guess for token t + 2 (target
    ids), and the target's greedy token there."""
    from speculative.training.features import Sequence_
    from speculative.training.trainer import collate, predictions

    item = Sequence_(torch.tensor(tokens), features.float(), greedy)
    with torch.no_grad():
        pred, offset = predictions(head.module, collate([item]), head.embedding, 1)[0]
    assert offset == 1
    return head.draft_to_target[(pred[0] @ head.head_rows.T).argmax(-1)], greedy[1:]


def drafted_first_tokens(drafter, lm, tokens: list[int], start: int, shifted=False) -> list[int]:
    """The drafter's first greedy draft after each context tokens[:n], n >= start, from
    the target's session after it scored that context (as the engine's verification)."""
    session = ModelSession(lm)
    drafter.reset()
    drafter.prime(ShiftedFeatures(session) if shifted else session)
    generator = torch.Generator().manual_seed(0)
    out = []
    for n in range(start, len(tokens)):
        session.logits_after(tokens[:n])
        out.append(drafter.propose(tokens[:n], 1, GREEDY, generator).tokens[0])
    return out


@pytest.mark.parametrize("runtime", ["native-torch", "native-kernels"])
@pytest.mark.parametrize("method", ["eagle", "eagle-last", "medusa"])
def test_drafting_agrees_with_the_target_as_the_training_metric_says(trained, method, runtime):
    """On the target's own greedy text, the drafter's first draft token after every
    context is the token the training's held-out metric scores for that position (row
    n - 2 of the teacher-forced pass guesses token n), so its agreement with the target is
    the metric's; a drafter reading features one position off (negative control) drafts
    other tokens at a fifth of the contexts or more, so the equality above would fail. (Its
    agreement with the target is not compared: on 30 tokens of a tiny model's text the two
    differ by a token or two either way, whichever rows training happened to draw.)"""
    from speculative.training.features import teacher_forced

    target = target_on(runtime, trained["model"])
    head = load_head(trained[method], target.lm)
    drafter = build_drafter(f"{method.removesuffix('-last')}:{trained[method]}", target)
    prompt = [5, 9, 4, 12]
    tokens = prompt + generate(target, None, GREEDY, n=30, prompt=prompt).token_ids
    features, greedy = teacher_forced(target.lm, tokens)
    assert greedy[len(prompt) - 1 : -1].tolist() == tokens[len(prompt) :]  # greedy text
    metric, want = guesses_of(head, tokens, features, greedy)  # rows 0 .. L - 2
    rows = slice(len(prompt) - 2, len(tokens) - 2)  # row n - 2 guesses token n
    drafted = drafted_first_tokens(drafter, target.lm, tokens, len(prompt))
    assert drafted == metric[rows].tolist()
    answer = torch.tensor(tokens[len(prompt) :])
    assert torch.equal(want[rows], answer)
    agreement = float((metric[rows] == answer).float().mean())
    assert agreement > 0.1  # chance: ~1/16
    off = torch.tensor(drafted_first_tokens(drafter, target.lm, tokens, len(prompt), True))
    assert float((off != metric[rows]).float().mean()) > 0.2  # the metric would not match


def test_eval_prompts_name_no_training_topic():
    """Held-out prompts (--eval-data text) are on topics the training prompts never name,
    so their answers are never near-copies of training answers."""
    from speculative.training.prompts import EVAL_TOPICS, TOPICS, build_prompts, eval_prompts

    held = eval_prompts(40)
    assert len({repr(m) for m in held}) == 40
    assert all(any(topic in m[0]["content"] for topic in EVAL_TOPICS) for m in held)
    training = " ".join(m["content"] for p in build_prompts(3000, seed=0) for m in p).lower()
    assert not [topic for topic in EVAL_TOPICS if topic.lower() in training]
    assert not set(EVAL_TOPICS) & set(TOPICS)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
    ],
)
def test_head_draw_through_the_sparse_row_is_the_dense_draw(params: SamplingParams) -> None:
    """draw_from_logits (the sparse row, found by a search where one answers) gives the
    token, the q bits and the generator state of a draw from draft_distribution's dense
    row, for peaked and flat rows; a draw from another row's q differs (the control)."""
    from speculative.drafters.head_common import draft_distribution, draw, draw_from_logits
    from speculative.sampling.probs import row_probs

    generator = torch.Generator().manual_seed(0)

    def search(row: torch.Tensor, temperature: float, top_p: float) -> object:
        return row_probs(row, SamplingParams(temperature=temperature, top_p=top_p))

    differs = 0
    for trial in range(24):
        logits = torch.randn(3000, generator=generator) * (8.0 if trial % 2 else 1.0)
        want_probs = draft_distribution(logits, params)  # [N]
        dense_generator = torch.Generator().manual_seed(trial)
        want = draw(want_probs, params, dense_generator)
        after = torch.rand(2, generator=dense_generator)  # the generator's state after it
        for answer in (None, search):
            sparse_generator = torch.Generator().manual_seed(trial)
            got, row = draw_from_logits(logits, params, sparse_generator, answer)
            assert got == want and torch.equal(row.dense(3000), want_probs), trial
            assert torch.equal(torch.rand(2, generator=sparse_generator), after)
        flipped = draft_distribution(logits.flip(0), params)
        differs += draw(flipped, params, torch.Generator().manual_seed(trial)) != want
    assert differs > 0
