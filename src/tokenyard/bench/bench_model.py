"""A model of SmolLM2-1.7B's shape with random weights, for `tokenyard bench peers --model 1.7b`.

The embedded SmolLM2-135M in Q4_1 (~85 MB) fits in the L3 cache of many CPUs, so its decode
speed measures per-layer overheads more than the memory traffic that bounds the models people
run. This builds, once, into ``<cache>/peers/models/``:

1. a Hugging Face folder: a Llama model of SmolLM2-1.7B's published shape (`SMOLLM2_1_7B`),
   constructed by transformers from a hand-written config (no hub), its weights drawn from
   a normal of std 0.02 (transformers' own init for `initializer_range`), saved in bfloat16,
   with SmolLM2's tokenizer and chat template taken from the embedded model's GGUF;
2. a float16 GGUF, by llama.cpp's own ``convert_hf_to_gguf.py`` from the source tree that
   `llama_build` unpacks (its ``gguf-py`` on PYTHONPATH, not an installed package; beside
   it the pinned `sentencepiece`, which the converter imports before it looks for a
   tokenizer.model, installed into the cache, not into the project's environment);
3. the quantized GGUF, by the ``llama-quantize`` built beside ``llama-server``.

Each step is skipped when its output is already there. Random weights decode as fast as
trained ones (the same bytes pass through the same kernels); their text means nothing, so
the benchmark sends ``ignore_eos`` and counts tokens.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenyard.bench.llama_build import (
    llama_binary_path,
    llama_source_path,
    peers_dir,
    run_logged,
)

#: SmolLM2-1.7B's published shape (its config.json on the hub): Llama, 24 layers, hidden
#: 2048, 32 query and 32 key/value heads (no grouping), MLP 8192, vocabulary 49,152, tied
#: embeddings, RoPE theta 130,000, 8,192 positions.
SMOLLM2_1_7B: dict[str, Any] = {
    "vocab_size": 49_152, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 8192, "rope_theta": 130_000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": True, "initializer_range": 0.02,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
}
#: The quantizations `--model 1.7b[-TYPE]` builds (llama-quantize's type names).
QUANT_TYPES = ("Q4_1", "Q4_0", "Q8_0")
#: `--model 1.7b`'s type: the one tokenyard's kernels run byte for byte (a Q4_0 file becomes
#: Q4_1 on load, 20 bytes a block instead of 18), so both engines stream the same bytes.
DEFAULT_QUANT = "Q4_1"
NAME = "smollm2-1.7b-shape-random"
SENTENCEPIECE = "0.2.3"
#: What `tokenyard bench peers --model` accepts besides a GGUF path.
MODEL_CHOICES = ("embedded", "1.7b", *(f"1.7b-{q.lower()}" for q in QUANT_TYPES))


def model_quant(choice: str) -> str | None:
    """The quantization a `--model` choice builds (None: the embedded model or a path)."""
    if choice == "1.7b":
        return DEFAULT_QUANT
    if choice.startswith("1.7b-") and choice in MODEL_CHOICES:
        return choice.removeprefix("1.7b-").upper()
    return None


def parameter_count(shape: dict[str, Any]) -> int:
    """Weights of a Llama model of `shape` (embeddings once when tied)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    embed = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return layers * per_layer + embed + h


def model_dir(cache_dir: Path) -> Path:
    """Where the built model's folder and GGUF files live."""
    return peers_dir(cache_dir) / "models"


def gguf_path(cache_dir: Path, quant: str) -> Path:
    """The GGUF of type `quant` ("F16" or one of `QUANT_TYPES`)."""
    return model_dir(cache_dir) / f"{NAME}-{quant}.gguf"


def _tokenizer_source() -> Path:
    from tokenyard.text.model_files import embedded_model_path

    return embedded_model_path()


def build_hf_folder(folder: Path, seed: int = 0) -> None:
    """The bfloat16 Hugging Face folder: random weights of `SMOLLM2_1_7B`'s shape and the
    embedded model's tokenizer. Written under a temporary name, then renamed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    gguf = _tokenizer_source()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(partial)
    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_1_7B)
    # Built in bfloat16 from the start: 1.7B float32 weights would take 6.8 GB of memory.
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(partial)
    del model
    partial.replace(folder)


def _converter_deps(cache_dir: Path, log: Path) -> Path:
    """A folder holding the pinned `sentencepiece` (installed there once)."""
    folder = peers_dir(cache_dir) / f"convert-deps-sentencepiece-{SENTENCEPIECE}"
    if not (folder / "sentencepiece").exists():
        run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(folder), f"sentencepiece=={SENTENCEPIECE}"], log)
    return folder


def convert_to_gguf(folder: Path, out: Path, cache_dir: Path, log: Path) -> None:
    """llama.cpp's converter over `folder`, float16 weights, into `out`."""
    source = llama_source_path(cache_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(source / "gguf-py"), str(_converter_deps(cache_dir, log)), env.get("PYTHONPATH")]))
    partial = out.with_suffix(".partial")
    run_logged(["nice", "-n", "10", sys.executable, str(source / "convert_hf_to_gguf.py"),
                str(folder), "--outtype", "f16", "--outfile", str(partial)], log, env)
    partial.replace(out)


def ensure_bench_model(cache_dir: Path, quant: str = DEFAULT_QUANT,
                       say: Callable[[str], None] = print) -> Path:
    """The 1.7B GGUF of type `quant`, built first where it is not there (llama.cpp's tools
    must be: `llama_build.ensure_llama_server`)."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"quantization {quant!r}: one of {', '.join(QUANT_TYPES)}")
    target = gguf_path(cache_dir, quant)
    if target.exists():
        return target
    root = model_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    f16 = gguf_path(cache_dir, "F16")
    if not f16.exists():
        folder = root / f"{NAME}-hf"
        if not (folder / "config.json").exists():
            say(f"building the random {NAME} model (log {log})")
            build_hf_folder(folder)
        say("converting it to GGUF with llama.cpp's convert_hf_to_gguf.py")
        convert_to_gguf(folder, f16, cache_dir, log)
        shutil.rmtree(folder)  # 3.4 GB that the float16 GGUF holds as well
    say(f"quantizing it to {quant} with llama-quantize")
    partial = target.with_suffix(".partial")
    run_logged(["nice", "-n", "10", str(llama_binary_path(cache_dir, "llama-quantize")),
                str(f16), str(partial), quant], log)
    partial.replace(target)
    return target


def describe(path: Path, quant: str) -> str:
    """The section's line on the 1.7B model."""
    shape = SMOLLM2_1_7B
    return (f"{path.name}: SmolLM2-1.7B's shape ({parameter_count(shape):,} parameters: "
            f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, "
            f"MLP {shape['intermediate_size']}, vocabulary {shape['vocab_size']:,}, tied "
            f"embeddings), random weights (normal, std {shape['initializer_range']}), "
            f"SmolLM2's tokenizer; converted by llama.cpp's convert_hf_to_gguf.py, quantized "
            f"to {quant} by llama-quantize; {path.stat().st_size / 1e9:.2f} GB")
