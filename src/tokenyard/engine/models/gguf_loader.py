"""Read a llama.cpp GGUF file into a `ModelConfig` and float32 tensors with HF names.

Quantized tensors are dequantized with `gguf.quants.dequantize`. llama.cpp's converter
permutes the rows of q/k projections of llama-arch models (it uses the interleaved
"GPT-J" RoPE layout); `unpermute_qk` undoes that so the tensors match Hugging Face
checkpoints and our rotate-half RoPE.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tqdm import tqdm

from tokenyard.engine.models.config import GGUFError, ModelConfig
from tokenyard.engine.models.families import FAMILIES, GGUF_ARCHITECTURES, Family
from tokenyard.text.gguf_file import GGUFFile

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Tensors that carry no weights of their own; handled through the config instead.
_SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open `path` (text/gguf_file.py), turning failures into a GGUFError."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """Metadata `key` (scalar, string or list) or `default` if absent."""
    value = reader.fields.get(key)
    return default if value is None else value


def gguf_family(reader: GGUFFile) -> Family:
    """The family of the file's `general.architecture`; GGUFError if we run none."""
    gguf_arch = field_value(reader, "general.architecture")
    found = GGUF_ARCHITECTURES.get(gguf_arch)
    if found is None:
        raise GGUFError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return found


def gguf_hf_name(gguf_name: str, family: Family = FAMILIES["llama"]) -> str | None:
    """Map a GGUF tensor name to its Hugging Face name (None if not a model weight).

    e.g. `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; the layers'
    names are the `family`'s (Gemma 3 names its norms differently).
    """
    if gguf_name in _SKIPPED_TENSORS:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m:
        part = family.gguf_block_names.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def read_gguf_config(reader: GGUFFile, name: str = "model") -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (keys as llama.cpp writes them)."""
    family = gguf_family(reader)
    gguf_arch = field_value(reader, "general.architecture")  # its metadata keys' prefix

    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim and family.gguf_permuted_qk:
        raise GGUFError(f"partial rotary embeddings (rope dim {rope_dim} < {head_dim}) unsupported")
    # GGUF shapes are [in, out] (fastest dim first): ne[1] of the embedding is the vocab.
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > vocab_size:
        raise GGUFError(f"token list ({len(tokens)}) is longer than the embedding ({vocab_size})")

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = field_value(reader, f"tokenizer.ggml.{key}")
        if tid is not None and int(tid) not in eos_ids:
            eos_ids.append(int(tid))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")

    config = ModelConfig(
        architecture=family.name,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, gguf_arch, tensors),
        rotary_dim=None if rope_dim == head_dim else rope_dim,
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        name=name,
    )
    if family.gguf_config is not None:
        family.gguf_config(reader, config)
    return config


def _rope_scaling(reader: GGUFFile, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        return _longrope_scaling(reader, arch, long, short)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        # Llama 3.1 GGUFs store the per-frequency divisors as a tensor, not as metadata.
        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _longrope_scaling(reader: GGUFFile, arch: str, long: Any, short: Any) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp stores it: the two factor sets as tensors, the
    original context and the attention factor as metadata."""
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise GGUFError(f"LongRoPE factors without {arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "original_max_position_embeddings": int(original),
        "factor": int(field_value(reader, f"{arch}.context_length", original)) / int(original),
    }
    for key, tensor in (("long_factor", long), ("short_factor", short)):
        values = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        scaling[key] = [float(v) for v in values]
    attn_factor = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: [H*D, ...] interleaved -> rotate-half layout.

    Within each head llama.cpp stores row `2*j + t` for HF row `t*D/2 + j` (t in {0, 1});
    works for weights [H*D, in] and biases [H*D].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """Dequantize one `ReaderTensor` to a float32 torch tensor in torch shape order."""
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if qtype == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)  # copy out of the read-only mmap
    else:
        try:
            array = dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise GGUFError(f"{tensor.name}: cannot dequantize {qtype.name}") from exc
        array = np.asarray(array, dtype=np.float32)
    return torch.from_numpy(array.reshape(shape))


