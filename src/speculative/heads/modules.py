"""The drafting heads as PyTorch modules: an EAGLE-style decoder layer over [token
embedding, target feature], and Medusa's residual heads.

Both predict over a reduced draft vocabulary through the target's own (frozen) output
head rows: ``logits = feature @ head_rows.T`` with ``head_rows = W_target[draft_to_target]``
[draft_vocab, hidden]. The rows are never stored with a head; they are taken from the
target when the head is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a head; ``method`` is "eagle" or "medusa"."""

    method: str
    hidden_size: int
    draft_vocab: int
    intermediate_size: int = 0  # eagle: the decoder layer's MLP width
    num_heads: int = 0  # eagle: attention heads
    num_kv_heads: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    medusa_heads: int = 0  # medusa: K
    # eagle: the target's middle layers whose states it fuses (EAGLE-3; see
    # SupportsLayerFeatures), () for the last layer's feature alone
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: [..., hidden * (1 + layers)]."""
        return self.hidden_size * (1 + len(self.feature_layers))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["feature_layers"] = list(self.feature_layers)
        return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 always (a no-op when drafting; under training's bf16 autocast the
        # norm stays exact and fused, and the next product rounds its input again)
        return F.rms_norm(x.float(), x.shape[-1:], self.weight, self.eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-split layout). x: [..., T, d]; positions: [T] or [B, 1, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    angles = positions.float().unsqueeze(-1) * inv  # [..., T, d/2]
    cos = torch.cat([angles.cos()] * 2, -1).to(x.dtype)  # x's dtype: bf16 under autocast
    sin = torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """The EAGLE head's own cache over the pairs it processed (batch of one)."""

    keys: torch.Tensor  # [kv_heads, capacity, head_dim]
    values: torch.Tensor  # [kv_heads, capacity, head_dim]
    length: int = 0


class LayerFusion(nn.Module):
    """EAGLE-3's fusion of the target's layer states: fc([norm(s_1) | ... | norm(s_n)])
    over the feature layers' states ([..., H * (1 + n)] features: the last layer's, unused
    here, then the n layers') -> [..., H], in place of the last layer's feature."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        h, n = config.hidden_size, len(config.feature_layers)
        self.hidden = h
        self.norms = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(n))
        self.fc = nn.Linear(n * h, h, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.hidden
        states = [
            norm(features[..., h * (i + 1) : h * (i + 2)]) for i, norm in enumerate(self.norms)
        ]
        return self.fc(torch.cat(states, -1))


class EagleHead(nn.Module):
    """fc(2H -> H) then one Llama decoder layer; its output is the predicted next feature.
    With feature layers (EAGLE-3) the target's features are first fused by a
    :class:`LayerFusion`; drafted pairs read the head's own predicted features as they are."""

    # :class:`TrainableHead`: a row reads the pair (x_{t+1}, f_t), and what it predicts is
    # the target's next feature itself (regressed onto it as well as scored by the rows)
    reads_next_token = True
    regresses_features = True

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.layer_fusion = LayerFusion(config) if config.feature_layers else None
        self.embed_norm = RMSNorm(h, eps)
        self.feature_norm = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = RMSNorm(h, eps)
        kv = config.num_kv_heads * config.head_dim
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, kv, bias=False)
        self.v = nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.gate = nn.Linear(h, config.intermediate_size, bias=False)
        self.up = nn.Linear(h, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, h, bias=False)

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head reads them: [..., feature_width] -> [..., H]
        (the fused layers', or the last layer's feature). A predicted feature ([..., H]
        where the target's are wider) passes unchanged."""
        if features.shape[-1] == self.config.hidden_size:
            return features
        if self.layer_fusion is None:
            return features[..., : self.config.hidden_size]
        return self.layer_fusion(features)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[..., H] embeddings of x_{t+1} and features f_t (the target's, any width, or
        predicted [..., H]) -> the layer's input [..., H]."""
        features = self.target_features(features)
        return self.fc(torch.cat([self.embed_norm(embeds), self.feature_norm(features)], -1))

    def _qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, H], positions [T] -> q [B, heads, T, d], k and v [B, kv, T, d] (q, k
        rotated): :meth:`_qkv_rows` over the B * T rows."""
        b, t, hidden = x.shape
        rows = self._qkv_rows(x.reshape(b * t, hidden), positions.repeat(b))
        q, k, v = (y.view(b, t, *y.shape[1:]).transpose(1, 2) for y in rows)
        return q, k, v

    def _qkv_rows(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of any sequences: x [M, H], positions [M] -> q [M, heads, d], k and v
        [M, kv, d] (q, k rotated)."""
        cfg = self.config
        m = x.shape[0]
        normed = self.input_norm(x)
        q = self.q(normed).view(m, cfg.num_heads, cfg.head_dim)
        k = self.k(normed).view(m, cfg.num_kv_heads, cfg.head_dim)
        v = self.v(normed).view(m, cfg.num_kv_heads, cfg.head_dim)
        at = positions.unsqueeze(1)  # [M, 1]: one position for all of a row's heads
        return rope(q, at, cfg.rope_theta), rope(k, at, cfg.rope_theta), v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection + MLP. x: [..., H]; attn: [..., heads * d]."""
        x = x + self.o(attn)
        normed = self.post_norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))

    def _group(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kv, T, d] -> [B, heads, T, d] (grouped-query attention; [M, kv, d] ->
        [M, heads, d] likewise)."""
        return kv.repeat_interleave(self.config.num_heads // self.config.num_kv_heads, dim=1)

    # ---- training: a teacher-forced pass plus unrolled draft steps ------------------
    def teacher_forced(
        self,
        tokens: torch.Tensor,  # [B, L] int64
        features: torch.Tensor,  # [B, L, W] the target's features (W: H or fused layers)
        embedding: torch.Tensor,  # [vocab, H] the target's input embedding
        steps: int,
        wanted: list[torch.Tensor] | None = None,
    ) -> list[tuple[torch.Tensor, int]]:
        """:class:`TrainableHead`: :meth:`unrolled` over every true pair of the batch; row
        t of step s predicts the feature of position t + s + 1."""
        rows = prediction_rows(self, tokens.shape[1])
        embeds = embedding[shifted(tokens, 1, rows + steps - 1)]  # x_{t+1}: [B, T + steps - 1, H]
        outputs = self.unrolled(embeds, features[:, :rows], steps, wanted)
        return [(out, s + 1) for s, out in enumerate(outputs)]

    def unrolled(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        steps: int,
        wanted: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Predicted features for ``steps`` consecutive draft steps from every position.

        embeds:   [B, T + steps - 1, H] embeddings of x_1 .. (x_{t+1} at index t)
        features: [B, T, H] target features f_0 .. f_{T-1}
        wanted:   per step s, the flat indices into [B * T] of the rows whose step-s
                  prediction the caller reads (None: every row). Step s computes those
                  rows and the ones a later step reads (row t of step s + 1 reads row t
                  of step s); no other row of it is computed, and it is zero in the result.
        returns:  per step s, [B, T, H]: row t predicts f_{t+s+1} as drafting would after
                  a context whose last true pair is t (step s reads the head's own
                  prediction of step s - 1 and attends to true pairs <= t plus its own
                  earlier draft pairs: exactly the cache it sees at inference).
        """
        b, t = features.shape[:2]
        hidden, heads, d = self.config.hidden_size, self.config.num_heads, self.config.head_dim
        needed = _needed_rows(wanted, steps, b * t)
        x = self.fuse(embeds[:, :t], features)  # [B, T, H]: every true pair is context
        q, k, v = self._qkv(x, torch.arange(t))
        true_k, true_v = self._group(k), self._group(v)  # [B, heads, T, d]
        rows = needed[0]
        x_rows = x.reshape(b * t, hidden)[rows]  # [M, H]
        q_rows = q.transpose(1, 2).reshape(b * t, heads, d)[rows]  # [M, heads, d]
        drafted: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, k, v
        outputs: list[torch.Tensor] = []
        for s in range(steps):
            if s > 0:
                rows = needed[s]  # a subset of the rows the step before computed
                inputs = embeds[:, s : s + t].reshape(b * t, hidden)[rows]
                x_rows = self.fuse(inputs, outputs[-1].reshape(b * t, hidden)[rows])
                q_rows, k_rows, v_rows = self._qkv_rows(x_rows, rows % t + s)
                drafted.append((rows, self._group(k_rows), self._group(v_rows)))
            own = []  # this step's rows' own keys and values of each earlier draft step
            for at, dk, dv in drafted:
                where = torch.searchsorted(at, rows)  # rows within the rows that step computed
                own.append((dk[where], dv[where]))
            attn = _attend_rows(q_rows, rows, true_k, true_v, own)  # [M, heads * d]
            out_rows = self._finish(x_rows, attn)  # [M, H]
            dense = out_rows.new_zeros(b * t, hidden).index_copy(0, rows, out_rows)
            outputs.append(dense.view(b, t, hidden))
        return outputs

    # ---- inference: an incremental pass over the head's own cache -------------------
    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        shape = (cfg.num_kv_heads, capacity, cfg.head_dim)
        return KVCache(torch.zeros(shape), torch.zeros(shape))

    @torch.no_grad()
    def step(
        self,
        cache: KVCache,
        embeds: torch.Tensor,  # [k, H] embeddings of the tokens x_{t+1}
        features: torch.Tensor,  # [k, H] features f_t (true or predicted)
        positions: torch.Tensor,  # [k] int64 pair positions t
        attention_mask: torch.Tensor | None = None,  # [k, k] or [k, start + k] bool
    ) -> torch.Tensor:  # [k, H] predicted features f_{t+1}
        """Append k pairs to ``cache`` and return their predicted next features.

        Without a mask the new rows see the whole cache and each other causally; a [k, k]
        mask says which new rows each sees (plus the whole cache); a [k, start + k] mask
        gives every visible slot (tree drafting: a node sees its ancestors only)."""
        k = embeds.shape[0]
        start = cache.length
        if start + k > cache.keys.shape[1]:
            kv, capacity, d = cache.keys.shape
            extra = torch.zeros(kv, max(capacity, start + k - capacity + 64), d)
            cache.keys = torch.cat([cache.keys, extra], 1)
            cache.values = torch.cat([cache.values, extra.clone()], 1)
        x = self.fuse(embeds, features).unsqueeze(0)  # [1, k, H]
        q, new_k, new_v = self._qkv(x, positions)
        cache.keys[:, start : start + k] = new_k[0]
        cache.values[:, start : start + k] = new_v[0]
        cache.length = start + k
        cfg = self.config
        kv, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        keys = cache.keys[:, : start + k]  # [kv, S, d]
        values = cache.values[:, : start + k]
        grouped = q[0].reshape(kv, group * k, d)  # heads h = kv_index * group + g
        scores = (grouped @ keys.transpose(-1, -2)) * d**-0.5  # [kv, group * k, S]
        scores = scores.view(1, cfg.num_heads, k, start + k)
        if attention_mask is not None and attention_mask.shape[1] == start + k:
            visible = attention_mask.bool()
        else:
            new = (
                torch.ones(k, k, dtype=torch.bool).tril()
                if attention_mask is None
                else attention_mask
            )
            visible = torch.cat([torch.ones(k, start, dtype=torch.bool), new.bool()], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv, group * k, start + k)
        attn = (probs @ values).view(cfg.num_heads, k, d)  # [heads, k, d]
        return self._finish(x[0], attn.transpose(0, 1).reshape(k, -1))


def _needed_rows(wanted: list[torch.Tensor] | None, steps: int, rows: int) -> list[torch.Tensor]:
    """Per unrolled step, the sorted flat rows it must compute: its own wanted rows and
    every row a later step reads (all ``rows`` without ``wanted``)."""
    if wanted is None:
        return [torch.arange(rows)] * steps
    needed: list[torch.Tensor] = []
    later = torch.zeros(0, dtype=torch.long)
    for s in reversed(range(steps)):
        later = torch.unique(torch.cat([wanted[s].long(), later]))  # sorted
        needed.insert(0, later)
    return needed


def _attend_rows(
    q: torch.Tensor,
    rows: torch.Tensor,
    true_k: torch.Tensor,
    true_v: torch.Tensor,
    drafted: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Attention of chosen rows of a batch over their own sequence's true pairs (causal)
    and their own drafted pairs of earlier steps.

    q:       [M, heads, d] queries of flat rows ``rows`` (sorted) of [B * T]
    true_k:  [B, heads, T, d] keys of the true pairs (true_v: values)
    drafted: per earlier draft step, the same rows' own key and value [M, heads, d]
    returns  [M, heads * d]

    The rows of each sequence are gathered into a [B, heads, W, ...] block (W: the most
    rows any sequence has), so each sequence's keys meet only its own rows' queries."""
    b, _, t, d = true_k.shape
    seq, pos = rows // t, rows % t
    counts = torch.bincount(seq, minlength=b)  # [B]
    slot = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts)[seq]
    width = int(counts.max())

    def block(x: torch.Tensor) -> torch.Tensor:  # [M, heads, e] -> [B, heads, W, e]
        return x.new_zeros(b, width, *x.shape[1:]).index_put((seq, slot), x).transpose(1, 2)

    scale = d**-0.5
    last = torch.zeros(b, width, dtype=torch.long).index_put((seq, slot), pos)  # [B, W]
    visible = torch.arange(t) <= last.unsqueeze(-1)  # [B, W, T]; empty slots see pair 0
    scores = (block(q) @ true_k.transpose(-1, -2)) * scale  # [B, heads, W, T]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    extra = [block((q * dk).sum(-1, keepdim=True) * scale) for dk, _ in drafted]  # [B, h, W, 1]
    probs = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1)
    attn = probs[..., :t] @ true_v  # [B, heads, W, d]
    for j, (_, dv) in enumerate(drafted):
        attn = attn + probs[..., t + j : t + j + 1] * block(dv)
    return attn.transpose(1, 2)[seq, slot].reshape(q.shape[0], q.shape[1] * d)


