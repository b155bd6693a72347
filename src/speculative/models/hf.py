"""Hugging Face transformers causal LMs behind the ``CausalLM`` protocol (models/base.py).

:class:`HFCausalLM` wraps an ``AutoModelForCausalLM`` together with its own
``DynamicCache``. It also holds several sequences in cache slots
(:class:`~speculative.models.base.SupportsBatchRows`): each slot keeps its own keys and
values, and :meth:`HFCausalLM.forward_rows` runs all rows in one padded batch (right
padding, a per-row 4D mask and positions), then keeps each row's new keys and values in
its slot (per-row cropping is then a slice). Cheap self-drafters are built from a loaded
model without touching the disk: :meth:`HFCausalLM.early_exit` keeps only the first N
decoder layers (sharing the weights), :meth:`HFCausalLM.to_dtype` makes a lower-precision
copy (e.g. bfloat16).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from speculative.models.base import (
    RowInput,
    check_context,
    check_feature_layers,
    check_keep_slots,
    check_logits_from,
)
from speculative.models.loading import (
    ResolvedModel,
    clear_quantizer,
    load_tokenizer,
    resolve_model,
)


@dataclass
class _SlotCache:
    """One sequence's keys and values per layer, [1, kv_heads, capacity, head_dim] each,
    positions [0, length) valid: a rollback shortens ``length``, new positions are
    written in place and the capacity doubles when full (no copy of the whole cache per
    step)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cached keys and values, cut to ``length`` (rollback is a slice)."""
        return self.keys[index][:, :, : self.length], self.values[index][:, :, : self.length]

    def write(self, index: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Layer ``index``'s keys and values [1, kv_heads, k, head_dim] at positions
        [length, length + k) (``length`` itself moves once every layer is written)."""
        start, end = self.length, self.length + new_keys.shape[-2]
        for store, new in ((self.keys, new_keys), (self.values, new_values)):
            held = store[index] if index < len(store) else None
            if held is None or end > held.shape[-2]:
                grown = new.new_empty((*new.shape[:2], max(end, 2 * self.length, 16), new.shape[3]))
                if held is not None and start:
                    grown[:, :, :start] = held[:, :, :start]
                if held is None:
                    store.append(grown)
                else:
                    store[index] = grown
                held = grown
            held[:, :, start:end] = new


