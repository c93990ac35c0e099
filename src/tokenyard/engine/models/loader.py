"""Find, load and cache models: GGUF files (dequantized once, then cached) or HF folders.

The first load of a GGUF file dequantizes every tensor (seconds) and writes the result to
`cache_dir/<sha256 of the file>/` as `model.safetensors` + tokenizer files + `config.json`
(our ModelConfig). Later loads of the same file read that folder instead. The folder is
built under a temporary name and renamed into place, so readers never see a partial one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenyard.config import default_cache_dir
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.families import CausalLM, family
from tokenyard.engine.models.gguf_loader import (
    iter_gguf_blocks,
    iter_gguf_weights,
    open_gguf,
    read_gguf_config,
)
from tokenyard.engine.models.hf_loader import load_hf_folder
from tokenyard.text.model_files import CACHE_MARKER, file_sha256, resolve_model_path
from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Bump when the cache layout or the conversion changes; older entries are rebuilt.
CACHE_FORMAT_VERSION = 1
_WEIGHTS = "model.safetensors"
_BLOCKS = "blocks.safetensors"  # the GGUF's Q4_0/Q4_1/Q8_0 tensors, undequantized
_CONFIG = "config.json"
_STALE_TMP_SECONDS = 3600.0


@dataclass
class LoadedModel:
    """Everything needed to build and serve a model.

    `weights` are float32 tensors with Hugging Face names (drop the reference once the
    model is built: they are a full copy of the parameters). `from_cache` is True when a
    GGUF was read from the conversion cache rather than dequantized.
    """

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    from_cache: bool = False
    cache_path: Path | None = None


def load_model(
    model: str | None, cache_dir: Path | None = None, show_progress: bool = True
) -> LoadedModel:
    """Load config, float32 weights (HF names) and tokenizer for `model`.

    `model` is None (embedded default), a .gguf file or a Hugging Face folder. GGUF files go
    through the conversion cache in `cache_dir` (default: `default_cache_dir()`).
    Raises FileNotFoundError for missing models and ValueError for unsupported ones.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        config, weights = load_hf_folder(path)
        return LoadedModel(config, weights, Tokenizer.from_hf_folder(path), path)
    if not _is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file (missing 'GGUF' magic)")
    return _load_gguf_cached(path, cache_dir or default_cache_dir(), show_progress)


def load_gguf_blocks(loaded: LoadedModel) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (GGUF type name, raw blocks uint8 [rows, bytes]) for the tensors that
    `loaded`'s GGUF keeps as Q4_0, Q4_1 or Q8_0; {} for a Hugging Face folder.

    Read from `blocks.safetensors` in the model's cache entry, written there on first use
    (opening the GGUF again takes seconds; reading the blocks back, milliseconds).
    """
    if loaded.source.is_dir() or not _is_gguf(loaded.source):
        return {}
    cached = None if loaded.cache_path is None else loaded.cache_path / _BLOCKS
    if cached is not None and cached.exists():
        try:
            return _read_blocks(cached)
        except Exception as exc:  # damaged: rebuild it below
            logger.warning("block cache %s unreadable (%s); rebuilding it", cached, exc)
    reader = open_gguf(loaded.source)
    blocks = {name: (kind, raw) for name, kind, raw in iter_gguf_blocks(reader, loaded.config)}
    if cached is not None:
        tmp = cached.with_name(f".{_BLOCKS}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            kinds = {name: kind for name, (kind, _) in blocks.items()}
            save_file({name: raw for name, (_, raw) in blocks.items()}, str(tmp),
                      metadata={"types": json.dumps(kinds)})
            os.replace(tmp, cached)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            logger.warning("could not write block cache %s: %s", cached, exc)
    return blocks


def _read_blocks(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        kinds = json.loads(metadata["types"])
        return {name: (kinds[name], f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118


def build_model(loaded: LoadedModel, skip: Collection[str] = frozenset()) -> CausalLM:
    """Construct the model for `loaded.config` (its family's class), copy the weights in,
    switch to eval mode. ValueError for an architecture no family runs. `skip`: weights
    neither read nor copied, their parameters left uninitialized (for a caller that
    replaces them, as block weights replace the projections)."""
    model = family(loaded.config.architecture).model(loaded.config)
    weights = loaded.weights
    model.load_weights(((name, weights[name]) for name in weights if name not in skip), skip)
    return model.eval()


class CachedWeights(Mapping[str, torch.Tensor]):
    """The float32 weights of a cache entry's file, each read when it is asked for: a
    caller that needs some of them reads only those (and holds one at a time)."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(str(path), framework="pt")
        self._names = list(self._file.keys())
        self._known = frozenset(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _load_gguf_cached(path: Path, cache_dir: Path, show_progress: bool) -> LoadedModel:
    sha = file_sha256(path)
    entry = cache_dir / sha
    if _cache_valid(entry):
        try:
            return _read_cache(entry, path)
        except Exception as exc:  # a damaged entry must not make the model unloadable
            logger.warning("cache entry %s unreadable (%s); rebuilding it", entry, exc)

    reader = open_gguf(path)
    config = read_gguf_config(reader, name=path.stem)
    weights = dict(iter_gguf_weights(reader, config, show_progress))
    tokenizer = Tokenizer.from_gguf(reader)  # reuse the reader: opening one takes seconds
    try:
        _write_cache(entry, config, weights, tokenizer, path)
    except OSError as exc:
        # Serving still works without a cache; the next start just converts again.
        logger.warning("could not write model cache %s: %s", entry, exc)
        return LoadedModel(config, weights, tokenizer, path)
    return LoadedModel(config, weights, tokenizer, path, from_cache=False, cache_path=entry)


def _cache_valid(entry: Path) -> bool:
    try:
        marker = json.loads((entry / CACHE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CACHE_FORMAT_VERSION


def _read_cache(entry: Path, source: Path) -> LoadedModel:
    config = ModelConfig(**json.loads((entry / _CONFIG).read_text(encoding="utf-8")))
    weights = CachedWeights(entry / _WEIGHTS)
    tokenizer = Tokenizer.load(entry)
    return LoadedModel(config, weights, tokenizer, source, from_cache=True, cache_path=entry)


def _write_cache(
    entry: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    source: Path,
) -> None:
    """Write the entry into a sibling temp folder, then rename it into place."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / _WEIGHTS), metadata={"format": "pt"})
        tokenizer.save(tmp)
        (tmp / _CONFIG).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        marker = {"format": CACHE_FORMAT_VERSION, "source": str(source), "sha256": entry.name}
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if entry.exists():
            # An outdated or damaged entry: move it aside first (a folder rename cannot
            # replace a non-empty folder), then delete it once the new one is in place.
            old = entry.parent / f".{entry.name}.old-{uuid.uuid4().hex[:8]}"
            entry.rename(old)
            tmp.rename(entry)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(entry)
    except BaseException as exc:  # incl. KeyboardInterrupt: never leave 100s of MB behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and _cache_valid(entry):
            return  # another process finished the same entry first; theirs is as good
        raise


def _remove_stale_tmp(entry: Path) -> None:
    """Delete temp folders of this entry left by crashed writers (older than an hour)."""
    now = time.time()
    for stale in entry.parent.glob(f".{entry.name}.*"):
        try:
            if now - stale.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue
