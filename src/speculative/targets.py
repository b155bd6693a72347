"""Targets by name: load a model on a runtime and precision, with what is needed to talk
to it in text (tokenizer, end-of-sequence ids, chat prompts).

    from speculative.targets import load_target, encode_prompt
    target = load_target("default")  # the GGUF's int4 on the native runtime
    ids = encode_prompt(target.tokenizer, "Why is the sky blue?")
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from speculative.engine.stopping import StopCriteria
from speculative.models.base import CausalLM

T = TypeVar("T")


@dataclass
class LoadedModel:
    """A causal LM plus what is needed to talk to it in text.

    make_variant: builds the same model at another precision ("bf16", "int8", ...), used by
    the ``self-<precision>`` drafters; ``None`` when the runtime cannot.
    """

    lm: CausalLM
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int] = frozenset()
    runtime: str = "hf"
    precision: str = "fp32"
    make_variant: Callable[[str], CausalLM] | None = None
    backend: str = "torch"  # native runtime: "kernels" (C decoder) or "torch"
    # the stream whose state the model's cache now holds (see GenerationStream.__iter__)
    cache_owner: object | None = field(default=None, repr=False, compare=False)
    # what the drafters built for this model share, built once (a loaded head, its weights
    # packed for the kernels with their cache slots): see :meth:`shared`
    parts: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def shared(self, key: Hashable, build: Callable[[], T]) -> T:
        """The part ``key`` of this model's drafters, built by ``build`` on first use:
        every drafter of one kind then shares one copy (and rows of a batch can draft
        in one step)."""
        if key not in self.parts:
            self.parts[key] = build()
        return self.parts[key]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens left out)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stop_criteria(
        self,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        stop_tokens: frozenset[int] = frozenset(),
        min_tokens: int = 0,
    ) -> StopCriteria:
        """Stop after ``max_new_tokens``, at the model's end-of-sequence tokens (unless
        ``ignore_eos``) or one of ``stop_tokens``, and at the first of the ``stop``
        strings (one inside the first ``min_tokens`` tokens does not count)."""
        return StopCriteria(
            max_new_tokens=max_new_tokens,
            eos_token_ids=(frozenset() if ignore_eos else self.eos_token_ids) | stop_tokens,
            stop_strings=tuple(stop),
            decode=self.decode if stop else None,
            min_tokens=min_tokens,
        )


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer and the model's (generation) config."""
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None)]
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        sources.append(getattr(config, "eos_token_id", None))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


RUNTIMES = ("auto", "native", "hf")
HF_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_target(
    spec: str = "default",
    runtime: str = "auto",
    precision: str = "auto",
    native_backend: str = "auto",
    kv_cache: str = "auto",
    max_context: int | None = None,
) -> LoadedModel:
    """Load a target model by name, folder, .gguf file or hub id (offline-aware).

    runtime: "native" (this package's Llama-family runtime), "hf" (transformers), or
    "auto" (native when the architecture is supported, else hf).
    precision: "auto" (the model's own: a Q4 GGUF runs int4 as stored, a bfloat16
    checkpoint bf16, anything else fp32); fp32 or bf16 on both runtimes; int8 and int4
    (weight-only) on native. Speculative decoding is exact with respect to the target at
    this precision.
    native_backend: the native runtime's decoder: "kernels" (C), "torch", or "auto"
    (the kernels when they build here).
    kv_cache: the native runtime's KV cache: "fp32", "fp16" (keys and values rounded to
    half once when stored), or "auto" (fp32 for an fp32 model, fp16 for bf16, int8 and
    int4, as llama.cpp keeps it); transformers keeps its own cache (only "auto").
    max_context: the context window in tokens, prompt and output together; None: the
    model's own context length (the native runtime's stops at a sliding window, see
    :func:`~speculative.models.native.config.context_window`). The native KV cache grows
    with the sequences, so a long window costs memory only when used.
    """
    from speculative.models.loading import resolve_model, stored_precision

    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    resolved = resolve_model(spec)
    if runtime == "auto":
        runtime = "native" if native_supports(resolved.path) else "hf"
    if precision == "auto":
        precision = stored_precision(resolved)
        if runtime == "hf" and precision not in HF_PRECISIONS:
            precision = "fp32"  # transformers runs the file's values in float32
    if runtime == "native":
        return _load_native_target(resolved, precision, native_backend, kv_cache, max_context)
    if kv_cache != "auto":
        raise ValueError(
            f"--kv-cache {kv_cache} is for the native runtime; transformers keeps its own cache"
        )
    return _load_hf_target(resolved, precision, max_context)


class TargetSpec(Protocol):
    """What names a target and how to load it: a command's arguments, a server's config,
    a batch job (their fields of these names)."""

    target: str
    runtime: str
    precision: str
    kv_cache: str
    max_context: int | None


def load_target_of(spec: TargetSpec) -> LoadedModel:
    """:func:`load_target` with the fields of ``spec``."""
    return load_target(
        spec.target,
        spec.runtime,
        spec.precision,
        kv_cache=spec.kv_cache,
        max_context=spec.max_context,
    )


def native_supports(folder: Any) -> bool:
    """Whether the native runtime implements the architecture in ``folder/config.json``."""
    from speculative.models.native.config import SUPPORTED_MODEL_TYPES

    return _read_config(folder).get("model_type") in SUPPORTED_MODEL_TYPES