class HFCausalLM:
    """A transformers causal LM with a rollback-able KV cache (batch-first)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any = None,
        name: str | None = None,
        max_slots: int = 64,
        max_context: int | None = None,
    ) -> None:
        """max_slots: most sequences the slot caches may hold at once (batched decoding);
        max_context: the context window in tokens (None: the model's own
        ``max_position_embeddings``; more than that is an error)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name if name is not None else str(getattr(model.config, "name_or_path", "hf"))
        self._cache = self._new_cache()
        self._length = 0
        self._batch: int | None = None
        self._max_slots = max_slots
        self._slots: dict[int, _SlotCache] = {}  # acquired slots (``forward_rows``)
        # read once (the adapter never moves or casts its model: to_dtype copies it):
        # transformers' config attributes cost ~15 µs a read and a model's dtype or device
        # a walk over its parameters, and the engines ask in every round of every row
        text = model.config.get_text_config()
        window = getattr(text, "max_position_embeddings", None)
        self._max_length = check_context(max_context, int(window) if window else None)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._kv_heads = int(heads), int(head_dim)  # per layer's cache
        self._dtype, self._device = model.dtype, model.device
        self._feature_layers: tuple[int, ...] = ()  # SupportsLayerFeatures

    # ----------------------------------------------------------------- properties

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the lm_head rows, padding rows included)."""
        head = self.model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def max_length(self) -> int | None:
        return self._max_length

    @property
    def cache_length(self) -> int:
        return self._length

    @property
    def num_layers(self) -> int:
        return len(_decoder_layers(self.model))

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    # ----------------------------------------------------------------- protocol

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [batch, k] -> [batch, k, vocab]
        """Append ``input_ids`` [batch, k] to the cache; return float32 logits [batch, k, vocab]."""
        batch, k = self._check_input(input_ids)
        positions = torch.arange(self._length, self._length + k, device=self.device)  # [k]
        position_ids = positions.unsqueeze(0).expand(batch, k)  # [batch, k]
        with torch.inference_mode():
            output = self.model(
                input_ids=input_ids.to(device=self.device, dtype=torch.long),
                position_ids=position_ids,
                cache=self._cache,
                use_cache=True,
            )
            logits = output.logits.float()  # [batch, k, vocab]
        self._length += k
        self._batch = batch
        return logits

    def forward_tree(
        self,
        input_ids: torch.Tensor,  # [1, k] int64
        attention_mask: torch.Tensor,  # [k, k] bool, True = may attend
        position_ids: torch.Tensor,  # [k] int64
    ) -> torch.Tensor:  # [1, k, vocab]
        """A token tree in one forward: a custom 4D additive mask over cache + new tokens
        (transformers passes 4D masks through unchanged) and explicit position_ids."""
        return self.forward_with_hidden(input_ids, attention_mask, position_ids)[0]

    def _tree_mask(self, attention_mask: torch.Tensor, k: int) -> torch.Tensor:
        """[k, k] bool among the new tokens -> [1, 1, k, cache + k] additive mask."""
        if attention_mask.shape != (k, k):
            raise ValueError(f"a tree forward takes a [k, k] mask, k={k}")
        visible = torch.ones(k, self._length + k, dtype=torch.bool)  # [k, cache + k]
        visible[:, self._length :] = attention_mask.bool()
        blocked = torch.finfo(self.dtype).min
        mask = torch.zeros(1, 1, k, self._length + k, dtype=self.dtype)
        return mask.masked_fill(~visible, blocked).to(self.device)

    def keep_slots(self, first: int, slots: Sequence[int]) -> None:
        """Keep positions [0, first) and move ``slots`` right after them (tree compaction):
        an index_select on the sequence axis of every layer's keys and values."""
        kept = check_keep_slots(first, slots, self._length)
        index = torch.tensor(list(range(first)) + kept, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for layer in self._cache.layers:
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue
                if getattr(layer, "sliding_window", None):
                    raise ValueError("keep_slots does not support sliding-window cache layers")
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self._length = first + len(kept)

    def forward_with_hidden(
        self,
        input_ids: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None = None,  # [k, k] bool (a tree; batch 1), None = causal
        position_ids: torch.Tensor | None = None,  # [k] int64, with attention_mask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`forward` (or :meth:`forward_tree` given a mask); also returns the
        final hidden states [batch, k, hidden] (after the final norm: the output head's
        input), float32."""
        batch, k = self._check_input(input_ids)
        extra: dict[str, torch.Tensor] = {}
        if attention_mask is not None:
            if batch != 1:
                raise ValueError("a tree forward takes a batch of one")
            extra["attention_mask"] = self._tree_mask(attention_mask, k)
        if position_ids is None:
            position_ids = torch.arange(self._length, self._length + k)  # [k]
        with torch.inference_mode():
            output = self.model(
                input_ids=input_ids.to(device=self.device, dtype=torch.long),
                position_ids=position_ids.reshape(-1, k).expand(batch, k).to(self.device),
                cache=self._cache,
                use_cache=True,
                output_hidden_states=True,
                **extra,
            )
            logits = output.logits.float()  # [batch, k, vocab]
            features = self._features(output.hidden_states)  # [batch, k, hidden (* (1 + n))]
        self._length += k
        self._batch = batch
        return logits, features

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._feature_layers

    def set_feature_layers(self, layers: Sequence[int]) -> None:
        """See :class:`~speculative.models.base.SupportsLayerFeatures`."""
        self._feature_layers = check_feature_layers(layers, self.num_layers)

    def _features(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """transformers' hidden states (the embeddings, then each layer's output, the last
        after the final norm) -> the features: the last, then the feature layers' (layer
        l's output is states[l + 1]). [..., hidden * (1 + len(feature_layers))] float32."""
        if not self._feature_layers:
            return states[-1].float()
        return torch.cat([states[-1], *(states[x + 1] for x in self._feature_layers)], -1).float()

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach().float()  # [vocab, hidden]

    def output_embedding(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach().float()  # [vocab, hidden]

    def rollback(self, n: int) -> None:
        """Drop the newest ``n`` cache positions."""
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) needs 0 <= n <= cache_length ({self._length})")
        if n == 0:
            return
        if n == self._length:
            self.reset()
            return
        with torch.inference_mode():
            self._cache.crop(-n)  # transformers 5: a negative count removes that many positions
        self._length -= n

    def reset(self) -> None:
        """Empty the cache."""
        self._cache = self._new_cache()
        self._length = 0
        self._batch = None

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every parameter except the input
        embedding table (only one row of it is read), counting a tied head once."""
        embedding = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings()
        tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return total if tied else total - embedding.numel() * embedding.element_size()

    # ----------------------------------------------------------------- batch rows

    def acquire_slot(self) -> int:
        """The lowest free cache slot, now owned by the caller."""
        for slot in range(self._max_slots):
            if slot not in self._slots:
                self._slots[slot] = _SlotCache()
                return slot
        raise ValueError(f"no free cache slot: all {self._max_slots} are in use")

    def release_slot(self, slot: int) -> None:
        self._slot(slot)
        del self._slots[slot]

    def slot_length(self, slot: int) -> int:
        return self._slot(slot).length

    def rollback_slot(self, slot: int, n: int) -> None:
        cache = self._slot(slot)
        if not 0 <= n <= cache.length:
            raise ValueError(f"cannot roll back {n} of {cache.length} positions of slot {slot}")
        cache.length -= n

    def keep_slot_positions(self, slot: int, first: int, positions: Sequence[int]) -> None:
        """Keep positions [0, first) of ``slot`` and move ``positions`` right after them."""
        cache = self._slot(slot)
        kept = check_keep_slots(first, positions, cache.length)
        index = torch.tensor(list(range(first)) + kept, dtype=torch.long, device=self.device)
        cache.keys = [k.index_select(-2, index) for k in cache.keys]
        cache.values = [v.index_select(-2, index) for v in cache.values]
        cache.length = first + len(kept)

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Every row's new tokens through one padded forward; [k_row - logits_from, vocab]
        float32 logits per row. Rows are right-padded to the longest cache and the longest
        input; the mask hides each row's padding, so a row's logits are its logits alone up
        to floating-point rounding (the batched matmuls may sum in another order)."""
        return [logits for logits, _ in self._forward_rows(rows, hidden=False)]

    def forward_rows_with_hidden(
        self, rows: Sequence[RowInput]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """As :meth:`forward_rows`, with the rows' final hidden states [Σ k_row, hidden]
        (rows in order)."""
        outputs = self._forward_rows(rows, True)
        features = [f for _, f in outputs if f is not None]  # every row's, asked for
        if not features:
            return [], torch.empty(0, self.hidden_size * (1 + len(self._feature_layers)))
        return [logits for logits, _ in outputs], torch.cat(features)

    def _forward_rows(
        self, rows: Sequence[RowInput], hidden: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        if not rows:
            return []
        if len({row.slot for row in rows}) != len(rows):
            raise ValueError("a slot appears twice in one forward_rows call")
        caches = [self._slot(row.slot) for row in rows]
        lengths = [cache.length for cache in caches]
        ks = [self._row_length(row, n) for row, n in zip(rows, lengths, strict=True)]
        cached, width = max(lengths), max(ks)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, K], pad id 0
        position_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, K]
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            input_ids[b, :k] = row.input_ids
            position_ids[b, :k] = self._row_positions(row, lengths[b], k)
        mask = self._rows_mask(rows, lengths, ks, cached, width)  # [B, 1, K, L + K]
        cache = self._batch_cache(caches, cached)
        with torch.inference_mode():
            output = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=position_ids.to(self.device),
                attention_mask=mask,
                cache=cache,
                use_cache=True,
                output_hidden_states=hidden,
            )
            logits = output.logits.float()  # [B, K, vocab]
            features = self._features(output.hidden_states) if hidden else None  # [B, K, ...]
            for b, (slot_cache, k) in enumerate(zip(caches, ks, strict=True)):
                self._keep_new(slot_cache, cache, b, cached, k)
        return [
            (logits[b, row.logits_from : k], None if features is None else features[b, :k])
            for b, (row, k) in enumerate(zip(rows, ks, strict=True))
        ]

    @staticmethod
    def padded_tokens(row_lengths: Sequence[int]) -> int:
        """Positions one :meth:`forward_rows` computes: every row padded to the longest."""
        return len(row_lengths) * max(row_lengths, default=0)

    def _slot(self, slot: int) -> _SlotCache:
        if slot not in self._slots:
            raise ValueError(f"cache slot {slot} is not acquired")
        return self._slots[slot]

    def _row_length(self, row: RowInput, start: int) -> int:
        k = row.input_ids.numel()
        if row.input_ids.dim() != 1 or k == 0:
            shape = tuple(row.input_ids.shape)
            raise ValueError(f"row input_ids must be [k] with k >= 1, got {shape}")
        limit = self.max_length
        if limit is not None and start + k > limit:
            raise ValueError(
                f"cache overflow in slot {row.slot}: {start} cached + {k} new > max_length {limit}"
            )
        if row.attention_mask is not None and row.attention_mask.shape != (k, k):
            shape = tuple(row.attention_mask.shape)
            raise ValueError(f"attention_mask must be [{k}, {k}], got {shape}")
        check_logits_from(row.logits_from, k)
        return k

    @staticmethod
    def _row_positions(row: RowInput, start: int, k: int) -> torch.Tensor:
        if row.position_ids is None:
            return torch.arange(start, start + k)  # [k]
        return row.position_ids.reshape(k)

    def _rows_mask(
        self, rows: Sequence[RowInput], lengths: list[int], ks: list[int], cached: int, width: int
    ) -> torch.Tensor:
        """[B, 1, K, L + K] additive mask: row b's token i sees its own cached positions
        [0, L_b) and its new tokens j (j <= i, or its tree mask); a padding query sees
        only itself (its output is dropped)."""
        k = torch.tensor(ks).view(-1, 1, 1)  # [B, 1, 1]
        length = torch.tensor(lengths).view(-1, 1, 1)
        query = torch.arange(width).view(1, -1, 1)  # [1, K, 1]
        real = query < k  # [B, K, 1]: the row's own new tokens, not its padding
        seen_cache = real & (torch.arange(cached).view(1, 1, -1) < length)  # [B, K, L]
        key = torch.arange(width).view(1, 1, -1)  # [1, 1, K]
        # causal among a row's new tokens; a padding query sees itself alone
        seen_new = torch.where(real, key <= query, key == query)  # [B, K, K]
        for b, row in enumerate(rows):
            if row.attention_mask is not None:  # a tree: its own mask among its tokens
                seen_new[b, : ks[b], : ks[b]] = row.attention_mask.bool()
        visible = torch.cat([seen_cache, seen_new], dim=2)  # [B, K, L + K]
        mask = torch.zeros(visible.shape, dtype=self._dtype)
        mask = mask.masked_fill(~visible, torch.finfo(self._dtype).min)
        return mask.unsqueeze(1).to(self.device)

    def _batch_cache(self, caches: list[_SlotCache], cached: int) -> DynamicCache:
        """One DynamicCache holding every row's cache, right-padded with zeros to
        ``cached``: [B, heads, cached, head_dim] per layer, each row copied in."""
        batch_cache = self._new_cache()
        if cached == 0:
            return batch_cache
        layers = max(len(c.keys) for c in caches)
        heads, head_dim = self._kv_heads
        shape = (len(caches), heads, cached, head_dim)
        with torch.inference_mode():
            for index in range(layers):
                keys = torch.zeros(shape, dtype=self._dtype, device=self.device)
                values = torch.zeros(shape, dtype=self._dtype, device=self.device)
                for b, cache in enumerate(caches):
                    if cache.length:
                        key, value = cache.layer(index)  # [1, heads, length, head_dim]
                        keys[b, :, : cache.length] = key[0]
                        values[b, :, : cache.length] = value[0]
                batch_cache.update(keys, values, index)
        return batch_cache

    @staticmethod
    def _keep_new(slot: _SlotCache, cache: DynamicCache, b: int, cached: int, k: int) -> None:
        """Append row b's k new keys and values (after the padded cache) to its slot."""
        for index, layer in enumerate(cache.layers):
            new_keys = layer.keys[b : b + 1, :, cached : cached + k]  # [1, heads, k, head_dim]
            slot.write(index, new_keys, layer.values[b : b + 1, :, cached : cached + k])
        slot.length += k

    # ----------------------------------------------------------------- derived models

    def early_exit(self, num_layers: int) -> HFCausalLM:
        """A new adapter over the SAME weights using only the first ``num_layers`` layers.

        The final norm and lm_head are applied right after layer ``num_layers``; the new
        adapter has its own (empty) cache.
        """
        total = self.num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"early_exit needs 1 <= num_layers <= {total}, got {num_layers}")
        truncated = _truncate_layers(self.model, num_layers)
        name = f"{self.name}[:{num_layers}/{total} layers]"
        return HFCausalLM(
            truncated, tokenizer=self.tokenizer, name=name, max_context=self._max_length
        )

    def to_dtype(self, dtype: torch.dtype) -> HFCausalLM:
        """A copy of the weights cast to ``dtype`` (rotary frequencies stay float32)."""
        if not dtype.is_floating_point:
            raise ValueError(f"to_dtype needs a floating dtype, got {dtype}")
        converted = copy.deepcopy(self.model).to(dtype)
        _restore_float32_buffers(converted, self.model)
        name = f"{self.name}[{_dtype_name(dtype)}]"
        return HFCausalLM(
            converted, tokenizer=self.tokenizer, name=name, max_context=self._max_length
        )

    # ----------------------------------------------------------------- helpers

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _check_input(self, input_ids: torch.Tensor) -> tuple[int, int]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, k], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        batch, k = input_ids.shape
        if k == 0:
            raise ValueError("input_ids must hold at least one token (k >= 1)")
        if self._batch is not None and batch != self._batch:
            raise ValueError(
                f"batch size changed from {self._batch} to {batch} with a non-empty cache; "
                "reset() first"
            )
        limit = self.max_length
        if limit is not None and self._length + k > limit:
            raise ValueError(
                f"sequence too long for {self.name}: cache {self._length} + {k} new tokens "
                f"> max_length {limit}"
            )
        return batch, k

    def __repr__(self) -> str:
        return (
            f"HFCausalLM(name={self.name!r}, layers={self.num_layers}, dtype={self.dtype}, "
            f"cache_length={self._length})"
        )


