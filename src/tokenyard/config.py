"""Configuration, read once: defaults, then TOKENYARD_* environment variables, then flags."""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from tokenyard.fleet_values import valid_region
from tokenyard.lora_spec import parse_lora_modules


def default_cache_dir() -> Path:
    """`$TOKENYARD_CACHE` if set, else `~/.cache/tokenyard`: converted models, kernels."""
    env = os.environ.get("TOKENYARD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenyard"


def kernels_disabled() -> bool:
    """`TOKENYARD_DISABLE_KERNELS=1`: use the pure-torch paths instead of C++ kernels."""
    value = os.environ.get("TOKENYARD_DISABLE_KERNELS", "").strip().lower()
    return value not in ("", "0", "false", "no")


#: Weight formats (`--weights`): auto, float32, block-quantized q8_0 / q4_1 and fbgemm int8
#: (the last three CPU only). auto: q4_1 for a GGUF whose projections are Q4_0 / Q4_1 on
#: the CPU, float32 otherwise (engine/models/quant.py `resolve_weights`).
WEIGHT_FORMATS = ("auto", "float32", "q8_0", "q4_1", "int8")
#: A deployment's tool-call and reasoning parsers (`serve --tool-call-parser`, a fleet
#: file's `tool_call_parser` / `reasoning_parser`; text/tool_formats.py, text/reasoning.py):
#: "auto" picks them from the model's chat template.
TOOL_CALL_PARSERS = ("hermes", "qwen3", "llama3_json", "mistral", "phi4_mini_json")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
#: The KV pool's element types (`EngineConfig.kv_cache_dtype`).
KV_CACHE_DTYPES = ("auto", "float32", "float16")


def parse_on_off(raw: str) -> bool:
    """on/off, true/false, yes/no or 1/0, any case."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not on or off")


class Settings:
    """A dataclass of settings read once: defaults < TOKENYARD_* environment < flags.

    `_ENV` maps fields to their variables; each value is parsed by its field's annotation."""

    _ENV: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_env(cls, **overrides: Any) -> Self:
        """Defaults, overridden by the environment, overridden by non-None `overrides`."""
        values: dict[str, Any] = {}
        types = {f.name: str(f.type) for f in fields(cls)}  # type: ignore[arg-type]
        for name, var in cls._ENV.items():
            raw = os.environ.get(var, "").strip()
            if not raw:
                continue
            kind = types[name]
            try:
                values[name] = (
                    parse_on_off(raw) if "bool" in kind
                    else float(raw) if "float" in kind else int(raw) if "int" in kind
                    else Path(raw).expanduser() if "Path" in kind else raw
                )
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {kind}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ValueError for values out of range."""


@dataclass
class EngineConfig(Settings):
    """How one engine replica loads its model and sizes its batch and KV cache."""

    model: str | None = None  # GGUF file or HF folder; None: the embedded SmolLM2
    weights: str = "auto"  # one of WEIGHT_FORMATS (q8_0 / q4_1 / int8: CPU only)
    device: str = "auto"  # "auto", "cpu" or "cuda"
    cache_dir: Path = field(default_factory=default_cache_dir)
    block_size: int = 16  # tokens per KV block
    kv_cache_gib: float = 1.0  # KV pool size; ignored when num_kv_blocks is set
    # The pool's element type: "auto" (the model's: float32 on the CPU, bfloat16 on CUDA)
    # or "float16" (half the bytes a token; llama.cpp's default). Queries and the
    # attention's arithmetic stay in the model's dtype.
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunk size)
    # Prompt tokens per step while more than one request is in flight (None: the whole
    # budget); 256 measured better than none at 8 and 32 streams (docs/operations.md).
    prefill_chunk: int | None = 256
    max_num_seqs: int = 128  # running requests at once
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # Plan each step while the one before computes (engine/core.py); see operations.md
    # for what it measured on this machine.
    async_scheduling: bool = False
    # The step thread hands a step's outputs to the HTTP loop at once when the last hand-off
    # is at least this old, else with a later step's (engine/async_core.py): one hand-off
    # wakes the loop and trades the GIL, about a null-model step's cost on a 2-core VM.
    # A first token and a finish always go at once; 0: every step.
    stream_interval_ms: float = 1.0
    # CUDA: replay decode steps from CUDA graphs (engine/cuda_graphs.py); off: never run yet
    cuda_graphs: bool = False
    # A model that computes nothing in place of `model`'s weights (engine/null_model.py):
    # what `tokenyard bench host` measures the host path with.
    null_model: bool = False
    # vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": 4, ...}
    # or {"method": "draft_model", "model": "<draft>", "num_speculative_tokens": 4}
    speculative_config: str | None = None
    # LoRA adapters served over the base model (engine/lora/): vLLM's --lora-modules,
    # "name=path[,name=path]"; `max_loras` of them resident at once (least recently used
    # out), each of rank `max_lora_rank` at most.
    lora_modules: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 16

    _ENV: ClassVar[dict[str, str]] = {
        "model": "TOKENYARD_MODEL",
        "weights": "TOKENYARD_WEIGHTS",
        "device": "TOKENYARD_DEVICE",
        "kv_cache_gib": "TOKENYARD_KV_CACHE_GIB",
        "kv_cache_dtype": "TOKENYARD_KV_CACHE_DTYPE",
        "max_num_batched_tokens": "TOKENYARD_MAX_NUM_BATCHED_TOKENS",
        "prefill_chunk": "TOKENYARD_PREFILL_CHUNK",
        "max_num_seqs": "TOKENYARD_MAX_NUM_SEQS",
        "async_scheduling": "TOKENYARD_ASYNC_SCHEDULING",
        "stream_interval_ms": "TOKENYARD_STREAM_INTERVAL_MS",
        "cuda_graphs": "TOKENYARD_CUDA_GRAPHS",
        "null_model": "TOKENYARD_NULL_MODEL",
        "speculative_config": "TOKENYARD_SPECULATIVE_CONFIG",
        "lora_modules": "TOKENYARD_LORA_MODULES",
        "max_loras": "TOKENYARD_MAX_LORAS",
        "max_lora_rank": "TOKENYARD_MAX_LORA_RANK",
    }

    def validate(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"not {self.weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens, max_num_seqs must be positive")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be positive (or unset: the whole budget)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        parse_lora_modules(self.lora_modules)


@dataclass
class KVEventsConfig(Settings):
    """A replica's second KV-event publisher, in vLLM's own format (`wire/vllm_kv_events.py`)
    for routers built for vLLM (llm-d's indexer, vLLM's router). Off unless an endpoint is
    set. Its events carry each block's token ids, so it binds a private or loopback
    address in plain ZMQ, or any address with CURVE keys the operator provides."""

    #: The PUB socket to bind, ``tcp://<ip>:<port>`` (port ``*``: a free one, shown in
    #: the replica's info); None: no vLLM-format events.
    vllm_endpoint: str | None = None
    vllm_replay_endpoint: str | None = None  # the replay ROUTER (vLLM's), optional
    #: The first frame of every message; llm-d reads ``kv@<pod>@<model>`` from it.
    vllm_topic: str = ""
    #: NONE_HASH's seed: vLLM's default for sha256; set it to the PYTHONHASHSEED of a
    #: vLLM fleet that sets one, so both name equal blocks alike.
    vllm_hash_seed: str = "vllm-none-hash"
    #: CURVE: this publisher's secret key (Z85, 40 characters) and the client public keys
    #: (Z85, comma-separated) it admits; both or neither.
    curve_secret_key: str | None = None
    curve_client_keys: str | None = None

    _ENV: ClassVar[dict[str, str]] = {
        "vllm_endpoint": "TOKENYARD_KV_EVENTS_VLLM_ENDPOINT",
        "vllm_replay_endpoint": "TOKENYARD_KV_EVENTS_VLLM_REPLAY_ENDPOINT",
        "vllm_topic": "TOKENYARD_KV_EVENTS_VLLM_TOPIC",
        "vllm_hash_seed": "TOKENYARD_KV_EVENTS_VLLM_HASH_SEED",
        "curve_secret_key": "TOKENYARD_KV_EVENTS_CURVE_SECRET_KEY",
        "curve_client_keys": "TOKENYARD_KV_EVENTS_CURVE_CLIENT_KEYS",
    }

    @property
    def client_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.curve_client_keys or "").split(",") if k.strip())

    def validate(self) -> None:
        if bool(self.curve_secret_key) != bool(self.client_keys):
            raise ValueError("the vLLM-format KV events' CURVE needs both a secret key and "
                             "the client keys it admits")
        if self.curve_secret_key is not None and len(self.curve_secret_key) != 40:
            raise ValueError("the CURVE secret key is 40 characters of Z85")
        for endpoint in (self.vllm_endpoint, self.vllm_replay_endpoint):
            if endpoint is not None:
                _check_event_endpoint(endpoint, curve=self.curve_secret_key is not None)
        if self.vllm_replay_endpoint is not None and self.vllm_endpoint is None:
            raise ValueError("a replay endpoint needs the vLLM-format events' endpoint")


def _check_event_endpoint(endpoint: str, *, curve: bool) -> None:
    """``tcp://<ip>:<port or *>``; without CURVE the ip must be loopback or private:
    these events carry prompts' token ids."""
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+|\*)", endpoint)
    if m is None:
        raise ValueError(f"KV events endpoint {endpoint!r} is not tcp://<ip>:<port>")
    if curve:
        return
    try:
        address = ipaddress.ip_address(m.group(1))
    except ValueError:
        raise ValueError(f"KV events endpoint {endpoint!r}: plain ZMQ needs an IP address "
                         "(private or loopback); give CURVE keys for any other") from None
    if not (address.is_loopback or address.is_private) or address.is_unspecified:
        raise ValueError(f"KV events endpoint {endpoint!r}: these events carry token ids, "
                         "so plain ZMQ binds only a private or loopback address; give "
                         "CURVE keys (TOKENYARD_KV_EVENTS_CURVE_*) to bind another")


