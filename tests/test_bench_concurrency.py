"""`speculative bench --concurrency`: batched decoding by batch size on a tiny model."""

from __future__ import annotations

import json

import pytest

from speculative.bench.concurrency import (
    PEER,
    PLAIN,
    ConcurrencySettings,
    _Record,
    concurrency_markdown,
    concurrency_payload,
    in_batches,
    run_concurrency,
)
from speculative.bench.prompts import parse_prompts
from speculative.cli.main import main
from tiny import save_tiny

PROMPTS = [
    {"category": "story", "prompt": "the cat sat on the mat and then the cat sat on the"},
    {"category": "story", "prompt": "a dog ran and a dog ran on the rug"},
    {"category": "chat", "prompt": "the red cat and the blue dog sat on the mat"},
]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "target", seed=3, layers=2)


@pytest.fixture(scope="module")
def prompts_text() -> str:
    return "".join(json.dumps(r) + "\n" for r in PROMPTS)


def test_every_setup_at_every_batch_size_with_outputs_equal_to_plain(
    tiny_target, prompts_text, single_thread
) -> None:
    settings = ConcurrencySettings(
        target=str(tiny_target), runtimes=("native", "hf"), concurrency=(1, 2, 4),
        max_new_tokens=6, chat=False, progress=False, curve_repeats=1,
    )  # fmt: skip
    run = run_concurrency(settings, parse_prompts(prompts_text))
    setups = {(c.runtime, c.setup, c.batch) for c in run.cells}
    ours = [PLAIN, "ngram γ=4", "ngram load-aware"]
    expected = {(rt, s, b) for rt in ("native", "hf") for s in ours for b in (1, 2, 4)}
    assert expected | {("hf", PEER, b) for b in (1, 2, 4)} == setups
    for cell in run.cells:
        assert cell.tokens_per_second > 0 and cell.vs_plain is not None
        if cell.setup != PEER:
            assert cell.identical, cell  # every row of every setup equals plain decoding
            assert cell.new_tokens == 6 * 4  # every B decodes the same 4 prompts
            assert 0 < cell.forward_share <= 1
        if cell.setup == PLAIN:
            assert cell.mean_gamma == 0 and cell.vs_plain == 1.0
        if cell.runtime == "native" and cell.setup != PEER:  # the C kernels: priced passes
            assert cell.binds in ("memory", "compute")
            assert 0 < cell.roofline_share < 1  # no pass beats its floor
        else:
            assert cell.binds is None and cell.roofline_share is None
    fixed = [c for c in run.cells if c.setup == "ngram γ=4"]
    assert all(0 < c.mean_gamma <= 4 for c in fixed)  # the repetitive prompts drafted
    assert sorted(run.verify_cost["native"])[0] == 1 and run.verify_cost["native"][1] == 1.0
    report = concurrency_markdown(run)
    assert "| native | ngram load-aware | 4 |" in report


