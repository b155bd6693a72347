"""`speculative profile` and `--gamma auto` calibration on tiny in-process models."""

from __future__ import annotations

import json

import pytest

from speculative.cli.main import main
from speculative.drafters.registry import build_drafter
from speculative.engine import AdaptiveGamma
from speculative.pipeline import Speculator
from speculative.targets import load_target
from tiny import save_tiny

pytestmark = pytest.mark.usefixtures("single_thread")


def test_profile_json(tmp_path, capsys):
    folder = save_tiny(tmp_path / "tiny", layers=2)
    code = main(
        [
            "profile",
            "--target",
            str(folder),
            "--runtime",
            "native",
            "hf",
            "--backend",
            "kernels",
            "torch",
            "--drafters",
            "ngram",
            "self-bf16",
            "--max-k",
            "4",
            "--repeats",
            "2",
            "--ops",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    # --ops: where each T(k) goes, op by op, on the C kernels only
    assert ["op_ms" in r for r in data["runtimes"]] == [True, False, False]
    assert list(data["runtimes"][0]["op_ms"]) == ["1", "2", "3", "4"]
    assert "where T(k) goes" in out and "attention" in out
    for key in (
        "runtime",
        "decode_ms_per_token",
        "bandwidth_floor_ms",
        "verify_cost",
        "draft_cost",
    ):
        assert key in data
    step = data["decode_ms_per_token"]
    assert step == data["verify_ms"]["1"] and len(data["verify_cost"]) == 4
    for k, cost in data["verify_cost"].items():  # the curve is the reported times ÷ T(1)
        assert cost == pytest.approx(data["verify_ms"][k] / step)
    assert [(r["runtime"], r["backend"]) for r in data["runtimes"]] == [
        ("native", "kernels"),
        ("native", "torch"),
        ("hf", None),
    ]
    assert data["draft_cost"]["ngram"] > 0 and data["draft_cost"]["self-bf16"] > 0


@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_gamma_auto_calibrates_and_stays_exact(tmp_path, runtime):
    folder = save_tiny(tmp_path / "tiny", layers=2)
    target = load_target(str(folder), runtime)
    plain = Speculator(target, None).generate("the cat sat on", max_new_tokens=24, chat=False)
    auto = Speculator(target, build_drafter("self-bf16", target), "auto")
    out = auto.generate("the cat sat on", max_new_tokens=24, chat=False)
    # the measured c and curve are the ones the adaptive policy plans with
    policy = auto.engine().gamma_policy
    assert isinstance(policy, AdaptiveGamma)
    assert auto.draft_cost is not None and policy.c == auto.draft_cost > 0
    assert auto.verify_cost is not None and policy.verify_cost == auto.verify_cost
    assert sorted(auto.verify_cost) == list(range(1, 14))
    assert out.token_ids == plain.token_ids


def test_profile_reports_the_round_overhead(tmp_path, capsys):
    folder = save_tiny(tmp_path / "tiny", layers=2)
    args = ["profile", "--target", str(folder), "--runtime", "native", "--backend", "kernels"]
    # "none" (plain decoding, always measured) may be named too: it used to crash
    args += ["--drafters", "none", "ngram", "--max-k", "2", "--repeats", "1", "--no-roofline"]
    assert main([*args, "--overhead-tokens", "12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["drafter"], r["sampling"]): r for r in data["round_overhead"]}
    assert set(rows) == {(d, s) for d in ("none", "ngram") for s in ("greedy", "T=0.8, top-p=0.95")}
    for row in rows.values():
        assert row["target_ms"] > 0 and row["tokens_per_round"] >= 1
        assert row["overhead_mean_ms"] == pytest.approx(
            row["round_ms"] - row["target_ms"] - row["draft_ms"]
        )
        assert 0 < row["overhead_ms"] < row["round_ms"]
        assert row["overhead_share_of_step"] == pytest.approx(
            row["overhead_ms"] / data["decode_ms_per_token"]
        )
    assert rows[("none", "greedy")]["draft_ms"] == 0  # plain decoding drafts nothing
    # the tiny model's weights fill no 2 MiB page: they stay where torch put them
    assert data["kernels"]["weights"] == "4 KiB pages"
    assert main([*args, "--overhead-tokens", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round_overhead"] == []


def test_timed_calls_time_the_outermost_call_and_restore_the_methods():
    import time

    from speculative.engine.costs import CallClock, timed_calls

    class Model:
        def forward(self, seconds):
            time.sleep(seconds)
            return self.inner(seconds)

        def inner(self, seconds):
            time.sleep(seconds)
            return seconds

    model, clock = Model(), CallClock()
    with timed_calls(model, ["forward", "inner", "absent"], clock):
        assert model.forward(0.01) == 0.01  # inner runs nested: counted once
        assert "forward" in vars(model)
    assert 0.02 <= clock.seconds < 0.2
    assert "forward" not in vars(model) and model.forward(0) == 0