class MedusaHeads(nn.Module):
    """K residual blocks on the last feature; block k predicts the token k + 1 positions
    after the one the feature's own logits predict."""

    # :class:`TrainableHead`: a row reads its feature alone (blind to the token after it),
    # and its outputs are only scored through the output rows
    reads_next_token = False
    regresses_features = False

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(config.medusa_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> list[torch.Tensor]:
        """features: [..., H] -> K predicted features [..., H] (fed to the head rows)."""
        return [features + F.silu(block(features)) for block in self.blocks]

    def teacher_forced(
        self,
        tokens: torch.Tensor,  # [B, L] int64 (unread: a block sees its feature alone)
        features: torch.Tensor,  # [B, L, W] the target's features; the last layer's first
        embedding: torch.Tensor,  # unread
        steps: int,
        wanted: list[torch.Tensor] | None = None,  # unread: every row is cheap
    ) -> list[tuple[torch.Tensor, int]]:
        """:class:`TrainableHead`: the first ``steps`` blocks over every position; block k
        at row t predicts the feature of position t + k + 1."""
        outputs = self(features[..., : self.config.hidden_size])  # the last layer's
        return [(out, k + 1) for k, out in enumerate(outputs[:steps])]


@runtime_checkable
class TrainableHead(Protocol):
    """What the trainer asks of a head module (one class per head strategy)."""

    config: HeadConfig
    reads_next_token: bool  # row t reads x_{t+1} with f_t (one row fewer per sequence)
    regresses_features: bool  # its predictions are regressed onto the target's features

    def teacher_forced(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        embedding: torch.Tensor,
        steps: int,
        wanted: list[torch.Tensor] | None = None,
    ) -> list[tuple[torch.Tensor, int]]:
        """Per draft step: (predicted features [B, T, H], offset o): row t predicts the
        feature of position t + o (the target's distribution of token t + o + 1). With
        ``wanted`` (per step, flat row indices into [B * T]) a head may compute only the
        rows read."""
        ...

    def train(self, mode: bool = True) -> object: ...  # nn.Module's

    def eval(self) -> object: ...


def prediction_rows(head: TrainableHead, length: int) -> int:
    """Rows per sequence of L tokens in a step's predictions: L - 1 where row t reads the
    pair (x_{t+1}, f_t), else L."""
    return length - 1 if head.reads_next_token else length


def shifted(x: torch.Tensor, by: int, length: int) -> torch.Tensor:
    """x[:, by : by + length] zero-padded on the right: [B, length, ...]."""
    part = x[:, by : by + length]
    missing = length - part.shape[1]
    if missing > 0:
        pad = torch.zeros(x.shape[0], missing, *x.shape[2:], dtype=x.dtype)
        part = torch.cat([part, pad], dim=1)
    return part


def build_head(config: HeadConfig) -> nn.Module:
    if config.method == "eagle":
        return EagleHead(config)
    if config.method == "medusa":
        return MedusaHeads(config)
    raise ValueError(f"unknown head method {config.method!r}; expected eagle or medusa")