def load_hf_model(
    name_or_path: str | ResolvedModel,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    *,
    attn_implementation: str = "sdpa",
    load_tokenizer_too: bool = True,
    max_context: int | None = None,
) -> HFCausalLM:
    """Load a causal LM (see :func:`speculative.models.loading.resolve_model` for specs).

    num_layers: keep only the first N decoder layers (an early-exit self-drafter).
    max_context: the context window in tokens (None: the model's own).
    """
    resolved = (
        name_or_path if isinstance(name_or_path, ResolvedModel) else resolve_model(name_or_path)
    )
    model = AutoModelForCausalLM.from_pretrained(
        resolved.path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        **resolved.from_pretrained_kwargs(),
    )
    if resolved.gguf_file is not None:
        clear_quantizer(model)  # the weights are dequantized floats already
    tokenizer = load_tokenizer(resolved) if load_tokenizer_too else None
    adapter = HFCausalLM(model, tokenizer=tokenizer, name=resolved.name, max_context=max_context)
    if num_layers is not None:
        return adapter.early_exit(num_layers)
    return adapter


# --------------------------------------------------------------------------- module surgery


def _decoder(model: PreTrainedModel) -> nn.Module:
    decoder = model.get_decoder()
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no decoder '.layers' list; early exit is unsupported"
        )
    return decoder


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    return _decoder(model).layers