def _load_hf_target(resolved: Any, precision: str, max_context: int | None) -> LoadedModel:
    from speculative.models.hf import load_hf_model

    dtype = HF_PRECISIONS.get(precision)
    if dtype is None:
        raise ValueError(
            f"precision {precision!r} needs the native runtime; the hf runtime has "
            f"{', '.join(HF_PRECISIONS)}"
        )
    hf = load_hf_model(resolved, dtype=dtype, max_context=max_context)
    if hf.tokenizer is None:
        raise ValueError(f"model '{resolved.name}' ships no tokenizer; text generation needs one")
    return hf_loaded(hf, precision)


def hf_loaded(hf: Any, precision: str = "fp32", eos: frozenset[int] | None = None) -> LoadedModel:
    """Wrap an :class:`~speculative.models.hf.HFCausalLM` (its tokenizer attached)."""

    def variant(other: str) -> CausalLM:
        if other not in HF_PRECISIONS:
            raise ValueError(f"the hf runtime has no {other!r} precision")
        return hf.to_dtype(HF_PRECISIONS[other])

    return LoadedModel(
        lm=hf,
        tokenizer=hf.tokenizer,
        name=hf.name,
        eos_token_ids=eos_ids(hf.model, hf.tokenizer) if eos is None else eos,
        runtime="hf",
        precision=precision,
        make_variant=variant,
    )


def _load_native_target(
    resolved: Any, precision: str, backend: str, kv_cache: str, max_context: int | None
) -> LoadedModel:
    from speculative.models.loading import load_tokenizer
    from speculative.models.native import PRECISIONS, load_native
    from speculative.models.native.model import resolved_kv_cache

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    resolved_kv_cache(precision, kv_cache)  # an unknown cache type fails before any loading
    tokenizer = load_tokenizer(resolved)
    if tokenizer is None:
        raise ValueError(f"model '{resolved.name}' ships no tokenizer; text generation needs one")

    def variant(other: str) -> CausalLM:
        # int4 runs a GGUF's Q4 weights exactly as stored; other precisions load the
        # converted float folder (much faster to read than the GGUF).
        source = resolved.source_gguf if other == "int4" and resolved.source_gguf else resolved.path
        return load_native(
            source, precision=other, max_length=max_context, backend=backend, kv_cache=kv_cache
        )

    lm = variant(precision)
    config = _read_config(resolved.path)
    ids = eos_ids(None, tokenizer) | _config_eos(config)
    return LoadedModel(
        lm=lm,
        tokenizer=tokenizer,
        name=resolved.name,
        eos_token_ids=ids,
        runtime="native",
        precision=precision,
        make_variant=variant,
        backend=lm.backend,
    )


def _read_config(folder: Any) -> dict[str, Any]:
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _config_eos(config: dict[str, Any]) -> frozenset[int]:
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(int(v) for v in value)
    return frozenset()


# apply_chat_template's own arguments: not template variables a request may set
RESERVED_TEMPLATE_NAMES = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
     "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat template renders a conversation: with the assistant's generation prompt
    (the default), or continuing the last message, an assistant's text begun for the
    model (a prefill); ``variables``: the template's own (Qwen3's ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt false"
            )
        reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(k for k, _ in self.variables))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is not a template variable a request may set")

    def arguments(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **dict(self.variables),
        }


def encode_prompt(
    tokenizer: Any,
    prompt: str | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    chat: bool | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    template: TemplateOptions | None = None,
) -> list[int]:
    """Token ids for a prompt; ``chat`` (default: when the tokenizer has a chat template)
    wraps it as a user message and adds the assistant generation prompt; ``tools``: the
    functions the template shows the model (a template without tools ignores them);
    ``template``: how the template renders (the generation prompt, a final assistant
    message continued, the template's own variables)."""
    if messages is None:
        if prompt is None or not prompt.strip():
            raise ValueError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}]
    elif not messages:
        raise ValueError("messages is empty")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
    if use_chat:
        extra = {} if tools is None else {"tools": list(tools)}
        options = template or TemplateOptions()
        if options.continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, **options.arguments(), **extra
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


# fill-in-the-middle tokens (prefix, suffix, middle) as code models' tokenizers name them:
# StarCoder's and SantaCoder's, Qwen2.5-Coder's, DeepSeek-Coder's (begin, hole, end)
FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), each
    one token of its vocabulary; None where it has none of the known sets."""
    vocab = tokenizer.get_vocab()
    for names in FIM_TOKENS:
        if all(name in vocab for name in names):
            prefix, suffix, middle = (vocab[name] for name in names)
            return prefix, suffix, middle
    return None


def encode_infill(tokenizer: Any, prefix: str | Sequence[int], suffix: str) -> list[int]:
    """A fill-in-the-middle prompt (prefix, suffix, middle order, as the models above were
    trained): what the model writes next is the text between ``prefix`` (a text or token
    ids) and ``suffix``. ValueError for a tokenizer without fill-in-the-middle tokens."""
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        known = ", ".join(names[0] for names in FIM_TOKENS)
        raise ValueError(
            f"this model has no fill-in-the-middle tokens (none of {known}, …), so it "
            "cannot fill in before a suffix; leave suffix out"
        )
    if isinstance(prefix, str):  # the tokenizer's BOS first, where it adds one
        bos = tokenizer.bos_token_id
        start = [t for t in tokenizer("")["input_ids"] if t == bos and bos is not None]
        ids = [*start, tokens[0], *_plain(tokenizer, prefix)]
    else:  # token ids are used as given
        ids = [tokens[0], *prefix]
    _, fim_suffix, fim_middle = tokens
    return [*ids, fim_suffix, *_plain(tokenizer, suffix), fim_middle]


def _plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
