"""``train-draft`` end to end: data -> target features on disk -> head -> folder."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculative.heads.modules import HeadConfig, build_head
from speculative.heads.store import (
    TrainedHead,
    give_layer_features,
    load_head,
    read_head_config,
    require_features,
    save_head,
    shipped_head_dir,
)
from speculative.models.base import SupportsLayerFeatures, check_feature_layers, eagle3_layers
from speculative.training import features as feats
from speculative.training.data import MIN_TOKENS, encode_record, is_held_out, read_records
from speculative.training.precision import resolve_matmul_precision
from speculative.training.trainer import Trainer, TrainSettings, evaluate

METHODS = ("eagle", "medusa")
SELF_DISTILL_BATCH = 16  # --self-distill: prompts answered together (batched engine)


@dataclass
class TrainDraftOptions:
    out: Path
    method: str = "eagle"
    target: str = "default"
    runtime: str = "native"
    precision: str = "fp32"
    data: list[Path] = field(default_factory=list)
    eval_data: list[Path] = field(default_factory=list)  # held-out text (else a split of data)
    self_distill: int = 0
    draft_vocab: int | None = None  # None: 8192, or the --init head's
    steps: int = 0
    epochs: float = 2.0
    max_tokens: int = 512
    held_out: float = 0.05
    medusa_heads: int = 4
    # eagle: "auto" (EAGLE-3's low, middle and high layers), "none", or "2,15,27";
    # None: "auto", or the --init head's
    feature_layers: str | None = None
    unroll: int = 3
    batch_tokens: int = 2048
    lr: float = 1e-3
    seed: int = 0
    resume: bool = False
    threads: int = 0
    progress: bool = True
    loss_fraction: float = 0.5
    loss_rows: str = "independent"  # or "shared" (trainer.LOSS_ROWS)
    matmul_precision: str = "auto"  # "auto", "fp32" or "bf16" (training.precision)
    # a trained head to start from (a fine-tune): its folder, or "shipped" for the head
    # shipped for the target; its shape, draft vocabulary and feature layers are kept
    init: str | None = None


DEFAULT_DRAFT_VOCAB = 8192


def chosen_layers(spec: str, method: str, lm: Any) -> tuple[int, ...]:
    """--feature-layers for ``lm``: () for Medusa and "none", EAGLE-3's layers for "auto",
    else the comma-separated indices (ValueError when the target lacks them)."""
    if method != "eagle" or spec == "none":
        return ()
    if not isinstance(lm, SupportsLayerFeatures):
        if spec == "auto":
            return ()  # the runtime gives the last layer's feature only
        raise ValueError(f"--feature-layers {spec}: this runtime cannot give middle layers")
    if spec == "auto":
        return eagle3_layers(lm.num_layers)
    try:
        layers = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--feature-layers takes auto, none or indices like 2,15,27, got {spec!r}"
        ) from None
    return check_feature_layers(layers, lm.num_layers)


@dataclass
class InitialHead:
    """The head a fine-tune starts from (``--init``), loaded for the target."""

    where: str  # the folder, as the report names it
    head: TrainedHead
    training: dict[str, Any]  # how that head was trained (its config's "training")


def initial_head(spec: str, method: str, target: Any) -> InitialHead:
    """``--init``: "shipped" (the head shipped for ``target``) or a trained head's folder;
    loading checks the method and that it was trained for this target."""
    if spec == "shipped":
        folder = shipped_head_dir(method, target.name)
        if folder is None:
            raise ValueError(
                f"--init shipped: no {method} head ships for '{target.name}'; give a "
                "folder written by train-draft"
            )
        where = f"shipped ({folder.name})"
    else:
        folder, where = Path(spec), spec
        if not folder.is_dir():
            raise ValueError(f"--init {spec}: no such folder (a trained head, or 'shipped')")
    head = load_head(folder, target.lm, method)
    return InitialHead(where, head, read_head_config(folder).get("training", {}))


def fine_tune_shape(options: TrainDraftOptions, init: InitialHead, lm: Any) -> tuple[int, ...]:
    """The feature layers of a fine-tune: the initial head's; asking for other layers or
    another draft vocabulary size is an error (a fine-tune keeps the head's shape)."""
    config = init.head.config
    if options.draft_vocab is not None and options.draft_vocab != config.draft_vocab:
        raise ValueError(
            f"--draft-vocab {options.draft_vocab}: the --init head drafts over "
            f"{config.draft_vocab} tokens, and a fine-tune keeps them"
        )
    layers = config.feature_layers
    wanted = options.feature_layers
    if wanted is not None and chosen_layers(wanted, options.method, lm) != layers:
        named = ",".join(map(str, layers)) or "none"
        raise ValueError(
            f"--feature-layers {wanted}: the --init head reads layers {named}, and a "
            "fine-tune keeps them"
        )
    return layers


def head_config(
    lm: Any, method: str, draft_vocab: int, medusa_heads: int, layers: tuple[int, ...] = ()
) -> HeadConfig:
    """The head's shape from the target's config (native or transformers names)."""
    cfg = getattr(lm, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()

    def read(*names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
        return default

    hidden = int(require_features(lm).hidden_size)
    heads = int(read("num_heads", "num_attention_heads", default=max(1, hidden // 64)))
    return HeadConfig(
        method=method,
        hidden_size=hidden,
        draft_vocab=draft_vocab,
        intermediate_size=int(read("intermediate_size", default=4 * hidden)),
        num_heads=heads,
        num_kv_heads=int(read("num_kv_heads", "num_key_value_heads", default=heads)),
        rope_theta=float(read("rope_theta", default=10000.0)),
        rms_norm_eps=float(read("rms_norm_eps", default=1e-5)),
        medusa_heads=medusa_heads if method == "medusa" else 0,
        feature_layers=layers,
    )


def collect_records(options: TrainDraftOptions, target: Any) -> list[dict[str, Any]]:
    records = list(read_records(options.data))
    if options.self_distill > 0:
        records += self_distill_records(options, target)
    if not records:
        raise ValueError("no training data: give --data FILE... and/or --self-distill N")
    return records


def self_distill_records(options: TrainDraftOptions, target: Any) -> list[dict[str, Any]]:
    """The target answers N generated chat prompts (kept in OUT/selfdistill.jsonl, reused
    on --resume)."""
    from speculative.batch_jobs import BatchJob, RowDecoder
    from speculative.training.prompts import build_prompts
    from speculative.training.selfdistill import answer_prompts, unanswered, write_transcripts

    path = options.out / "selfdistill.jsonl"
    prompts = unanswered(path, build_prompts(options.self_distill, options.seed))
    if prompts:  # batched plain decoding: many answers share each target pass
        decoder = RowDecoder(BatchJob(draft=None, batch_size=SELF_DISTILL_BATCH), target)
        answers = answer_prompts(decoder, prompts, seed=options.seed, progress=options.progress)
        write_transcripts(path, answers)
    return list(read_records([path]))


def prepare_features(
    options: TrainDraftOptions, target: Any, layers: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Extract (or, on --resume, reuse) the feature chunks and the draft vocabulary; with
    ``layers`` the chunks hold those layers' states after each feature. A head that reads
    no layers (Medusa, ``--feature-layers none``) resumes on any cache: the first H columns
    are the last layer's feature; one that reads layers needs a cache of the same ones."""
    folder = options.out / "features"
    meta_path = folder / "meta.json"
    if options.resume and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        cached = tuple(meta.get("feature_layers", ()))
        if cached != layers and layers:  # a head of no layers reads any cache's first H
            raise ValueError(
                f"{folder} holds features of layers {list(cached) or 'none'}, not "
                f"{list(layers) or 'none'}: resume with --feature-layers "
                f"{','.join(map(str, cached)) or 'none'}, or use another --out"
            )
        return meta
    records = collect_records(options, target)
    separate = list(read_records(options.eval_data))
    sequences = []
    for index, record in enumerate(records):
        held = not separate and is_held_out(index, options.held_out)
        sequences.append((encode_record(target.tokenizer, record, options.max_tokens), held))
    for record in separate:
        sequences.append((encode_record(target.tokenizer, record, options.max_tokens), True))
    sequences = [(tokens, held) for tokens, held in sequences if len(tokens) >= MIN_TOKENS]
    if not any(not held for _, held in sequences):
        raise ValueError(f"no training sequence has {MIN_TOKENS} tokens or more")
    if separate and not any(held for _, held in sequences):
        raise ValueError(f"no --eval-data sequence has {MIN_TOKENS} tokens or more")
    started = time.perf_counter()
    counts, train_tokens, held_tokens = feats.extract(
        target.lm, sequences, folder, options.progress
    )
    size = options.draft_vocab or DEFAULT_DRAFT_VOCAB
    vocab = feats.draft_vocabulary(counts, size, target.lm.vocab_size)
    meta = {
        "records": len(records),
        "heldout_source": "eval data" if separate else "split of the training data",
        "train_tokens": train_tokens,
        "heldout_tokens": held_tokens,
        "extract_seconds": time.perf_counter() - started,
        "draft_to_target": vocab.tolist(),
        "feature_layers": list(layers),
    }
    meta_path.write_text(json.dumps(meta))
    return meta


def turn_marker(tokenizer: Any) -> int | None:
    """The chat template's turn-start token id (ChatML's <|im_start|>), if any."""
    token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    unknown = getattr(tokenizer, "unk_token_id", None)
    return int(token_id) if isinstance(token_id, int) and token_id != unknown else None


def train_draft(options: TrainDraftOptions) -> dict[str, Any]:
    """Run the whole pipeline; returns the report (also written to OUT/report.json)."""
    from speculative.targets import load_target

    if options.method not in METHODS:
        raise ValueError(f"unknown method {options.method!r}; choose one of {', '.join(METHODS)}")
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    random.seed(options.seed)
    options.out.mkdir(parents=True, exist_ok=True)
    target = load_target(options.target, options.runtime, options.precision)
    lm = require_features(target.lm, f"target '{target.name}' on the {target.runtime} runtime")
    init = initial_head(options.init, options.method, target) if options.init else None
    if init is not None:
        layers = fine_tune_shape(options, init, lm)  # loading gave the target its layers
    else:
        layers = chosen_layers(options.feature_layers or "auto", options.method, lm)
        if layers:
            give_layer_features(lm, layers)  # the features cached below carry them
    meta = prepare_features(options, target, layers)
    if init is not None:
        config, module = init.head.config, init.head.module
        draft_to_target = init.head.draft_to_target
    else:
        draft_to_target = torch.tensor(meta["draft_to_target"], dtype=torch.long)
        config = head_config(
            target.lm, options.method, draft_to_target.numel(), options.medusa_heads, layers
        )
        module = build_head(config)
    embedding = lm.input_embedding().float()
    rows = lm.output_embedding()[draft_to_target].float().contiguous()
    settings = TrainSettings(
        method=options.method,
        steps=options.steps,
        epochs=options.epochs,
        lr=options.lr,
        batch_tokens=options.batch_tokens,
        unroll=options.unroll,
        loss_fraction=options.loss_fraction,
        loss_rows=options.loss_rows,
        matmul_precision=resolve_matmul_precision(options.matmul_precision),
        seed=options.seed,
    )
    checkpoint = options.out / "checkpoint.pt"
    held_paths = feats.chunk_paths(options.out / "features", "heldout")
    steps = options.unroll + 2 if options.method == "eagle" else config.medusa_heads
    marker = turn_marker(target.tokenizer)
    before = None
    if init is not None:  # the starting point, scored on the same held-out text
        before = evaluate(module, held_paths, embedding, rows, draft_to_target, steps, marker)
    trainer = Trainer(config, module, embedding, rows, settings, checkpoint)
    if options.resume and checkpoint.is_file():
        trainer.load(checkpoint)
    total = options.steps or max(
        1, round(options.epochs * meta["train_tokens"] / options.batch_tokens)
    )
    train_paths = feats.chunk_paths(options.out / "features", "train")
    metrics = trainer.run(train_paths, total, options.progress)
    held = evaluate(module, held_paths, embedding, rows, draft_to_target, steps, marker)
    report = {
        "method": options.method,
        "target": target.name,
        "out": str(options.out),
        "records": meta["records"],
        "train_tokens": meta["train_tokens"],
        "heldout_tokens": meta["heldout_tokens"],
        "draft_vocab": draft_to_target.numel(),
        "feature_layers": list(layers),
        "steps": trainer.step,
        "extract_seconds": round(meta["extract_seconds"], 1),
        "train_seconds": round(trainer.seconds, 1),
        "matmul_precision": settings.matmul_precision,
        "soft_cross_entropy": trainer.loss_plan.soft_ce.name,
        "loss_rows": settings.loss_rows,
        "loss": round(metrics.loss, 4),
        "train_top1": round(metrics.top1, 4),
        "heldout_top1": [round(x, 4) for x in held.top1],
        "heldout_scope": "answers" if marker is not None else "all tokens",
        "heldout_source": meta.get("heldout_source", "split of the training data"),
        "heldout_accepted": round(held.accepted, 3),
        "heldout_drafted": steps,
        # accepted ÷ drafted of that greedy chain: the bench's acceptance rate α at γ = steps
        "heldout_acceptance_rate": round(held.accepted / steps, 4),
    }
    if init is not None and before is not None:
        report["init"] = init.where
        report["init_heldout_top1"] = [round(x, 4) for x in before.top1]
        report["init_heldout_accepted"] = round(before.accepted, 3)
        report["init_training"] = init.training  # how the starting head was trained
    save_head(options.out, config, module, draft_to_target, lm, target.name, {"training": report})
    (options.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
