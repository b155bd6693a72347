"""`speculative profile` and `--gamma auto` calibration on tiny in-process models."""

from __future__ import annotations

import json

import pytest

from speculative.cli.main import main
from speculative.engine import AdaptiveGamma
from speculative.pipeline import Speculator, build_drafter, load_target
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
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
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
    assert data["verify_cost"]["4"] < 4  # 4 tokens in one pass beat 4 steps
    assert [(r["runtime"], r["backend"]) for r in data["runtimes"]] == [
        ("native", "kernels"),
        ("native", "torch"),
        ("hf", None),
    ]
    # an n-gram lookup costs far less than a draft model's forward
    assert 0 < data["draft_cost"]["ngram"] < data["draft_cost"]["self-bf16"]


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