#: The shared secret between the HTTP process and its engine replicas (`Authorization:
#: Bearer <token>` on every replica route but health).
REPLICA_TOKEN_ENV = "TOKENYARD_REPLICA_TOKEN"


def replica_token() -> str | None:
    """`$TOKENYARD_REPLICA_TOKEN`, or None: what `tokenyard engine` requires of its callers."""
    return os.environ.get(REPLICA_TOKEN_ENV, "").strip() or None


#: The development key's file in the state directory.
DEV_KEY_FILE = "dev-key"


@dataclass(frozen=True)
class ServeConfig(Settings):
    """How `tokenyard serve`'s HTTP process (the gateway) runs: defaults < TOKENYARD_*
    environment < flags, read once at start and passed down."""

    #: The embedded default's SQLite file, the ledger journal and the development key.
    state_dir: Path = Path(".tokenyard")
    #: None: SQLite in `state_dir` (see `database`); PostgreSQL to share one store.
    database_url: str | None = None
    #: Shared limits and money holds across gateway processes; None: both in process.
    redis_url: str | None = None
    #: With Redis: seconds after a gateway process's last heartbeat that the money it
    #: holds for its requests in flight is let go (a crashed gateway's holds).
    money_hold_ttl_s: float = 30.0
    #: What this process sends to a replica given with `--replica-url`; a replica it starts
    #: itself gets this one too, else a fresh random one.
    replica_token: str | None = None
    #: The first admin key, from the operator (a Kubernetes Secret): installed as org
    #: "default"'s admin key on an empty database instead of a generated one, and never
    #: written to the state directory. None: generate one (kept in `dev_key_file`).
    admin_key: str | None = None
    key_cache_ttl_s: float = 1.0  # how long a key lookup (or a miss) is cached
    billing_refresh_s: float = 1.0  # age of an org's spending figures before a re-read
    prices_refresh_s: float = 10.0  # age of the price list before a re-read
    ledger_flush_interval_s: float = 0.05  # between the ledger writer's batch commits
    ledger_max_batch: int = 500  # usage rows per ledger transaction at most
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    replica_start_timeout_s: float = 600.0  # a first start converts the GGUF (tens of s)
    max_body_bytes: int = 4 * 2**20  # request bodies above this are refused with 413
    workers: int = 1  # HTTP worker processes on the one port (cli/workers.py)
    #: Failed authentications one client address may make per minute before every
    #: attempt from it is refused with 429 for the rest of the minute (0: no limit).
    auth_failures_per_minute: int = 60
    #: The edge (api/edge.py), per client address: open connections at most, and
    #: requests per second (a bucket one second deep); 0 turns either off.
    edge_connections_per_address: int = 512
    edge_requests_per_s: float = 500.0
    #: A request head must arrive whole within this many seconds of the connection
    #: opening or of its previous response (slowloris); also the idle keep-alive time.
    header_timeout_s: float = 60.0
    #: A request line or one header field longer than this is refused (400/431).
    max_header_bytes: int = 16 * 1024
    #: A stream whose client takes longer than this to accept one write (it stopped
    #: reading) is cut, so it frees its generation, its limits' slots and is billed.
    stream_write_timeout_s: float = 60.0
    #: HTTPS: the certificate chain and its private key (PEM); both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    responses_retention_days: float = 30.0  # how long a stored response is kept
    #: How long `GET /v1/requests/{id}` can find a request (its record is then purged).
    request_records_retention_hours: float = 24.0
    #: Between the purges of old request records and expired body captures.
    request_records_purge_interval_s: float = 300.0
    #: A captured body is cut (and marked truncated) above this many bytes.
    capture_max_bytes: int = 64 * 1024
    #: Extra regular expressions redacted from captured bodies (`--redact-pattern`).
    redact_patterns: tuple[str, ...] = ()
    #: A regional endpoint (`--region`): only this region's deployments are served, and
    #: an org bound to other regions reads its stored data elsewhere. None: every region.
    region: str | None = None
    #: The Batch API's lane (gateway/batches.py): lines one gateway process runs at
    #: once; how long a claimed line stays its worker's without a renewal; the estimated
    #: tokens an org's batches at work may hold (an org's own value, set through the
    #: admin API's limits, wins over this default). 128 lines, a replica's default
    #: `max_num_seqs`, fill its idle seats as the engine alone fills them: a live
    #: request's prompt still goes first, and it takes a batch line's seat or KV blocks
    #: when it needs them, since the scheduler preempts a lower class for a higher one.
    batch_concurrency: int = 128
    batch_lease_s: float = 60.0
    batch_enqueued_tokens: int = 20_000_000
    #: Background responses (gateway/background.py): how many one gateway process runs
    #: at once; how long a claimed one stays its worker's without a renewal.
    background_concurrency: int = 64
    background_lease_s: float = 30.0

    _ENV: ClassVar[dict[str, str]] = {
        "state_dir": "TOKENYARD_STATE_DIR",
        "database_url": "TOKENYARD_DATABASE_URL",
        "redis_url": "TOKENYARD_REDIS_URL",
        "money_hold_ttl_s": "TOKENYARD_MONEY_HOLD_TTL_S",
        "replica_token": REPLICA_TOKEN_ENV,
        "admin_key": "TOKENYARD_ADMIN_KEY",
        "key_cache_ttl_s": "TOKENYARD_KEY_CACHE_TTL_S",
        "billing_refresh_s": "TOKENYARD_BILLING_REFRESH_S",
        "prices_refresh_s": "TOKENYARD_PRICES_REFRESH_S",
        "ledger_flush_interval_s": "TOKENYARD_LEDGER_FLUSH_INTERVAL_S",
        "ledger_max_batch": "TOKENYARD_LEDGER_MAX_BATCH",
        "drain_timeout_s": "TOKENYARD_DRAIN_TIMEOUT_S",
        "replica_start_timeout_s": "TOKENYARD_REPLICA_START_TIMEOUT_S",
        "max_body_bytes": "TOKENYARD_MAX_BODY_BYTES",
        "workers": "TOKENYARD_WORKERS",
        "auth_failures_per_minute": "TOKENYARD_AUTH_FAILURES_PER_MINUTE",
        "edge_connections_per_address": "TOKENYARD_EDGE_CONNECTIONS_PER_ADDRESS",
        "edge_requests_per_s": "TOKENYARD_EDGE_REQUESTS_PER_S",
        "header_timeout_s": "TOKENYARD_HEADER_TIMEOUT_S",
        "max_header_bytes": "TOKENYARD_MAX_HEADER_BYTES",
        "stream_write_timeout_s": "TOKENYARD_STREAM_WRITE_TIMEOUT_S",
        "tls_cert": "TOKENYARD_TLS_CERT",
        "tls_key": "TOKENYARD_TLS_KEY",
        "responses_retention_days": "TOKENYARD_RESPONSES_RETENTION_DAYS",
        "request_records_retention_hours": "TOKENYARD_REQUEST_RECORDS_RETENTION_HOURS",
        "request_records_purge_interval_s": "TOKENYARD_REQUEST_RECORDS_PURGE_INTERVAL_S",
        "capture_max_bytes": "TOKENYARD_CAPTURE_MAX_BYTES",
        "region": "TOKENYARD_REGION",
        "batch_concurrency": "TOKENYARD_BATCH_CONCURRENCY",
        "batch_lease_s": "TOKENYARD_BATCH_LEASE_S",
        "batch_enqueued_tokens": "TOKENYARD_BATCH_ENQUEUED_TOKENS",
        "background_concurrency": "TOKENYARD_BACKGROUND_CONCURRENCY",
        "background_lease_s": "TOKENYARD_BACKGROUND_LEASE_S",
    }

    def validate(self) -> None:
        if min(self.key_cache_ttl_s, self.billing_refresh_s, self.prices_refresh_s,
               self.ledger_flush_interval_s, self.drain_timeout_s) < 0:
            raise ValueError("gateway intervals and timeouts must be >= 0")
        if self.money_hold_ttl_s <= 0:
            raise ValueError("money_hold_ttl_s must be > 0")
        if self.ledger_max_batch < 1:
            raise ValueError("ledger_max_batch must be positive")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if min(self.request_records_retention_hours,
               self.request_records_purge_interval_s) <= 0 or self.capture_max_bytes < 1:
            raise ValueError("request record retention, purge interval and capture size "
                             "must be positive")
        for pattern in self.redact_patterns:  # refused at start, not at the first capture
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"--redact-pattern {pattern!r}: {exc}") from None
        if self.workers < 1:
            raise ValueError("workers must be positive")
        if self.admin_key is not None and not re.fullmatch(r"sk-ty-[A-Za-z0-9_-]{32,}",
                                                           self.admin_key):
            raise ValueError("TOKENYARD_ADMIN_KEY: 'sk-ty-' and at least 32 url-safe "
                             "characters (python -c 'import secrets; print(\"sk-ty-\" + "
                             "secrets.token_urlsafe(32))')")
        if self.region is not None and not valid_region(self.region):
            raise ValueError(f"region {self.region!r}: lowercase letters, digits and "
                             "dashes (e.g. eu, us-east-1)")
        if not self.responses_retention_days > 0:
            raise ValueError("responses_retention_days must be positive")
        if min(self.edge_connections_per_address, self.edge_requests_per_s) < 0:
            raise ValueError("edge limits must be >= 0 (0: no limit)")
        if not self.header_timeout_s > 0 or self.max_header_bytes < 1024:
            raise ValueError("header_timeout_s must be positive and max_header_bytes >= 1024")
        if not self.stream_write_timeout_s > 0:
            raise ValueError("stream_write_timeout_s must be positive")
        if self.auth_failures_per_minute < 0:
            raise ValueError("auth_failures_per_minute must be >= 0")
        if (self.batch_concurrency < 1 or not self.batch_lease_s > 0
                or self.batch_enqueued_tokens < 0):
            raise ValueError("batch_concurrency and batch_lease_s must be positive, "
                             "batch_enqueued_tokens >= 0")
        if self.background_concurrency < 1 or not self.background_lease_s > 0:
            raise ValueError("background_concurrency and background_lease_s must be positive")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (TLS 1.2 or newer), or None to serve plain HTTP. Reads
        the files now, so a wrong path or a key that does not match fails at start."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS certificate {self.tls_cert} and key "
                             f"{self.tls_key}: {exc}") from exc
        return context

    @property
    def database(self) -> str:
        """The database URL: `database_url`, else the SQLite file in the state directory."""
        return self.database_url or f"sqlite+aiosqlite:///{self.state_dir / 'tokenyard.db'}"

    @property
    def journal_dir(self) -> Path:
        """Where the ledger writer journals settled usage before it is committed."""
        return self.state_dir / "journal"

    @property
    def dev_key_file(self) -> Path:
        """Where `serve` keeps the development key it created (mode 0600)."""
        return self.state_dir / DEV_KEY_FILE


def default_api_key() -> str | None:
    """`$TOKENYARD_API_KEY`, else the development key `tokenyard serve` keeps in the state
    directory (so `tokenyard chat` works beside `make serve` with no flags)."""
    env = os.environ.get("TOKENYARD_API_KEY", "").strip()
    if env:
        return env
    try:
        return ServeConfig.from_env().dev_key_file.read_text().strip() or None
    except OSError:
        return None

