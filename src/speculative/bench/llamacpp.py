"""llama.cpp (through ``llama-cpp-python``) as a bench peer on the same GGUF file.

Optional: ``make peers`` installs ``llama-cpp-python`` from the package registry (it
compiles llama.cpp, about 25 minutes on 2 cores). Without it the bench has no llama.cpp
rows and says why. The peer is given our prompt token ids (no second tokenizer), decodes
greedily (temperature 0) and stops at the same end-of-sequence tokens and budget, so its
rows are "same model file, same prompts": its text should equal ours except where our
int4 kernel (int8 activations, as llama.cpp runs Q4_1) and llama.cpp's round a near tie
differently; the bench counts those.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculative.bench.methods import PLAIN, RunRecord
from speculative.sampling.constraints import TokenConstraint

ENGINE = "llama.cpp"
PACKAGE = "llama_cpp"


def llamacpp_missing() -> str | None:
    """Why llama.cpp rows cannot run here (None when they can)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return "llama-cpp-python is not installed (`make peers` installs it)"
    try:
        importlib.import_module(PACKAGE)
    except Exception as error:  # a broken install: a missing dependency, a bad library
        return (
            f"llama-cpp-python is installed but does not import ({type(error).__name__}: "
            f"{error}); `make peers` reinstalls it with its dependencies"
        )
    return None


@dataclass
class LlamaCppPeer:
    """llama.cpp decoding greedily, plain or with its prompt-lookup drafter."""

    name: str
    family: str  # PLAIN or "ngram" (pairs with our rows of the same method)
    gamma: str
    llm: Any  # llama_cpp.Llama
    eos_token_ids: frozenset[int]
    runtime: str  # the runtime whose prompt ids and plain outputs these rows share
    engine: str = ENGINE

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        constraint: TokenConstraint | None = None,
    ) -> RunRecord:
        if constraint is not None:
            raise ValueError("the llama.cpp peers take no output constraint")
        tokens: list[int] = []
        started = time.perf_counter()
        if max_new_tokens > 0:
            stream = self.llm.generate(
                list(prompt_ids),
                temp=0.0,  # llama.cpp's greedy sampler
                top_k=1,
                top_p=1.0,
                min_p=0.0,
                repeat_penalty=1.0,
                reset=True,
            )
            for token in stream:
                tokens.append(int(token))
                if token in self.eos_token_ids or len(tokens) >= max_new_tokens:
                    break
        return RunRecord(tokens=tokens, seconds=time.perf_counter() - started)


def llamacpp_peers(
    gguf: Path,
    eos_token_ids: frozenset[int],
    threads: int,
    lookup_tokens: int,
    runtime: str,
    context: int = 4096,
) -> list[LlamaCppPeer]:
    """The plain and prompt-lookup peers on ``gguf`` (raises ImportError without the
    package)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(**extra: Any) -> Any:
        return Llama(
            model_path=str(gguf),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            seed=0,
            verbose=False,
            **extra,
        )

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
    return [
        LlamaCppPeer(f"{ENGINE}/plain", PLAIN, "-", load(), eos_token_ids, runtime),
        LlamaCppPeer(
            f"{ENGINE}/prompt-lookup:{lookup_tokens}",
            "ngram",
            str(lookup_tokens),
            load(draft_model=lookup),
            eos_token_ids,
            runtime,
        ),
    ]
