"""What runs a drafting head's step: PyTorch (the head's own module, any runtime) or the
target's C kernels (the EAGLE head's decoder layer and both heads' output rows run by
kernels.c instead of PyTorch ops).

A draft step of a head is tiny (one decoder layer of the target's width and an output
over the reduced draft vocabulary), so in PyTorch it costs op dispatch on small tensors
more than arithmetic. Here one step is two C calls: the fusion layer ``fc`` with the two
input norms before it (``spec_fused_linear``, one parallel region) and one kernels.c
forward of a one-layer model whose output head is the draft vocabulary's rows (no final
norm: the head's output feature goes to its rows as is).

Weights are packed at most at the target's precision (:func:`head_formats`), so a draft
step never reads more bytes per weight than a target step. The head's numbers then differ
from the PyTorch head's by rounding; drafting stays lossless because the probabilities
the drafter samples from are the ones it reports as q.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from speculative.heads.modules import EagleHead, KVCache, MedusaHeads
from speculative.heads.store import TrainedHead
from speculative.models.native.ckernels import (
    KernelLinear,
    kernel_model,
    kernel_shape_problem,
)
from speculative.models.native.decoder_base import PackedLayer
from speculative.models.native.loading import Weight, rope_interleave_index
from speculative.models.precision import traits


def head_formats(target_precision: str) -> tuple[str, str]:
    """(layer format, output-rows format) for a head drafting for a target at
    ``target_precision``: never more bytes per weight than the target reads
    (:class:`~speculative.models.precision.PrecisionTraits`)."""
    found = traits(target_precision)
    return found.head_layer, found.head_rows


class EagleRunner(Protocol):
    """An EAGLE head's incremental step over its own KV cache (batch of one).

    ``length`` is the number of cached pairs; setting it lower rolls back. ``together``:
    what steps this runner with other rows' runners in one call (a
    :class:`KernelEagleHead`), or None (it steps alone)."""

    length: int
    together: KernelEagleHead | None

    def step(
        self,
        embeds: torch.Tensor,  # [k, H] embeddings of the tokens x_{t+1}
        features: torch.Tensor,  # [k, H] features f_t (true or predicted)
        positions: torch.Tensor,  # [k] int64 pair positions t
        # [k, k] bool among the new pairs, or [k, length + k] choosing the visible cached
        # pairs too (tree drafting); None = causal
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [k, H] predicted features, [k, N] logits
        """Append k pairs; their predicted next features and draft logits."""
        ...

    def sibling(self) -> EagleRunner:
        """A runner of the same head and weights with its own empty cache."""
        ...


class TorchEagleRunner:
    """The head's PyTorch module over a :class:`KVCache`."""

    def __init__(self, head: TrainedHead, capacity: int = 512) -> None:
        self.head = head
        self.module = head.module_as(EagleHead)
        self.capacity = capacity
        self.cache: KVCache = self.module.new_cache(capacity)
        self.together = None  # the PyTorch head steps one row at a time

    def sibling(self) -> TorchEagleRunner:
        return TorchEagleRunner(self.head, self.capacity)

    @property
    def length(self) -> int:
        return self.cache.length

    @length.setter
    def length(self, value: int) -> None:
        self.cache.length = value

    @torch.no_grad()
    def step(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.module.step(self.cache, embeds, features, positions, mask)  # [k, H]
        return out, self.head.draft_logits(out)


def _head_linear(weight: Weight, bias: torch.Tensor | None, fmt: str) -> KernelLinear:
    """A head's matrix packed for the kernels: run step after step, its weights stay in
    cache (``KernelLinear.cached``)."""
    return KernelLinear.pack(weight, bias, fmt, cached=True)


class KernelEagleHead:
    """An EAGLE head packed for kernels.c once and shared by every row that drafts with
    it: its weights, its one-layer model, and one KV cache slot per runner
    ([slots, 1, kv_heads, max_length, head_dim], grown on demand; a runner's slot is freed
    with the runner). Runners of one head step together in one C call
    (:meth:`step_rows`): each weight is read once for every row's pairs, and each row gets
    the bits its own :meth:`KernelEagleRunner.step` would give."""

    def __init__(
        self, head: TrainedHead, library: object, target_precision: str, max_length: int
    ) -> None:
        module = head.module_as(EagleHead)
        cfg = module.config
        problem = kernel_shape_problem(
            cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.head_dim
        )
        if problem is not None:
            raise ValueError(f"the head's shapes do not fit the C kernels: {problem}")
        layer_format, row_format = head_formats(target_precision)
        self.head = head
        self.library = library
        self.config = cfg
        fusion = module.layer_fusion  # EAGLE-3's, or None
        self.layer_fc = (
            None
            if fusion is None
            else _head_linear(fusion.fc.weight.detach().float(), None, layer_format)
        )
        self._layer_fc = None if self.layer_fc is None else self.layer_fc.struct()
        self.layer_norms = (  # [n, H]
            None
            if fusion is None
            else torch.stack([norm.weight.detach().float() for norm in fusion.norms]).contiguous()
        )
        self.embed_norm = module.embed_norm.weight.detach().float().contiguous()
        self.feature_norm = module.feature_norm.weight.detach().float().contiguous()
        self.fc = _head_linear(module.fc.weight.detach().float(), None, layer_format)
        self._fc = self.fc.struct()  # the C view of fc's tensors (which self.fc keeps)
        self.layer = PackedLayer(
            input_norm=module.input_norm.weight.detach().float().contiguous(),
            post_attention_norm=module.post_norm.weight.detach().float().contiguous(),
            qkv=_head_linear(_fused_qkv(module), None, layer_format),
            o=_head_linear(module.o.weight.detach().float(), None, layer_format),
            gate_up=_head_linear(
                torch.cat([module.gate.weight, module.up.weight]).detach().float(),
                None,
                layer_format,
            ),
            down=_head_linear(module.down.weight.detach().float(), None, layer_format),
        )
        self.rows = _head_linear(head.head_rows, None, row_format)
        self.formats = (layer_format, row_format)
        d = cfg.head_dim
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(max_length, dtype=torch.float32), inv)
        self._cos, self._sin = angles.cos().contiguous(), angles.sin().contiguous()
        self._model = kernel_model(
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=d,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            layers=[self.layer],
            final_norm=None,  # the output feature goes to the rows as it is
            lm_head=self.rows,
            cos=self._cos,
            sin=self._sin,
        )
        self.max_length = max_length
        # [slots, layers = 1, kv_heads, max_length, head_dim]
        self._slot_shape = (1, cfg.num_kv_heads, max_length, d)
        self._slot_floats = math.prod(self._slot_shape)
        self.k_cache = torch.zeros(0, *self._slot_shape)
        self.v_cache = torch.zeros(0, *self._slot_shape)
        self._free: list[int] = []
        self._lock = threading.RLock()  # slots are taken where drafters are built
        self._causal = torch.zeros(1, dtype=torch.uint8)  # mask stand-in: all causal
        self._work_floats: dict[tuple[int, int], int] = {}  # (k, threads) -> floats
        self._work_buffer = torch.empty(0)  # see _work

    def runner(self) -> KernelEagleRunner:
        """A runner over a cache slot of its own (freed when the runner is)."""
        with self._lock:
            if not self._free:
                self._grow()
            slot = self._free.pop()
        runner = KernelEagleRunner(self, slot)
        weakref.finalize(runner, self._release, slot)
        return runner

    @property
    def slots(self) -> int:
        return self.k_cache.shape[0]

    def _grow(self) -> None:
        """Twice the slots (at least one), keeping what the existing ones hold."""
        old = self.slots
        new = max(1, 2 * old)
        k, v = torch.zeros(new, *self._slot_shape), torch.zeros(new, *self._slot_shape)
        k[:old], v[:old] = self.k_cache, self.v_cache
        self.k_cache, self.v_cache = k, v
        self._free.extend(range(new - 1, old - 1, -1))  # the lowest slot is taken first

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def weight_bytes(self) -> int:
        """Bytes of weights one step reads (fusion layer, decoder layer, output rows; and
        the layer fusion, which true pairs run)."""
        fused = 0 if self.layer_fc is None else self.layer_fc.weight_bytes()
        return fused + self.fc.weight_bytes() + self.layer.weight_bytes() + self.rows.weight_bytes()

    def target_features(
        self, features: torch.Tensor, work: torch.Tensor, threads: int
    ) -> torch.Tensor:
        """The target's features [k, W] as the head reads them, [k, H]
        (:meth:`EagleHead.target_features` on the kernels: EAGLE-3's layer fusion in one
        parallel region); a predicted [k, H] feature passes unchanged."""
        h = self.config.hidden_size
        if features.shape[1] == h:
            return features
        if self.layer_fc is None or self.layer_norms is None:
            return features[:, :h]
        rows = _float_rows(features)
        out = torch.empty(rows.shape[0], h)
        self.library.spec_parts_linear(
            ctypes.byref(self._layer_fc),
            rows.data_ptr() + 4 * h,  # the layers' states, after the last layer's feature
            rows.shape[1],
            self.layer_norms.data_ptr(),
            self.layer_norms.shape[0],
            self.config.rms_norm_eps,
            rows.shape[0],
            out.data_ptr(),
            work.data_ptr(),
            threads,
        )
        return out

    def _fuse(
        self, embeds: torch.Tensor, features: torch.Tensor, work: torch.Tensor, threads: int
    ) -> torch.Tensor:
        """fc([norm(embeds) | norm(features)]) over [k, H] rows (each row on its own): one
        parallel region. [k, H]."""
        k, width = embeds.shape[0], self.config.hidden_size
        hidden = torch.empty(k, width)  # [k, H], updated in place by the forward after
        embeds, features = _float_rows(embeds), _float_rows(features)
        self.library.spec_fused_linear(
            ctypes.byref(self._fc),
            embeds.data_ptr(),
            self.embed_norm.data_ptr(),
            features.data_ptr(),
            self.feature_norm.data_ptr(),
            self.config.rms_norm_eps,
            k,
            hidden.data_ptr(),
            work.data_ptr(),
            threads,
        )
        return hidden

    def _check_room(self, start: int, k: int) -> None:
        """ValueError when k more pairs after ``start`` overflow a slot."""
        if start + k > self.max_length:
            raise ValueError(f"head cache overflow: {start} + {k} > {self.max_length}")

    def _work(self, k: int, threads: int) -> torch.Tensor:
        """A float32 work buffer for a step of k pairs on ``threads`` threads: kept and
        grown (callers hold the lock), its size asked of the kernels once per shape."""
        floats = self._work_floats.get((k, threads))
        if floats is None:
            lib = self.library
            cfg = self.config
            widest = max(2, len(cfg.feature_layers)) * cfg.hidden_size  # fc's or the layers'
            fused = lib.spec_fused_linear_work_floats(k, widest) + 8
            floats = max(fused, lib.spec_work_floats(self._model.pointer, k, threads))
            self._work_floats[(k, threads)] = floats
        if self._work_buffer.numel() < floats:
            self._work_buffer = torch.empty(floats)
        return self._work_buffer

    @torch.no_grad()
    def step(
        self,
        runner: KernelEagleRunner,
        embeds: torch.Tensor,  # [k, H] embeddings of the tokens x_{t+1}
        features: torch.Tensor,  # [k, H] features f_t (true or predicted)
        positions: torch.Tensor,  # [k] int64 pair positions t
        mask: torch.Tensor | None = None,  # as KernelEagleRunner.step's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [k, H] predicted features, [k, N] logits
        """One runner's step (see :meth:`KernelEagleRunner.step`)."""
        k = embeds.shape[0]
        start = runner.length
        self._check_room(start, k)
        base, mask = _mask_window(mask, k, start)
        threads = torch.get_num_threads()
        with self._lock:  # the slots do not move under a step
            offset = 4 * runner.slot * self._slot_floats  # bytes to the runner's slot
            work = self._work(k, threads)
            read = self.target_features(features, work, threads)  # [k, H]
            hidden = self._fuse(embeds, read, work, threads)
            logits = torch.empty(k, self.rows.out_features)
            pos = positions
            if pos.dtype != torch.int64 or not pos.is_contiguous():
                pos = pos.to(torch.int64).contiguous()
            mask_bytes = None if mask is None else mask.to(torch.uint8).contiguous()
            self.library.spec_forward(
                self._model.pointer,
                hidden.data_ptr(),
                k,
                start,
                pos.data_ptr(),
                None if mask_bytes is None else mask_bytes.data_ptr(),
                base,
                self.k_cache.data_ptr() + offset,
                self.v_cache.data_ptr() + offset,
                logits.data_ptr(),
                work.data_ptr(),
                threads,
            )
        runner.length = start + k
        return hidden, logits

    @torch.no_grad()
    def step_rows(
        self,
        runners: Sequence[KernelEagleRunner],
        embeds: Sequence[torch.Tensor],  # per runner [k_i, H]
        features: Sequence[torch.Tensor],  # per runner [k_i, H] (or the target's, wider)
        positions: Sequence[torch.Tensor],  # per runner [k_i] int64
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per runner ([k_i, H], [k_i, N])
        """Causal steps of several runners (each appending its k_i pairs to its own cache)
        in one fused-layer call and one batched forward: each runner gets what its own
        :meth:`step` would give, bit for bit (rows are computed independently)."""
        sizes = [e.shape[0] for e in embeds]
        k = sum(sizes)
        for runner, size in zip(runners, sizes, strict=True):
            self._check_room(runner.length, size)
        threads = torch.get_num_threads()
        # per sequence (int32 [4, nseq]): its new rows, first cache position, slot, and
        # first row with logits (every row has them)
        meta = np.array(
            [[size, r.length, r.slot, 0] for r, size in zip(runners, sizes, strict=True)],
            dtype=np.int32,
        ).T.copy()
        nseq = meta.shape[1]
        at = meta.__array_interface__["data"][0]
        causal = np.full(nseq, -1, dtype=np.int64)  # no sequence has a mask
        pos = torch.cat(list(positions)).to(torch.int64).contiguous()  # [k]
        with self._lock:  # the slots do not move under a step
            work = self._work(k, threads)
            read = torch.cat([self.target_features(f, work, threads) for f in features])
            hidden = self._fuse(torch.cat(list(embeds)), read, work, threads)
            logits = torch.empty(k, self.rows.out_features)
            self.library.spec_forward_batch(
                self._model.pointer,
                hidden.data_ptr(),
                nseq,
                at,
                at + 4 * nseq,
                at + 8 * nseq,
                pos.data_ptr(),
                self._causal.data_ptr(),
                causal.__array_interface__["data"][0],
                None,  # every row's logits
                self.k_cache.data_ptr(),
                self.v_cache.data_ptr(),
                self._slot_floats,
                logits.data_ptr(),
                None,  # no fused argmax
                work.data_ptr(),
                threads,
            )
        for runner, size in zip(runners, sizes, strict=True):
            runner.length += size
        return list(zip(hidden.split(sizes), logits.split(sizes), strict=True))


class KernelEagleRunner:
    """An EAGLE head's step on kernels.c over one cache slot of a shared
    :class:`KernelEagleHead` (batch of one; runners of one head also step together).

    ``length`` is the number of cached pairs (set it lower to roll back)."""

    def __init__(self, kernels: KernelEagleHead, slot: int) -> None:
        self.together = kernels  # what this runner steps with others on
        self.slot = slot
        self.length = 0

    @classmethod
    def of(
        cls, head: TrainedHead, library: object, target_precision: str, max_length: int
    ) -> KernelEagleRunner:
        """A runner of a head packed for it alone."""
        return KernelEagleHead(head, library, target_precision, max_length).runner()

    def sibling(self) -> KernelEagleRunner:
        """The same packed weights over a cache slot of its own."""
        return self.together.runner()

    def weight_bytes(self) -> int:
        return self.together.weight_bytes()

    def step(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k pairs to the cache; their predicted next features and draft logits
        (shapes and mask as :meth:`EagleRunner.step`'s; a tree's mask may cover cached
        nodes that only their descendants see)."""
        return self.together.step(self, embeds, features, positions, mask)


def _float_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as contiguous float32 (itself when it is: a call less per step)."""
    if rows.dtype == torch.float32 and rows.is_contiguous():
        return rows
    return rows.float().contiguous()


def _mask_window(mask: torch.Tensor | None, k: int, start: int) -> tuple[int, torch.Tensor | None]:
    """(base, mask[:, base:]) for kernels.c: the cached pairs every new pair sees come
    before ``base`` (the kernels skip the test there); a [k, k] mask or None has base
    ``start``."""
    if mask is None or mask.shape == (k, k):
        return start, mask
    if mask.shape != (k, start + k):
        raise ValueError(f"mask must be [{k}, {k}] or [{k}, {start + k}], got {tuple(mask.shape)}")
    seen_by_all = mask[:, :start].all(0)  # [start]
    base = start if bool(seen_by_all.all()) else int(seen_by_all.logical_not().nonzero()[0])
    return base, mask[:, base:]


def _fused_qkv(module: EagleHead) -> torch.Tensor:
    """[q_size + 2 kv_size, H]: q and k rows in RoPE-interleaved order (kernels.c rotates
    adjacent pairs; the head was trained with rotate-half, and permuting q and k alike
    leaves q.k unchanged), q scaled by 1/sqrt(head_dim) (kernels.c does not scale)."""
    cfg = module.config
    q = module.q.weight.detach().float()
    k = module.k.weight.detach().float()
    v = module.v.weight.detach().float()
    q = q[rope_interleave_index(q.shape[0], cfg.num_heads)] * cfg.head_dim**-0.5
    k = k[rope_interleave_index(k.shape[0], cfg.num_kv_heads)]
    return torch.cat([q, k, v])


class MedusaRunner(Protocol):
    """What computes Medusa heads' draft logits. ``together``: what computes several
    rows' in one call (a :class:`KernelMedusaRunner`), or None."""

    together: KernelMedusaRunner | None

    def __call__(self, feature: torch.Tensor, count: int) -> torch.Tensor:
        """feature [H] -> draft logits [count, N] of heads 1..count."""
        ...


class TorchMedusaRunner:
    """The Medusa heads' PyTorch module and the head rows in float32."""

    def __init__(self, head: TrainedHead) -> None:
        self.head = head
        self.module = head.module_as(MedusaHeads)
        self.together = None  # one row at a time

    @torch.no_grad()
    def __call__(self, feature: torch.Tensor, count: int) -> torch.Tensor:
        predicted = torch.stack(self.module(feature)[:count])  # [count, H]
        return self.head.draft_logits(predicted)


class KernelMedusaRunner:
    """The Medusa heads on kernels.c: the K residual blocks fused into one linear layer
    (with their biases) and the draft vocabulary's rows, at most at the target's
    precision (:func:`head_formats`)."""

    def __init__(self, head: TrainedHead, library: object, target_precision: str) -> None:
        module = head.module_as(MedusaHeads)
        layer_format, row_format = head_formats(target_precision)
        weight = torch.cat([block.weight for block in module.blocks]).detach().float()
        bias = torch.cat([block.bias for block in module.blocks]).detach().float()
        self.blocks = _head_linear(weight, bias, layer_format)  # [K * H, H]
        self.rows = _head_linear(head.head_rows, None, row_format)
        self.library = library
        self.count = len(module.blocks)
        self.formats = (layer_format, row_format)

    def weight_bytes(self) -> int:
        return self.blocks.weight_bytes() + self.rows.weight_bytes()

    @property
    def together(self) -> KernelMedusaRunner:
        """Stateless: one runner serves every row (:meth:`many`)."""
        return self

    @torch.no_grad()
    def __call__(self, feature: torch.Tensor, count: int) -> torch.Tensor:
        return self.many(feature.reshape(1, -1), [count])[0]

    @torch.no_grad()
    def many(self, features: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
        """features [B, H] -> each row's draft logits [counts[b], N] of heads 1..counts[b]:
        two linear calls for all rows (each row computed on its own: the bits it gets
        alone)."""
        threads = torch.get_num_threads()
        x = features.float().contiguous()  # [B, H]
        residual = self.blocks(self.library, x, threads).view(x.shape[0], self.count, -1)
        predicted = torch.cat(
            [x[b] + F.silu(residual[b, :count]) for b, count in enumerate(counts)]
        ).contiguous()  # [Σ counts, H]
        return list(self.rows(self.library, predicted, threads).split(list(counts)))
