"""The command line: tables, JSON as the last stdout line, one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from speculative.cli.main import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits on usage errors and --help
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_theory_table_and_json(capsys, tmp_path):
    plot = tmp_path / "chart.png"
    code, out, _ = run_cli(
        capsys,
        "theory",
        "--alpha",
        "0.5",
        "0.6",
        "0.7",
        "0.8",
        "0.9",
        "--c",
        "0.1",
        "--plot",
        str(plot),
        "--json",
    )
    assert code == 0
    assert " 0.9      10         3.43x        10.0x" in out
    rows = last_json(out)["rows"]
    assert [r["best_gamma"] for r in rows] == [2, 3, 4, 6, 10]
    assert [round(r["speedup"], 2) for r in rows] == [1.46, 1.67, 1.98, 2.47, 3.43]
    assert set(rows[0]) >= {"alpha", "best_gamma", "speedup", "ceiling"}
    assert plot.stat().st_size > 10_000


def test_simulate_markov_json(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--sequences", "3000", "--json")
    assert code == 0
    data = last_json(out)
    for key in (
        "target_freq",
        "speculative_freq",
        "max_abs_diff",
        "standard_error",
        "tokens_per_target_call",
        "target_calls_saved",
    ):
        assert key in data
    assert 3.4 < data["tokens_per_target_call"] < 3.7
    assert "tokens per target call" in out


@pytest.mark.parametrize("experiment", ["step", "rounds"])
def test_simulate_other_experiments(capsys, experiment):
    code, out, _ = run_cli(
        capsys,
        "simulate",
        "--experiment",
        experiment,
        "--draws",
        "20000",
        "--trials",
        "2000",
        "--json",
    )
    assert code == 0 and last_json(out)["experiment"] == experiment


@pytest.mark.parametrize(
    "argv",
    [
        ["theory", "--alpha", "1.5", "--c", "0.1"],
        ["theory", "--alpha", "0.5", "--c", "-1"],
        ["theory", "--alpha", "0.5", "--c", "0.1", "--max-gamma", "0"],
        ["simulate", "--gamma", "0"],
        ["simulate", "--vocab", "1"],
        ["bench-serve", "--serve-gamma", "heuristic"],
        ["bench-serve", "--url", "http://127.0.0.1:9", "--serve-gamma", "auto"],
        ["nonsense"],
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv):
    code, _out, err = run_cli(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_serve_starts_its_server_with_the_serve_gamma():
    """bench-serve's own server gets --serve-gamma (the load-aware "auto" included), and
    serve's default when it is not given."""
    from speculative.cli.bench_serve_cmd import serve_command
    from speculative.cli.main import build_parser

    args = build_parser().parse_args(["bench-serve", "--serve-gamma", "auto"])
    command = serve_command(args, 8123)
    assert command[command.index("--gamma") + 1] == "auto"
    default = serve_command(build_parser().parse_args(["bench-serve"]), 8123)
    assert "--gamma" not in default and default[default.index("--port") + 1] == "8123"


def test_help_explains_terms(capsys):
    code, out, _ = run_cli(capsys, "theory", "--help")
    assert code == 0 and "acceptance" in out and "ceiling" in out


def test_console_script_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "speculative.cli.main", "theory", "--alpha", "0.8", "--c", "0.1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "2.47x" in proc.stdout


@pytest.mark.parametrize("command", ["generate", "check", "bench", "demo", "chat"])
def test_help_lists_registry_drafters_and_no_flag_defaults(capsys, command):
    from speculative.drafters.registry import REGISTRY

    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    for nonsense in ("(default: True)", "(default: False)", "(default: None)"):
        assert nonsense not in out, nonsense
    if command in ("generate", "check", "chat"):
        for entry in REGISTRY:  # every registry drafter, self-int4 included
            assert f"\n  {entry.prefix}" in out, entry.prefix
        assert "self-int4" in out


