"""Structured outputs: JSON by a schema, as a grammar constraint on a real tiny model.

A tiny seeded Llama (native runtime) with a byte-level tokenizer: unconstrained, its text
is noise (the control); constrained by a JSON schema, every output, sampled or greedy,
plain or speculative, parses and satisfies the schema, and greedy speculative decoding
(chains and trees) emits plain constrained greedy decoding's tokens. That speculation
samples the constrained target's law exactly is `tests/test_engine_markov.py`'s
enumerated test (with its negative control); here, that the grammar is the constraint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculative.drafters.ngram import PromptLookupDrafter
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.tree import make_tree_round
from speculative.models.native import load_native
from speculative.sampling import SamplingParams
from speculative.structured import ANY_OBJECT, GrammarConstraint, StructuredOutputs
from tiny import byte_tokenizer, save_tiny

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["n", "ok", "tags"],
    "additionalProperties": False,
}
PROMPT = 'Give me {"n": 1, "ok": true, "tags": ["ab"]} again: '
EOS = 1


def satisfies(value: object) -> bool:
    """Whether ``value`` satisfies SCHEMA (written out, not by the code under test)."""
    return (
        isinstance(value, dict)
        and set(value) == {"n", "ok", "tags"}
        and type(value["n"]) is int
        and type(value["ok"]) is bool
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 2
        and all(isinstance(tag, str) and len(tag) <= 3 for tag in value["tags"])
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server_helpers import CHAT_TEMPLATE

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # for the server's chat endpoint
    return save_tiny(tmp_path_factory.mktemp("tiny_bytes"), seed=4, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def outputs() -> StructuredOutputs:
    return StructuredOutputs(byte_tokenizer(), {EOS})


def _generate(folder, constraint, params, seed=0, drafter=None, tree=None, budget=160):
    tokenizer = byte_tokenizer()
    target = load_native(folder, max_length=256)
    engine = SpeculativeEngine(target, drafter, 4, tree=tree)
    prompt = tokenizer(PROMPT)["input_ids"]
    stop = StopCriteria(budget, frozenset({EOS}))
    result = engine.generate(prompt, params, stop, torch.Generator().manual_seed(seed), None,
                             constraint)  # fmt: skip
    return result, tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_sampled_outputs_satisfy_the_schema(folder: Path, outputs: StructuredOutputs) -> None:
    """Sampled at temperature 1, plain and with n-gram drafts, every constrained output
    ends (end-of-sequence, within budget) as JSON that satisfies the schema; the same
    model unconstrained writes no JSON at all."""
    make = outputs.json_schema(SCHEMA)
    params = SamplingParams(temperature=1.0)
    for seed in range(4):
        for drafter in (None, PromptLookupDrafter(3)):
            result, text = _generate(folder, make(), params, seed, drafter)
            assert result.finish_reason == "eos", text
            assert satisfies(json.loads(text)), text
    free = [_generate(folder, None, params, seed)[1] for seed in range(4)]
    for text in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_greedy_speculation_keeps_constrained_greedy_tokens(
    folder: Path, outputs: StructuredOutputs
) -> None:
    """Constrained greedy decoding, plain, with n-gram chains and with token trees, emits
    the same tokens, valid JSON of any object (``json_object``)."""
    make = outputs.json_schema(ANY_OBJECT)
    greedy = SamplingParams(temperature=0)
    plain, text = _generate(folder, make(), greedy)
    assert isinstance(json.loads(text), dict)
    drafter = PromptLookupDrafter(3)
    chain, _ = _generate(folder, make(), greedy, drafter=drafter)
    tree_drafter = PromptLookupDrafter(3)
    tree = make_tree_round("static", tree_drafter, 4)
    trees, _ = _generate(folder, make(), greedy, drafter=tree_drafter, tree=tree)
    assert chain.token_ids == trees.token_ids == plain.token_ids
    assert chain.stats.drafted_tokens > 0 and trees.stats.drafted_tokens > 0


def test_the_grammars_forced_tokens_are_drafted(
    folder: Path, outputs: StructuredOutputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a drafter, the tokens the schema forces (its keys and punctuation) are
    drafted and verified in passes of their own: fewer target passes than tokens, the
    same greedy tokens as decoding them one by one (forced drafts turned off); rows that
    draft token trees take them too."""
    make = outputs.json_schema(SCHEMA)
    greedy = SamplingParams(temperature=0)
    drafted, _ = _generate(folder, make(), greedy)
    monkeypatch.setattr(GrammarConstraint, "forced", lambda self, limit: [])
    one_by_one, _ = _generate(folder, make(), greedy)
    assert drafted.token_ids == one_by_one.token_ids
    assert one_by_one.stats.drafted_tokens == 0
    assert drafted.stats.accepted_tokens >= 10  # '{"n": ', ', "ok": ', ', "tags": ['
    assert drafted.stats.target_calls <= one_by_one.stats.target_calls - 10
    # rows that draft token trees draft the forced tokens as a chain-shaped tree
    monkeypatch.undo()
    tree_drafter = PromptLookupDrafter(3)
    tree = make_tree_round("static", tree_drafter, 4)
    trees, _ = _generate(folder, make(), greedy, drafter=tree_drafter, tree=tree)
    monkeypatch.setattr(GrammarConstraint, "forced", lambda self, limit: [])
    tree_drafter = PromptLookupDrafter(3)
    tree = make_tree_round("static", tree_drafter, 4)
    unforced, _ = _generate(folder, make(), greedy, drafter=tree_drafter, tree=tree)
    assert trees.token_ids == unforced.token_ids == drafted.token_ids
    assert trees.stats.target_calls < unforced.stats.target_calls


