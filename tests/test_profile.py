"""`speculative profile` and `--gamma auto` calibration on tiny in-process models."""

from __future__ import annotations

import json

import pytest

from speculative.cli.main import main
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
    assert data["verify_cost"]["1"] == 1.0 and len(data["verify_cost"]) == 4
    assert [(r["runtime"], r["backend"]) for r in data["runtimes"]] == [
        ("native", "kernels"),
        ("native", "torch"),
        ("hf", None),
    ]
    assert data["draft_cost"]["ngram"] >= 0 and data["draft_cost"]["self-bf16"] > 0
    assert data["decode_ms_per_token"] > 0


@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_gamma_auto_calibrates_and_stays_exact(tmp_path, runtime):
    folder = save_tiny(tmp_path / "tiny", layers=2)
    target = load_target(str(folder), runtime)
    plain = Speculator(target, None).generate("the cat sat on", max_new_tokens=24, chat=False)
    auto = Speculator(target, build_drafter("self-bf16", target), "auto")
    out = auto.generate("the cat sat on", max_new_tokens=24, chat=False)
    assert auto.draft_cost is not None and auto.draft_cost > 0
    assert auto.verify_cost is not None and auto.verify_cost[1] == 1.0
    assert out.token_ids == plain.token_ids