def test_cli_concurrency_json_and_out_folder(tiny_target, prompts_text, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(prompts_text)
    argv = [
        "bench", "--target", str(tiny_target), "--runtime", "native", "--concurrency", "1", "2",
        "--max-new-tokens", "4", "--repeats", "1", "--prompts", str(prompts), "--no-chat",
        "--no-peers", "--no-progress", "--out", str(tmp_path / "out"), "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    payload = json.loads(out.strip().splitlines()[-1])
    assert payload["mode"] == "concurrency"
    assert {(c["setup"], c["batch"]) for c in payload["cells"]} == {
        (s, b) for s in (PLAIN, "ngram γ=4", "ngram load-aware") for b in (1, 2)
    }
    written = json.loads((tmp_path / "out" / "concurrency.json").read_text())
    assert written["cells"] == payload["cells"]
    assert (tmp_path / "out" / "concurrency.md").read_text().startswith("# Batched decoding")


def test_cli_concurrency_refuses_sampling(capsys) -> None:
    code = main(["bench", "--concurrency", "2", "--temperature", "0.8"])
    assert code == 2
    assert "greedy" in capsys.readouterr().err


def test_setups_take_every_position_in_turn():
    """Over as many repeats as setups, each setup runs once in each position (a fixed order
    would charge a position's cost, such as the drift within a repeat, to one setup)."""
    from speculative.bench.concurrency import rotated

    setups = ["plain", "fixed", "load-aware"]
    orders = [rotated(setups, repeat) for repeat in range(3)]
    assert all(sorted(order) == sorted(setups) for order in orders)
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(setups)
    assert rotated(setups, 3) == setups


def test_every_load_aware_policy_prices_a_pass_by_its_rows_and_its_tokens(
    tiny_target, prompts_text, single_thread, monkeypatch
) -> None:
    """A round of B rows drafting k tokens each is a pass of B rows, not of B·k rows: one
    row's tokens share its cache reads and attention. Every batch size's load-aware policy
    gets the pass-cost model the engine and server use, T(r, n) = K(n) + R(r) − K(r), with
    K measured on one row of n tokens and R on r rows of one token, up to the largest B
    (one 8-row curve for all B priced one row's drafts at B = 1 as 8 rows': 1.04× against
    1.41× on the default model). The report keeps its 8-row curve, and the JSON gives the
    model's two curves."""
    import speculative.bench.concurrency as concurrency
    import speculative.engine.costs as costs

    measured: dict[int, int] = {}  # id(curve) -> the rows it was measured over
    policies: list = []
    measure = costs.rows_verify_cost

    def recorded(model, context, points, repeats, rows, clock):
        curve = measure(model, context, points, repeats, rows, clock)
        measured[id(curve)] = rows
        return curve

    class Recorded(concurrency.LoadAwareGamma):
        def __post_init__(self) -> None:
            super().__post_init__()
            policies.append(self)

    monkeypatch.setattr(costs, "rows_verify_cost", recorded)
    monkeypatch.setattr(concurrency, "rows_verify_cost", recorded)
    monkeypatch.setattr(concurrency, "LoadAwareGamma", Recorded)
    settings = ConcurrencySettings(
        target=str(tiny_target), runtimes=("native",), concurrency=(1, 2, 4),
        max_new_tokens=4, chat=False, progress=False, curve_repeats=1, peers=False,
    )  # fmt: skip
    run = run_concurrency(settings, parse_prompts(prompts_text))
    assert len(policies) == 3  # one per batch size
    for policy in policies:
        assert measured[id(policy.verify_cost)] == 1 and max(policy.verify_cost) == 128
        assert measured[id(policy.rows_cost)] == 4 and sorted(policy.rows_cost) == [1, 2, 3, 4]
    assert measured[id(run.verify_cost["native"])] == 8
    model = concurrency_payload(run)["pass_costs"]["native"]
    assert model["rows"]["1"] == model["tokens"]["1"] == 1.0 and len(model["rows"]) == 4


def test_every_batch_size_decodes_the_same_prompts_in_closed_batches() -> None:
    """B = 3 over 7 prompts runs batches of 3, 3 and 1, in order, and merges them: tokens
    and seconds summed, per-request tokens/s averaged over the 7 requests and mean γ over
    the rounds (not over the batches: a batch of many rounds weighs more), the forward
    share over the time."""
    seen: list[list[int]] = []

    def run(chunk):
        seen.append([ids[0] for ids in chunk])
        n = len(chunk)
        return _Record(tokens=[list(ids) for ids in chunk], new_tokens=10 * n, seconds=float(n),
                       per_request=float(n), mean_gamma=float(n), passes=2 * n,
                       forward_share=0.5 if n == 3 else 1.0, rounds=4 * n)  # fmt: skip

    merged = in_batches(run, [[i] for i in range(7)], 3)
    assert seen == [[0, 1, 2], [3, 4, 5], [6]]
    assert merged.tokens == [[i] for i in range(7)] and merged.new_tokens == 70
    assert merged.seconds == 7.0 and merged.passes == 14 and merged.rounds == 28
    assert merged.per_request == (3 * 3 + 3 * 3 + 1 * 1) / 7
    assert merged.mean_gamma == (3 * 12 + 3 * 12 + 1 * 4) / 28  # not (3 + 3 + 1) / 3
    assert merged.forward_share == (0.5 * 3 + 0.5 * 3 + 1.0 * 1) / 7
    plain = in_batches(lambda chunk: _Record([[0]], 1, 1.0, 1.0, 0.0, 1, None, 0), [[0], [1]], 1)
    assert plain.mean_gamma == 0.0 and plain.forward_share is None


def test_vs_plain_pairs_each_repeat_with_plain_decoding_of_the_same_repeat() -> None:
    """×plain is the median of the per-repeat ratios (here 1.10, 0.96, 0.857 -> 0.96), not
    the ratio of the medians (60 / 70 = 0.857): a slow repeat for both setups cancels."""
    from speculative.bench.concurrency import _cells

    def run(tokens_per_second: float) -> _Record:
        return _Record([[0]], 96, 96 / tokens_per_second, 1.0, 0.0, 1, None, 0)

    records = {
        ("native", PLAIN): [run(100), run(50), run(70)],
        ("native", "x"): [run(110), run(48), run(60)],
    }
    cells = {c.setup: c for c in _cells(4, records)}
    assert cells["x"].vs_plain == pytest.approx(48 / 50)
    assert cells["x"].tokens_per_second == pytest.approx(60)  # the median repeat's rate
    assert cells[PLAIN].vs_plain == 1.0


def test_batch_sizes_are_interleaved_across_repeats(
    tiny_target, prompts_text, single_thread, monkeypatch
) -> None:
    """Each repeat runs every batch size, the order reversed every other repeat, so B = 1
    and B = 4 (the ×B=1 ratio) run minutes apart at most, never a whole sweep apart."""
    import speculative.bench.concurrency as concurrency

    order: list[int] = []
    original = concurrency.run_engine_batch

    def recorded(target, prompts, *args, **kwargs):
        order.append(len(prompts))
        return original(target, prompts, *args, **kwargs)

    monkeypatch.setattr(concurrency, "run_engine_batch", recorded)
    settings = ConcurrencySettings(
        target=str(tiny_target), runtimes=("native",), concurrency=(1, 4), repeats=2,
        max_new_tokens=2, chat=False, progress=False, curve_repeats=1, peers=False,
        roofline=False,
    )  # fmt: skip
    run = run_concurrency(settings, parse_prompts(prompts_text))
    sizes = [size for i, size in enumerate(order) if i == 0 or order[i - 1] != size]
    # repeat 1: four closed batches of 1, then one of 4; repeat 2: B = 4 first
    assert sizes == [1, 4, 1] and order.count(4) == 2 * 3
    assert {c.batch for c in run.cells} == {1, 4}
