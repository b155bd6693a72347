"""A drafting corpus on disk: ``corpus.npz`` (the token ids, documents separated) and
``config.json`` naming the target and tokenizer it was tokenized with.

A corpus is token ids, so it only means something to the tokenizer that made them: the
config keeps the vocabulary size and the ids of a probe text, and loading it for a
tokenizer that encodes the probe otherwise fails with a message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "speculative-corpus/1"
TOKENS = "corpus.npz"
CONFIG = "config.json"
PROBE_TEXT = "Hello! Here's a step-by-step guide:\n```python\ndef f(x):\n    return 2 * x\n```"
SEPARATOR = -1  # between documents in memory (stored as the dtype's largest value)


class CorpusMismatch(ValueError):
    """A corpus tokenized by another tokenizer."""


@dataclass(frozen=True)
class Corpus:
    """Token ids of documents, SEPARATOR between them ([n] int64), and where they came
    from."""

    tokens: np.ndarray  # [n]
    target: str
    documents: int
    source: str


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The vocabulary size and the ids of PROBE_TEXT."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return {"vocab_size": int(vocab_size), "probe_ids": [int(i) for i in ids]}


def join_documents(documents: list[list[int]]) -> np.ndarray:
    """One [n] int64 array of the documents, SEPARATOR after each."""
    total = sum(len(d) + 1 for d in documents)
    out = np.empty(total, dtype=np.int64)
    at = 0
    for doc in documents:
        out[at : at + len(doc)] = doc
        out[at + len(doc)] = SEPARATOR
        at += len(doc) + 1
    return out


def save_corpus(
    folder: Path, tokens: np.ndarray, fingerprint: dict[str, Any], target: str, source: str
) -> Path:
    """Write ``tokens`` (SEPARATOR between documents) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = fingerprint["vocab_size"]
    dtype = np.uint16 if vocab < np.iinfo(np.uint16).max else np.uint32
    stored = np.where(tokens == SEPARATOR, np.iinfo(dtype).max, tokens).astype(dtype)
    np.savez_compressed(folder / TOKENS, tokens=stored)
    config = {
        "format": FORMAT,
        "target": target,
        "tokenizer": fingerprint,
        "tokens": len(tokens),
        "documents": int(np.count_nonzero(tokens == SEPARATOR)),
        "source": source,
    }
    (folder / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return folder


def read_corpus_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ValueError(f"{folder} is not a drafting corpus: no {CONFIG}")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{folder}: unknown corpus format {config.get('format')!r}")
    return config


def load_corpus(folder: Path, fingerprint: dict[str, Any]) -> Corpus:
    """The corpus in ``folder``, checked against the tokenizer's ``fingerprint``."""
    config = read_corpus_config(folder)
    expected = config["tokenizer"]
    if expected != fingerprint:
        why = (
            f"vocabulary {fingerprint['vocab_size']} != {expected['vocab_size']}"
            if expected["vocab_size"] != fingerprint["vocab_size"]
            else "the probe text encodes to other ids"
        )
        raise CorpusMismatch(
            f"the corpus in {folder} was tokenized for '{config['target']}', not this "
            f"target's tokenizer ({why}); build one with `speculative build-corpus`"
        )
    with np.load(Path(folder) / TOKENS) as stored:
        raw = stored["tokens"]
    tokens = raw.astype(np.int64)
    tokens[raw == np.iinfo(raw.dtype).max] = SEPARATOR
    return Corpus(tokens, config["target"], int(config["documents"]), str(config["source"]))


def shipped_corpus_dir(target_name: str) -> Path | None:
    """The corpus shipped in package data for ``target_name`` (e.g. the default model)."""
    root = resources.files("speculative.corpora").joinpath("data")
    folder = Path(str(root)) / target_name
    return folder if (folder / CONFIG).is_file() else None