def test_a_lookup_continues_the_forced_tokens_in_their_round(
    folder: Path, outputs: StructuredOutputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With n-gram lookup as the drafter, a round that drafts the grammar's forced tokens
    continues them with the lookup (the prompt holds the same keys with their values):
    fewer target passes than forced drafts alone, the same greedy tokens."""
    from speculative.engine.batch import BatchEngine

    make = outputs.json_schema(SCHEMA)
    greedy = SamplingParams(temperature=0)
    continued, _ = _generate(folder, make(), greedy, drafter=PromptLookupDrafter(3))
    monkeypatch.setattr(BatchEngine, "_after_forced", lambda self, row, forced, gamma: forced)
    alone, _ = _generate(folder, make(), greedy, drafter=PromptLookupDrafter(3))
    assert continued.token_ids == alone.token_ids
    assert continued.stats.target_calls < alone.stats.target_calls


def test_regex_choice_and_grammar_outputs_match(folder: Path) -> None:
    """A regular expression, a list of choices and a Lark grammar, through the library
    (`Speculator.generate`), sampled with n-gram drafts: every output matches in full (the
    model unconstrained matches none: the first test's control)."""
    import re

    from speculative.pipeline import Speculator

    spec = Speculator.load(str(folder), "ngram", 3, "native")
    choices = ["red", "green", "blue", 'a "quoted" one']
    lark = 'start: num ("+" num)*\nnum: /[0-9]{1,2}/'
    seen = set()
    for seed in range(4):
        kw = {"chat": False, "max_new_tokens": 24, "temperature": 1.0, "seed": seed}
        out = spec.generate(PROMPT, regex="[a-c]{2,4}-[0-9]{1,3}", **kw)
        assert re.fullmatch("[a-c]{2,4}-[0-9]{1,3}", out.text), out.text
        out = spec.generate(PROMPT, choice=choices, **kw)
        assert out.text in choices and out.finish_reason == "eos"
        seen.add(out.text)
        out = spec.generate(PROMPT, grammar=lark, **{**kw, "max_new_tokens": 40})
        if out.finish_reason == "eos":
            assert re.fullmatch(r"[0-9]{1,2}(\+[0-9]{1,2})*", out.text), out.text
        else:  # the budget cut it: a prefix of a sentence
            assert re.fullmatch(r"[0-9]{1,2}(\+[0-9]{1,2})*\+?", out.text), out.text
    with pytest.raises(ValueError, match="one output format"):
        spec.generate(PROMPT, regex="a", choice=["b"])


def test_restrict_leaves_exactly_the_allowed_tokens(outputs: StructuredOutputs) -> None:
    """Each row keeps the tokens the grammar allows after output + its drafted tokens
    (masks alternating between states, so a stale cached mask would show); every token
    past the tokenizer's mask is refused; a row after a refused draft is left as is."""
    tokenizer = byte_tokenizer()
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    constraint = outputs.regex("ab+")()
    logits = torch.zeros(4, 400)  # a vocabulary wider than the tokenizer's mask (288)
    constraint.restrict(logits, [[], [a], [a, b], [b]])
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert kept[:3] == [{a}, {b}, {b, EOS}] and kept[3] == set(range(400))
    logits = torch.zeros(2, 400)
    constraint.restrict(logits, [[], [a]])
    assert [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in logits] == [{a}, {b}]


def test_bad_schemas_and_tokenizers_are_refused_with_reasons() -> None:
    from tiny import tiny_tokenizer

    outputs = StructuredOutputs(byte_tokenizer(), {EOS})
    with pytest.raises(ValueError, match="not valid JSON"):
        outputs.json_schema("{not json")
    with pytest.raises(ValueError, match="is an object"):
        outputs.json_schema("[1, 2]")
    with pytest.raises(ValueError, match="cannot be used"):
        outputs.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="the regex cannot be used"):
        outputs.regex("[0-9")
    with pytest.raises(ValueError, match="the grammar cannot be used"):
        outputs.lark("start: missing_rule")
    with pytest.raises(ValueError, match="non-empty strings"):
        outputs.choice([])
    with pytest.raises(ValueError, match="cannot use this tokenizer"):
        StructuredOutputs(tiny_tokenizer(), {EOS})  # word-level: no byte strings


def test_served_json_is_the_command_lines(folder: Path, tmp_path: Path) -> None:
    """``response_format`` on the server: a JSON schema's greedy output (with n-gram
    drafts) is `speculative generate --json-schema`'s, choices sampled together satisfy
    it, `json_object` gives a JSON object, and a schema that cannot be compiled is a 400
    naming response_format."""
    import contextlib
    import io

    openai = pytest.importorskip("openai")
    from server_helpers import start_server
    from speculative.cli.main import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--target", str(folder), "--runtime", "native", "--json",
                     "--no-chat", "--prompt", PROMPT, "--max-new-tokens", "160", "--draft",
                     "ngram", "--temperature", "0", "--json-schema", str(schema_file)])  # fmt: skip
    assert code == 0
    expected = json.loads(out.getvalue().splitlines()[-1])["text"]
    assert satisfies(json.loads(expected))
    with start_server(folder, max_prompt_tokens=128) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        schema_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=160, temperature=0,
            extra_body={"response_format": schema_format, "speculative": {"draft": "ngram"}},
        )  # fmt: skip
        assert answer.choices[0].text == expected
        assert answer.choices[0].finish_reason == "stop"
        sampled = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=160, temperature=1.0, n=2, seed=1,
            extra_body={"response_format": schema_format, "speculative": {"draft": "ngram"}},
        )  # fmt: skip
        for choice in sampled.choices:
            assert satisfies(json.loads(choice.text)) and choice.finish_reason == "stop"
        anything = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=160, temperature=0,
            extra_body={"response_format": {"type": "json_object"}},
        )  # fmt: skip
        assert isinstance(json.loads(anything.choices[0].text), dict)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=160,
            temperature=0, response_format=schema_format, stream=True,
            extra_body={"speculative": {"draft": "ngram"}},
        )  # fmt: skip
        content = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert satisfies(json.loads(content)), content
        bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, extra_body={"response_format": bad}
            )
        assert caught.value.body["param"] == "response_format"
        # vLLM's structured_outputs and its earlier guided_* names
        for extra in ({"structured_outputs": {"choice": ["yes", "no"]}},
                      {"guided_choice": ["yes", "no"]}):  # fmt: skip
            answer = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=2,
                extra_body=extra,
            )  # fmt: skip
            assert {choice.text for choice in answer.choices} <= {"yes", "no"}
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0,
            extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
        )  # fmt: skip
        assert len(answer.choices[0].text) == 3 and answer.choices[0].text.isdigit()
        for extra in ({"guided_regex": "a", "guided_choice": ["b"]},
                      {"guided_regex": "a", "response_format": {"type": "json_object"}},
                      {"structured_outputs": {"regex": "a", "choice": ["b"]}},
                      {"structured_outputs": {"grammar": "start: nowhere"}}):  # fmt: skip
            with pytest.raises(openai.BadRequestError):
                client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=8, extra_body=extra
                )


