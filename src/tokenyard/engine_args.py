"""The engine's command-line flags (`generate`, `engine`, `serve`, `bench offline`) and
their values as `EngineConfig` keyword arguments."""

from __future__ import annotations

import argparse
from typing import Any

from tokenyard.config import KV_CACHE_DTYPES, WEIGHT_FORMATS, parse_on_off


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (`generate`, `engine`, `serve`, `bench offline`)."""
    parser.add_argument("--model", help="GGUF file or Hugging Face folder (default: embedded)")
    parser.add_argument("--weights", choices=list(WEIGHT_FORMATS),
                        help="weight format (default auto: q4_1 for a Q4_0/Q4_1 GGUF on "
                        "the CPU, else float32); CPU only: q8_0 / q4_1 keep blocks of 32 "
                        "quantized (q4_1: the GGUF's own blocks), int8 is fbgemm's")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--kv-cache-gib", type=float, help="KV cache pool size in GiB")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                        help="the KV pool's element type (default auto: the model's; "
                        "float16 halves the pool's bytes a token)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    parser.add_argument("--prefill-chunk", type=int,
                        help="prefill tokens per step while other requests decode")
    parser.add_argument("--max-num-seqs", type=int, help="running requests at once")
    parser.add_argument("--max-waiting-requests", type=int,
                        help="waiting-queue bound; past it requests are shed (503)")
    parser.add_argument("--threads", type=int, dest="num_threads", help="torch threads")
    parser.add_argument("--async-scheduling", type=parse_on_off, metavar="on|off",
                        help="plan each step while the one before computes (default off)")
    parser.add_argument("--cuda-graphs", type=parse_on_off, metavar="on|off",
                        help="CUDA: replay decode steps from CUDA graphs (default off)")
    parser.add_argument("--stream-interval-ms", type=float, metavar="MS",
                        help="hand a step's outputs to the HTTP side at most this often, "
                             "first tokens and finishes at once (default 1; 0: every step)")
    parser.add_argument("--speculative-config", metavar="JSON", help="speculative "
                        'decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": '
                        '4} or {"method": "draft_model", "model": "<gguf, folder or name>", '
                        '"num_speculative_tokens": 4} (the draft shares the tokenizer)')
    parser.add_argument("--lora-modules", metavar="NAME=PATH[,NAME=PATH]",
                        help="PEFT LoRA adapters to serve over the model; a request picks "
                        "one with the model name MODEL:NAME")
    parser.add_argument("--max-loras", type=int,
                        help="LoRA adapters resident at once (default 4; least recently "
                        "used out)")
    parser.add_argument("--max-lora-rank", type=int,
                        help="the largest adapter rank served (default 16)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as `EngineConfig` keyword arguments."""
    names = ["model", "weights", "device", "kv_cache_gib", "kv_cache_dtype",
             "max_num_batched_tokens",
             "prefill_chunk", "max_num_seqs", "max_waiting_requests", "num_threads",
             "async_scheduling", "stream_interval_ms", "cuda_graphs", "speculative_config",
             "lora_modules", "max_loras", "max_lora_rank"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