def iter_gguf_weights(
    reader: GGUFFile, config: ModelConfig, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every model weight in the file.

    q/k of llama/mistral are un-permuted, Gemma's norm scales made `w` again (its family
    says). Unknown tensor names raise GGUFError so a mis-mapped model fails loudly
    instead of loading with missing pieces.
    """
    family = gguf_family(reader)
    permuted = family.gguf_permuted_qk
    for tensor in tqdm(
        reader.tensors, desc="dequantizing", unit="tensor", disable=not show_progress
    ):
        if tensor.name in _SKIPPED_TENSORS:
            continue
        hf_name = gguf_hf_name(tensor.name, family)
        if hf_name is None:
            raise GGUFError(f"unknown GGUF tensor {tensor.name!r}")
        value = dequantize_tensor(tensor)
        if family.gguf_norm_offset and tensor.name.endswith("norm.weight"):
            # llama.cpp's converter stores e.g. Gemma's norm scales as 1 + w; HF keeps w.
            value = value - family.gguf_norm_offset
        if permuted and ".self_attn.q_proj." in hf_name:
            value = unpermute_qk(value, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in hf_name:
            value = unpermute_qk(value, config.num_key_value_heads)
        yield hf_name, value


#: GGUF block types the block-weight modes keep as they are (models/quant.py).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def iter_gguf_blocks(
    reader: GGUFFile, config: ModelConfig
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (HF name, type name, raw blocks uint8 [rows, bytes]) for every model weight
    stored as Q4_0, Q4_1 or Q8_0, undequantized (q/k rows un-permuted, as whole rows)."""
    family = gguf_family(reader)
    permuted = family.gguf_permuted_qk
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        hf_name = gguf_hf_name(tensor.name, family)
        if kind not in BLOCK_TYPES or hf_name is None:
            continue
        rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        if permuted and ".self_attn.q_proj." in hf_name:
            raw = unpermute_qk(raw, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in hf_name:
            raw = unpermute_qk(raw, config.num_key_value_heads)
        yield hf_name, kind, raw.contiguous()


#: Byte sizes of the fixed-size GGUF metadata value types.
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> type name ("Q4_1", "F32", ...), read from the file's header only.

    Milliseconds where `GGUFReader` takes seconds (it decodes every metadata value, the
    tokenizer's 49k strings included); used to pick the `auto` weight format. The header
    is walked in a memory map by offsets: a read call per value cost ~0.3 s here.
    Raises ValueError for a file that is not GGUF v2/v3.
    """
    with Path(path).open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file
            raise ValueError(f"{path} is not a GGUF v2/v3 file") from exc
    with buf:
        try:
            return _tensor_types(buf, str(path))
        except struct.error as exc:
            raise ValueError(f"{path}: GGUF header ends early") from exc


def _tensor_types(buf: mmap.mmap, path: str) -> dict[str, str]:
    u32, u64 = struct.Struct("<I"), struct.Struct("<Q")
    string, array = GGUFValueType.STRING, GGUFValueType.ARRAY
    sizes = {int(kind): size for kind, size in _SCALAR_SIZES.items()}

    def skip_value(kind: int, at: int) -> int:
        if kind == string:
            return at + 8 + u64.unpack_from(buf, at)[0]
        if kind == array:
            item, count = u32.unpack_from(buf, at)[0], u64.unpack_from(buf, at + 4)[0]
            at += 12
            if item in sizes:
                return at + count * sizes[item]
            for _ in range(count):
                at = skip_value(item, at)
            return at
        if kind not in sizes:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        return at + sizes[kind]

    if buf[:4] != b"GGUF" or u32.unpack_from(buf, 4)[0] not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    n_tensors, n_kv = u64.unpack_from(buf, 8)[0], u64.unpack_from(buf, 16)[0]
    at = 24
    for _ in range(n_kv):
        at += 8 + u64.unpack_from(buf, at)[0]  # the key
        at = skip_value(u32.unpack_from(buf, at)[0], at + 4)
    types: dict[str, str] = {}
    for _ in range(n_tensors):
        size = u64.unpack_from(buf, at)[0]
        name = buf[at + 8:at + 8 + size].decode("utf-8", errors="replace")
        at += 8 + size
        at += 4 + 8 * u32.unpack_from(buf, at)[0]  # the dimensions
        kind = u32.unpack_from(buf, at)[0]
        at += 4 + 8  # the type, the data offset
        if at > len(buf):
            raise ValueError(f"{path}: GGUF header ends early")
        try:
            types[name] = GGMLQuantizationType(kind).name
        except ValueError:
            types[name] = f"type {kind}"
    return types


def gguf_projection_type(path: str | Path) -> str | None:
    """The type most of the GGUF's decoder-layer matrices (`blk.N.*.weight`, not the
    norms) are stored as, e.g. "Q4_1" for the embedded SmolLM2; None if it has none."""
    counts: dict[str, int] = {}
    for name, kind in gguf_tensor_types(path).items():
        if name.startswith("blk.") and name.endswith(".weight") and "_norm" not in name:
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


def load_gguf(
    path: str | Path, show_progress: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and all weights (float32, HF names, contiguous) from a GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    config = read_gguf_config(reader, name=path.stem)
    weights = {
        name: value.contiguous() for name, value in iter_gguf_weights(reader, config, show_progress)
    }
    return config, weights