def test_command_line_formats(folder: Path, tmp_path: Path, capsys) -> None:
    """`generate --choice`, and a `--prompts` job whose records carry their own formats
    (a regex, a choice, a JSON schema, none); two formats at once are refused."""
    import re

    from test_cli import last_json, run_cli

    base = ["generate", "--target", str(folder), "--runtime", "native", "--no-chat"]
    base += ["--max-new-tokens", "24", "--temperature", "1.0", "--draft", "ngram"]
    code, out, err = run_cli(capsys, *base, "--prompt", PROMPT, "--json", "--choice", "up", "down")
    assert code == 0, err
    assert last_json(out)["text"] in {"up", "down"}
    records = [
        {"prompt": PROMPT, "regex": "[xyz]{4}", "seed": 1},
        {"prompt": PROMPT, "choice": ["left", "right"], "seed": 2},
        {"prompt": PROMPT, "json_schema": SCHEMA, "max_new_tokens": 160, "seed": 3},
        {"prompt": PROMPT, "seed": 4},
    ]
    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, err = run_cli(capsys, *base, "--prompts", str(prompts), "--out", str(results))
    assert code == 0, err
    texts = [json.loads(line)["text"] for line in results.read_text().splitlines()]
    assert re.fullmatch("[xyz]{4}", texts[0]) and texts[1] in {"left", "right"}
    assert satisfies(json.loads(texts[2]))
    assert not re.fullmatch("[xyz]{4}", texts[3])  # free text: the model's noise
    code, _, err = run_cli(capsys, *base, "--prompt", PROMPT, "--regex", "a", "--choice", "b")
    assert code == 2 and "not allowed with argument" in err
