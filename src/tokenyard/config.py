"""Configuration, read once: defaults, then TOKENYARD_* environment variables, then flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar


def default_cache_dir() -> Path:
    """`$TOKENYARD_CACHE` if set, else `~/.cache/tokenyard`: converted models, kernels."""
    env = os.environ.get("TOKENYARD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenyard"


def kernels_disabled() -> bool:
    """`TOKENYARD_DISABLE_KERNELS=1`: use the pure-torch paths instead of C++ kernels."""
    value = os.environ.get("TOKENYARD_DISABLE_KERNELS", "").strip().lower()
    return value not in ("", "0", "false", "no")


@dataclass
class EngineConfig:
    """How one engine replica loads its model and sizes its batch and KV cache."""

    model: str | None = None  # GGUF file or HF folder; None: the embedded SmolLM2
    weights: str = "float32"  # "float32" or "int8" (CPU, fbgemm dynamic quantization)
    device: str = "auto"  # "auto", "cpu" or "cuda"
    cache_dir: Path = field(default_factory=default_cache_dir)
    block_size: int = 16  # tokens per KV block
    kv_cache_gib: float = 1.0  # KV pool size; ignored when num_kv_blocks is set
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunk size)
    max_num_seqs: int = 128  # running requests at once
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    _ENV: ClassVar[dict[str, str]] = {
        "model": "TOKENYARD_MODEL",
        "weights": "TOKENYARD_WEIGHTS",
        "device": "TOKENYARD_DEVICE",
        "kv_cache_gib": "TOKENYARD_KV_CACHE_GIB",
        "max_num_batched_tokens": "TOKENYARD_MAX_NUM_BATCHED_TOKENS",
        "max_num_seqs": "TOKENYARD_MAX_NUM_SEQS",
    }

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """Defaults, overridden by the environment, overridden by non-None `overrides`."""
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, var in cls._ENV.items():
            raw = os.environ.get(var)
            if raw:
                kind = types[name]
                values[name] = float(raw) if "float" in str(kind) else (
                    int(raw) if "int" in str(kind) else raw
                )
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.weights not in ("float32", "int8"):
            raise ValueError(f"weights must be float32 or int8, not {self.weights!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens, max_num_seqs must be positive")


def state_dir() -> Path:
    """`$TOKENYARD_STATE_DIR`, else `./.tokenyard`: the embedded default's SQLite file, the
    ledger journal and the development key (DESIGN §4)."""
    env = os.environ.get("TOKENYARD_STATE_DIR", "").strip()
    return Path(env).expanduser() if env else Path(".tokenyard")


def database_url(state: Path | None = None) -> str:
    """TOKENYARD_DATABASE_URL, else the embedded SQLite file in the state directory."""
    env = os.environ.get("TOKENYARD_DATABASE_URL", "").strip()
    return env or f"sqlite+aiosqlite:///{(state or state_dir()) / 'tokenyard.db'}"


def redis_url() -> str | None:
    """TOKENYARD_REDIS_URL (shared limits across gateway processes), else None: in-process."""
    env = os.environ.get("TOKENYARD_REDIS_URL", "").strip()
    return env or None


#: The development key's file in the state directory.
DEV_KEY_FILE = "dev-key"


def default_api_key() -> str | None:
    """`$TOKENYARD_API_KEY`, else the development key `tokenyard serve` keeps in the state
    directory (so `tokenyard chat` works beside `make serve` with no flags)."""
    env = os.environ.get("TOKENYARD_API_KEY", "").strip()
    if env:
        return env
    try:
        return (state_dir() / DEV_KEY_FILE).read_text().strip() or None
    except OSError:
        return None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (`generate`, `engine`, `serve`, `bench offline`)."""
    parser.add_argument("--model", help="GGUF file or Hugging Face folder (default: embedded)")
    parser.add_argument("--weights", choices=["float32", "int8"], help="CPU weight format")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--kv-cache-gib", type=float, help="KV cache pool size in GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, help="running requests at once")
    parser.add_argument("--max-waiting-requests", type=int,
                        help="waiting-queue bound; past it requests are shed (503)")
    parser.add_argument("--threads", type=int, dest="num_threads", help="torch threads")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as `EngineConfig` keyword arguments."""
    names = ["model", "weights", "device", "kv_cache_gib", "max_num_batched_tokens",
             "max_num_seqs", "max_waiting_requests", "num_threads"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
