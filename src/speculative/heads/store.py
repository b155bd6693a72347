"""A trained head on disk: ``head.safetensors`` (bf16 weights + the draft-vocabulary map)
and ``config.json`` naming the target it was trained for.

The target's own embedding and output-head rows are never stored: loading takes them
from the target (``head_rows = W_target[draft_to_target]``). A fingerprint of the target
(sizes plus a probe of embedding values, compared by correlation so that another
precision of the same model still matches) makes loading against another model fail
with a message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from speculative.heads.modules import HeadConfig, build_head
from speculative.models.base import SupportsHiddenStates, SupportsLayerFeatures

WEIGHTS = "head.safetensors"
CONFIG = "config.json"
PROBE = 64
MATCH = 0.95  # probe correlation for "same model" (int4 vs fp32 of one model: > 0.99)


class HeadMismatch(ValueError):
    """A head trained for another target."""


def require_features(model: object, name: str = "the target") -> SupportsHiddenStates:
    """``model`` if it can give features; a clear error otherwise."""
    if not isinstance(model, SupportsHiddenStates):
        raise ValueError(
            f"{name} ({type(model).__name__}) cannot return its hidden states, which drafting "
            "heads need; use the native or transformers runtime"
        )
    return model


def target_fingerprint(model: SupportsHiddenStates) -> dict[str, Any]:
    """Sizes plus PROBE embedding values at fixed rows and columns."""
    embed = model.input_embedding()  # [vocab, hidden]
    vocab, hidden = embed.shape
    rows = torch.linspace(0, vocab - 1, PROBE).long()
    cols = (torch.arange(PROBE) * 7) % hidden
    probe = embed[rows, cols].float()
    return {"vocab_size": int(vocab), "hidden_size": int(hidden), "probe": probe.tolist()}


def fingerprint_problem(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Why two fingerprints differ, or None when they name the same model."""
    for key in ("vocab_size", "hidden_size"):
        if expected[key] != actual[key]:
            return f"{key} {actual[key]} != {expected[key]}"
    a, b = torch.tensor(expected["probe"]), torch.tensor(actual["probe"])
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    if not corr > MATCH:
        return f"embedding probe correlation {corr:.2f} (same model: > {MATCH})"
    return None


M = TypeVar("M", bound=nn.Module)


@dataclass
class TrainedHead:
    """A head module plus its draft vocabulary, bound to a target's output rows."""

    config: HeadConfig
    module: nn.Module
    draft_to_target: torch.Tensor  # [draft_vocab] int64 target ids
    head_rows: torch.Tensor  # [draft_vocab, hidden] float32, the target's output rows
    embedding: torch.Tensor  # [vocab, hidden] float32, the target's input embedding
    target_name: str = ""

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., draft_vocab]."""
        return features @ self.head_rows.T

    def module_as(self, kind: type[M]) -> M:
        """The module as the ``kind`` a runner of it needs, or a ValueError naming both
        (a runner of one kind of head given the other)."""
        if not isinstance(self.module, kind):
            raise ValueError(
                f"this runner runs {kind.__name__} modules; the head is a "
                f"{type(self.module).__name__} ({self.config.method})"
            )
        return self.module


def bind(
    config: HeadConfig, module: nn.Module, draft_to_target: torch.Tensor, model: Any, name: str = ""
) -> TrainedHead:
    """The head over ``model``'s rows; a head that fuses middle layers (EAGLE-3) has the
    model give those layers' states with its features from now on."""
    target = require_features(model)
    if config.feature_layers:
        give_layer_features(model, config.feature_layers)
    return TrainedHead(
        config=config,
        module=module,
        draft_to_target=draft_to_target,
        head_rows=target.output_embedding()[draft_to_target].float().contiguous(),
        embedding=target.input_embedding().float(),
        target_name=name,
    )


def give_layer_features(model: object, layers: Sequence[int]) -> None:
    """Have ``model``'s features carry the states of ``layers`` (SupportsLayerFeatures),
    or a clear ValueError: a runtime without them, layers the model lacks, or a model
    already giving other layers (for another head)."""
    wanted = tuple(layers)
    if not isinstance(model, SupportsLayerFeatures):
        raise ValueError(
            f"the head fuses the target's layers {list(wanted)}, and this runtime "
            f"({type(model).__name__}) cannot give middle-layer features"
        )
    if model.feature_layers and model.feature_layers != wanted:
        raise ValueError(
            f"the target already gives the states of layers {list(model.feature_layers)} "
            f"(another head's); this head reads {list(wanted)}"
        )
    model.set_feature_layers(wanted)


def save_head(
    folder: Path,
    config: HeadConfig,
    module: nn.Module,
    draft_to_target: torch.Tensor,
    target: SupportsHiddenStates,
    target_name: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the head (bf16) and its config into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()
    }
    tensors["draft_to_target"] = draft_to_target.to(torch.int64).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    meta = {
        "format": "speculative-head/1",
        "head": config.to_dict(),
        "target": {"name": target_name, "fingerprint": target_fingerprint(target)},
        **(extra or {}),
    }
    (folder / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def read_head_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ValueError(f"{folder} is not a trained head: no {CONFIG}")
    return json.loads(path.read_text())


def load_head(folder: Path, target: Any, method: str | None = None) -> TrainedHead:
    """Load the head in ``folder`` for ``target`` (a model with SupportsHiddenStates)."""
    from safetensors.torch import load_file

    model = require_features(target)
    meta = read_head_config(folder)
    config = HeadConfig(**meta["head"])
    if method is not None and config.method != method:
        raise ValueError(f"{folder} holds a {config.method} head, not {method}")
    trained_for = meta["target"]
    problem = fingerprint_problem(trained_for["fingerprint"], target_fingerprint(model))
    if problem is not None:
        raise HeadMismatch(
            f"the head in {folder} was trained for '{trained_for['name']}', not this target "
            f"({problem})"
        )
    tensors = load_file(str(Path(folder) / WEIGHTS))
    draft_to_target = tensors.pop("draft_to_target")
    module = build_head(config)
    module.load_state_dict({k: v.float() for k, v in tensors.items()})
    module.eval()
    return bind(config, module, draft_to_target, model, trained_for["name"])


def shipped_head_dir(method: str, target_name: str) -> Path | None:
    """The head shipped in package data for ``target_name`` (e.g. the default model)."""
    root = resources.files("speculative.heads").joinpath("data")
    folder = Path(str(root)) / f"{target_name}-{method}"
    return folder if (folder / CONFIG).is_file() else None