def test_demo_and_generate_draft_with_the_shipped_head_where_one_ships(capsys, tmp_path):
    """With no --draft, `demo` and `generate` take the `default` drafter: `auto` (n-gram or
    the shipped EAGLE head) for a target named as the default model, which ships a head,
    where its runtime gives features; `ngram` for a target without a head or without
    features (no error). The runs' outputs are those of plain decoding."""
    from dataclasses import replace

    from server_helpers import tiny_chat_folder
    from speculative.drafters.registry import build_drafter, default_drafter_name
    from speculative.models.markov import MarkovLM
    from speculative.targets import load_target

    folder = tiny_chat_folder(tmp_path / "tiny")
    tiny = load_target(str(folder), "native")
    assert default_drafter_name(tiny) == "ngram"
    assert build_drafter("default", tiny).name == "ngram"
    named = replace(tiny, name="smollm2-135m-instruct")  # the shipped head's target name
    assert default_drafter_name(named) == "auto"
    no_features = replace(named, lm=MarkovLM(torch.full((4, 4), 0.25)))
    assert default_drafter_name(no_features) == "ngram"
    with pytest.raises(ValueError, match="takes no argument"):
        build_drafter("default:x", tiny)
    args = ["demo", "--target", str(folder), "--max-new-tokens", "12", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["draft"] == "ngram" and report["outputs_identical"] is True
    base = ["generate", "--target", str(folder), "--prompt", "hello", "--max-new-tokens", "8"]
    texts = {}
    for draft in ([], ["--draft", "none"]):
        code, out, _err = run_cli(capsys, *base, *draft, "--json")
        assert code == 0
        texts[bool(draft)] = json.loads(out.splitlines()[-1])
    assert (texts[False]["draft"], texts[True]["draft"]) == ("ngram", "none")  # which ran
    assert texts[False]["token_ids"] == texts[True]["token_ids"]
    assert texts[False]["stats"]["target_calls"] < texts[True]["stats"]["target_calls"]
    code, _out, err = run_cli(capsys, *base)
    assert code == 0 and "· draft ngram]" in err


def test_generate_takes_a_kv_cache_type_and_refuses_one_for_transformers(capsys, tmp_path):
    """``--kv-cache fp16`` runs the native runtime on a half-float cache (greedy speculation
    still equals plain decoding on it); transformers keeps its own cache, so asking it for
    one is a one-line error."""
    from server_helpers import tiny_chat_folder

    folder = str(tiny_chat_folder(tmp_path / "tiny"))
    base = ["generate", "--target", folder, "--prompt", "hello", "--max-new-tokens", "8"]
    texts = {}
    for draft in ("ngram", "none"):
        code, out, _err = run_cli(
            capsys, *base, "--runtime", "native", "--kv-cache", "fp16", "--draft", draft, "--json"
        )
        assert code == 0
        texts[draft] = last_json(out)["token_ids"]
    assert texts["ngram"] == texts["none"]
    code, _out, err = run_cli(capsys, *base, "--runtime", "hf", "--kv-cache", "fp16")
    assert code == 2 and "transformers keeps its own cache" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _chat_folder(tmp_path):
    """A tiny Llama whose chat template's generation prompt opens the assistant's turn
    (as ChatML's does), so that a turn's prompt and reply begin the next turn's prompt."""
    from tiny import save_tiny, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    return save_tiny(tmp_path / "chat", seed=3, tokenizer=tokenizer)


def test_chat_replies_from_the_cached_conversation_as_a_fresh_generation(
    capsys, monkeypatch, tmp_path
):
    """`speculative chat` (piped input, --json): each reply is what a fresh speculator
    gives for the whole conversation (turn n with seed + n), while the cache spares the
    earlier turns; /undo, /system and a message too long for the context (an error line,
    the chat goes on) behave as their help says."""
    import io

    from speculative.drafters.ngram import PromptLookupDrafter
    from speculative.pipeline import Speculator
    from speculative.targets import load_target
    from tiny import save_tiny

    folder = _chat_folder(tmp_path)
    lines = ["hello there", "and then?", "/undo", "and then?", "the " * 2100, "/nope",
             "/system be brief", "hi", "/exit", "never read"]  # fmt: skip
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    sampling = ["--temperature", "0.9", "--seed", "5", "--max-new-tokens", "10"]
    code, out, err = run_cli(capsys, "chat", "--target", str(folder), "--runtime", "native",
                             "--draft", "ngram", "--gamma", "3", "--json", *sampling)  # fmt: skip
    assert code == 0, err
    *replies, summary = [json.loads(line) for line in out.strip().splitlines()]
    assert len(replies) == 4 and "error:" in err and "unknown command /nope" in err
    first, second, again, brief = replies
    assert first["computed_prompt_tokens"] == first["prompt_tokens"]
    assert second["computed_prompt_tokens"] < second["prompt_tokens"] // 2  # turn 1 cached
    assert again["computed_prompt_tokens"] < again["prompt_tokens"] // 2  # after /undo
    fresh = Speculator(load_target(str(folder), "native"), PromptLookupDrafter(), 3)
    turn_one = [{"role": "user", "content": "hello there"}]
    history = [*turn_one, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "and then?"}]  # fmt: skip
    options = {"chat": True, "temperature": 0.9, "max_new_tokens": 10}
    assert fresh.generate(messages=turn_one, seed=5, **options).text == first["text"]
    assert fresh.generate(messages=history, seed=6, **options).text == second["text"]
    assert fresh.generate(messages=history, seed=7, **options).text == again["text"]
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert fresh.generate(messages=system, seed=8, **options).text == brief["text"]
    assert summary["turns"] == 4 and summary["messages"][:2] == system
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    plain = tmp_path / "plain"
    save_tiny(plain, seed=3)  # a tokenizer without a chat template
    code, _, err = run_cli(capsys, "chat", "--target", str(plain), "--runtime", "native")
    assert code == 2 and "chat template" in err


def test_chat_stopped_inside_a_round_forgets_its_cache(capsys, monkeypatch, tmp_path):
    """Ctrl-C while a reply streams: the text so far stays in the conversation, and the
    next turn starts on an empty cache (all its prompt computed), exactly a fresh
    generation."""
    import io
    import re

    from speculative.cli.streaming import TextStreamer
    from speculative.pipeline import Speculator
    from speculative.targets import load_target

    folder = _chat_folder(tmp_path)
    push, calls = TextStreamer.push, []

    def interrupted(self, round_):
        calls.append(round_)
        if len(calls) == 2:  # inside the first reply's second round
            raise KeyboardInterrupt
        push(self, round_)

    monkeypatch.setattr(TextStreamer, "push", interrupted)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand then?\n"))
    code, out, err = run_cli(capsys, "chat", "--target", str(folder), "--runtime", "native",
                             "--draft", "none", "--max-new-tokens", "8", "--no-color")  # fmt: skip
    assert code == 0 and err.count("(stopped)") == 1
    first, second = out.strip().splitlines()
    counts = re.findall(r"prompt (\d+) tokens, (\d+) computed", err)
    (prompt, computed) = counts[-1]  # the second turn's
    assert computed == prompt  # nothing reused after the interruption
    history = [{"role": "user", "content": "hello there"},
               {"role": "assistant", "content": first},
               {"role": "user", "content": "and then?"}]  # fmt: skip
    fresh = Speculator(load_target(str(folder), "native"), None)
    assert fresh.generate(messages=history, chat=True, max_new_tokens=8).text == second
