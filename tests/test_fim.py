"""Fill in the middle: a completion's ``suffix`` becomes a prompt in the prefix, suffix,
middle layout code models are trained on, for tokenizers with those tokens.

A tiny Llama with a byte-level tokenizer and StarCoder's three tokens is trained in the
fixture (about a second) to answer the fill-in-the-middle prompt with one text and the
same prefix alone with another. Served with the suffix it writes the middle (the layout
reached the model as trained); without it, the other text (the control).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_helpers import http, start_server
from speculative.targets import FIM_TOKENS, encode_infill, fim_tokens
from tiny import byte_tokenizer, save_tiny, save_trained

PREFIX = "def double(x):\n    return "
SUFFIX = "\n\nprint(double(2))\n"
MIDDLE = "x * 2"
OTHER = "None"  # what the model answers the prefix alone


def _fim_tokenizer(names: tuple[str, str, str] = FIM_TOKENS[0]):
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(list(names), special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def infiller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained to answer PREFIX + SUFFIX as fill in the middle with MIDDLE,
    and PREFIX alone with OTHER."""
    tokenizer = _fim_tokenizer()
    answers = [
        (encode_infill(tokenizer, PREFIX, SUFFIX), MIDDLE),
        (list(tokenizer(PREFIX)["input_ids"]), OTHER),
    ]
    return save_trained(tmp_path_factory.mktemp("fim"), tokenizer, answers, seed=3)


def test_known_fill_in_the_middle_tokens_and_the_prompt_layout() -> None:
    for names in FIM_TOKENS:
        tokenizer = _fim_tokenizer(names)
        vocab = tokenizer.get_vocab()
        assert fim_tokens(tokenizer) == tuple(vocab[name] for name in names)
        ids = encode_infill(tokenizer, "ab", "cd")
        assert tokenizer.convert_ids_to_tokens(ids) == [names[0], "a", "b", names[1], "c", "d",
                                                        names[2]]  # fmt: skip
        assert encode_infill(tokenizer, [7, 8], "cd") == [vocab[names[0]], 7, 8, *ids[3:]]
    assert fim_tokens(byte_tokenizer()) is None
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        encode_infill(byte_tokenizer(), "ab", "cd")


def test_a_suffix_is_filled_in_before(infiller: Path, tmp_path: Path) -> None:
    tokenizer = _fim_tokenizer()
    with start_server(infiller, max_prompt_tokens=200) as server:
        url = server.url + "/v1/completions"
        model = http(server.url + "/v1/models")[1]["data"][0]["id"]
        base = {"model": model, "prompt": PREFIX, "max_tokens": 20, "temperature": 0}
        status, plain = http(url, "POST", base)
        assert status == 200 and plain["choices"][0]["text"] == OTHER  # the control
        for prompt in (PREFIX, tokenizer(PREFIX, add_special_tokens=False)["input_ids"]):
            status, body = http(url, "POST", {**base, "prompt": prompt, "suffix": SUFFIX})
            assert status == 200, body
            assert body["choices"][0]["text"] == MIDDLE
            assert body["choices"][0]["finish_reason"] == "stop"
            expected = encode_infill(tokenizer, prompt, SUFFIX)
            assert body["usage"]["prompt_tokens"] == len(expected)
        status, empty = http(url, "POST", {**base, "suffix": ""})  # as clients send it
        assert status == 200 and empty["choices"][0]["text"] == OTHER
        status, refused = http(url, "POST", {**base, "suffix": SUFFIX, "echo": True})
        assert status == 400 and refused["error"]["param"] == "suffix"
    plain_model = save_tiny(tmp_path / "plain", seed=1, tokenizer=byte_tokenizer())
    with start_server(plain_model, max_prompt_tokens=200) as server:
        model = http(server.url + "/v1/models")[1]["data"][0]["id"]
        request = {**base, "model": model, "suffix": "x"}
        status, refused = http(server.url + "/v1/completions", "POST", request)
        assert status == 400 and refused["error"]["param"] == "suffix"
        assert "fill-in-the-middle" in refused["error"]["message"]


def test_the_library_and_generate_fill_in_the_middle(infiller: Path, capsys) -> None:
    from speculative.cli.main import main
    from speculative.pipeline import Speculator

    speculator = Speculator.load(str(infiller), draft="ngram")
    assert speculator.generate(PREFIX, suffix=SUFFIX, max_new_tokens=20).text == MIDDLE
    assert speculator.generate(PREFIX, chat=False, max_new_tokens=20).text == OTHER  # control
    with pytest.raises(ValueError, match="raw prompt"):
        speculator.stream(PREFIX, suffix=SUFFIX, chat=True)
    argv = ["generate", "--target", str(infiller), "--draft", "ngram", "--max-new-tokens", "20"]
    assert main([*argv, "--json", PREFIX, "--suffix", SUFFIX]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == MIDDLE
    assert main([*argv, PREFIX, "--suffix", SUFFIX, "--no-color"]) == 0
    assert capsys.readouterr().out == MIDDLE + "\n"


def test_min_tokens_holds_the_end_back(infiller: Path, capsys) -> None:
    """The trained model ends its middle (5 tokens) with end-of-sequence; ``min_tokens``
    holds it back, in the library and on the command line, and a stop string inside
    those tokens does not count."""
    from speculative.cli.main import main
    from speculative.pipeline import Speculator

    speculator = Speculator.load(str(infiller), draft="ngram")
    short = speculator.generate(PREFIX, suffix=SUFFIX, max_new_tokens=30)
    assert short.finish_reason == "eos" and len(short.token_ids) == len(MIDDLE) + 1
    held = speculator.generate(PREFIX, suffix=SUFFIX, max_new_tokens=30, min_tokens=9)
    assert held.text.startswith(MIDDLE) and len(held.token_ids) >= 10
    assert speculator.target.eos_token_ids.isdisjoint(held.token_ids[:9])
    argv = ["generate", "--target", str(infiller), "--max-new-tokens", "30", PREFIX,
            "--suffix", SUFFIX, "--json"]  # fmt: skip
    assert main([*argv, "--min-tokens", "9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == held.token_ids
    # a stop string inside the first min_tokens tokens does not count (vLLM's)
    assert speculator.generate(PREFIX, suffix=SUFFIX, max_new_tokens=30, stop=[" "]).text == "x"
    spaced = speculator.generate(PREFIX, suffix=SUFFIX, max_new_tokens=30, min_tokens=9,
                                 stop=[" "])  # fmt: skip
    assert spaced.text.startswith(MIDDLE)
    assert main([*argv, "--min-tokens", "9", "--stop", " "]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] == spaced.text and out["token_ids"] == spaced.token_ids