def _shallow_copy_module(module: nn.Module) -> nn.Module:
    """A new module object whose children/parameters are the SAME objects as ``module``'s."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def _truncated_config(config: Any, num_layers: int) -> Any:
    new_config = copy.deepcopy(config)
    text_config = new_config.get_text_config()
    text_config.num_hidden_layers = num_layers
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        text_config.layer_types = list(layer_types)[:num_layers]
    return new_config


def _truncate_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A shallow copy of ``model`` that runs only its first ``num_layers`` decoder layers."""
    decoder = _decoder(model)
    child_name = _child_name(model, decoder)
    config = _truncated_config(model.config, num_layers)
    new_decoder = _shallow_copy_module(decoder)
    new_decoder.layers = nn.ModuleList(list(decoder.layers)[:num_layers])
    new_decoder.config = config.get_text_config()
    new_model = _shallow_copy_module(model)
    setattr(new_model, child_name, new_decoder)
    new_model.config = config
    return new_model


def _child_name(model: nn.Module, child: nn.Module) -> str:
    for name, module in model.named_children():
        if module is child:
            return name
    raise ValueError(
        f"{type(model).__name__}: decoder is not a direct child; early exit unsupported"
    )


def _restore_float32_buffers(converted: nn.Module, original: nn.Module) -> None:
    """Put back float32 non-persistent buffers (rotary ``inv_freq``) that ``.to`` downcast."""
    originals = dict(original.named_buffers())
    for name, buffer in converted.named_buffers():
        source = originals.get(name)
        if source is None or source.dtype != torch.float32 or "inv_freq" not in name:
            continue
        owner_name, _, attribute = name.rpartition(".")
        owner = converted.get_submodule(owner_name)
        owner._buffers[attribute] = source.detach().clone().to(buffer.device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
