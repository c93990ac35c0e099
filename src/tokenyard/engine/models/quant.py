"""CPU weight formats other than float32: block weights computed in place, and fbgemm int8.

`q8_0` and `q4_1` (see kernels/blocks.py for the formats) keep every projection and the
embedding / LM head as blocks of 32 with their own scales, multiplied by the C++ kernel
with activations quantized per block of 32 too: no float32 copy stays behind.

- `q8_0`: every matrix quantized to Q8_0 (8.5 bits a weight) from its float32 values;
- `q4_1`: the GGUF's own blocks where it has them (Q4_1 and Q8_0 byte for byte, Q4_0 as
  Q4_1 without loss); other GGUF tensors (F16/F32, K-quants) become Q8_0; a float
  checkpoint (a Hugging Face folder) gets Q4_1 projections and a Q8_0 embedding.

`int8` is fbgemm dynamic quantization: per output channel weights and activations
quantized per tensor by fbgemm itself, which SmolLM2's outlier channels break.

`auto` (the default, `resolve_weights`) serves a GGUF whose projections are stored as
Q4_0 / Q4_1 with `q4_1` on the CPU: its own blocks, nothing requantized, within 0.04 % of
float32's top-1 tokens and about 3x faster to decode; everything else stays float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenyard.engine.kernels import unavailable_reason
from tokenyard.engine.kernels.blocks import Q4_1, Q8_0, BlockWeight, kernel_available, q4_0_to_q4_1
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.gemma import GemmaDecoderLayer
from tokenyard.engine.models.gguf_loader import gguf_projection_type
from tokenyard.engine.models.llama import Linear, LlamaDecoderLayer
from tokenyard.engine.models.loader import CausalLM, LoadedModel, load_gguf_blocks

log = logging.getLogger(__name__)

BLOCK_FORMATS = ("q8_0", "q4_1")

#: Fused projection -> the Hugging Face pieces stacked in its rows, in order.
_FUSED = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


#: GGUF projection types `auto` serves as q4_1 (Q4_0 converts to Q4_1 without loss).
AUTO_Q4_TYPES = ("Q4_0", "Q4_1")


def resolve_weights(requested: str, source: Path, device: torch.device) -> str:
    """The weight format a replica serves for `--weights requested`.

    `auto`: q4_1 on the CPU for a GGUF whose decoder matrices are mostly Q4_0 / Q4_1,
    float32 for anything else (a Hugging Face folder, F16/F32/Q8_0/K-quant GGUFs, CUDA,
    which runs bf16 either way). A block format without the quant_matmul kernel (no
    compiler, a build error, TOKENYARD_DISABLE_KERNELS=1) falls back to float32, logged.
    """
    weights = requested
    if requested == "auto":
        if device.type != "cpu" or source.is_dir():
            return "float32"
        try:
            kind = gguf_projection_type(source)
        except (OSError, ValueError) as exc:
            log.warning("--weights auto: cannot read %s's tensor types (%s); using float32",
                        source, exc)
            return "float32"
        if kind not in AUTO_Q4_TYPES:
            return "float32"
        weights = "q4_1"
    if weights in BLOCK_FORMATS and not kernel_available():
        log.warning("--weights %s needs the quant_matmul kernel (%s); keeping float32 weights",
                    requested, unavailable_reason("quant_matmul"))
        return "float32"
    return weights


def convert_weights(model: CausalLM, loaded: LoadedModel, weights: str,
                    native: dict[str, tuple[str, torch.Tensor]] | None = None) -> CausalLM:
    """Switch `model` (float32, on the CPU) to the `weights` format, in place. `native`:
    `loaded`'s GGUF blocks when the caller read them already (load_gguf_blocks).

    Block formats need the C++ kernel: without it (no compiler, a build error,
    TOKENYARD_DISABLE_KERNELS=1) the model stays float32 and the reason is logged.
    """
    if weights == "int8":
        return quantize_int8(model)
    if weights not in BLOCK_FORMATS:
        return model
    if not kernel_available():
        log.warning("--weights %s needs the quant_matmul kernel (%s); keeping float32 weights",
                    weights, unavailable_reason("quant_matmul"))
        return model
    if native is None:
        native = load_gguf_blocks(loaded) if weights == "q4_1" else {}
    from_gguf = not loaded.source.is_dir()
    return quantize_blocks(model, weights, native, from_gguf)


def quantize_blocks(
    model: CausalLM,
    weights: str,
    native: dict[str, tuple[str, torch.Tensor]] | None = None,
    from_gguf: bool = True,
) -> CausalLM:
    """Replace every projection, the embedding and the LM head by block weights, in place.

    `native`: GGUF blocks by HF name (loader.load_gguf_blocks) used as they are where a
    fused projection's pieces all have one kept type; everything else is quantized from
    the model's float32 values (Q8_0; Q4_1 projections for `q4_1` of a float checkpoint).
    The float32 tensors are released.
    """
    native = native or {}
    fallback = Q8_0 if weights == "q8_0" or from_gguf else Q4_1
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer | GemmaDecoderLayer)  # same projections
        prefix = f"model.layers.{layer.index}."
        for attr, pieces in _FUSED.items():
            linear = getattr(layer, attr)
            assert isinstance(linear, Linear)
            names = [f"{prefix}{piece}.weight" for piece in pieces]
            linear.blocks = _native(native, names, linear.weight.shape[1]) or BlockWeight.quantize(
                linear.weight, fallback
            )
            linear.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    embed = _native(native, ["model.embed_tokens.weight"], model.embed_tokens.shape[1])
    model.embed_blocks = embed or BlockWeight.quantize(model.embed_tokens, Q8_0)
    model.embed_tokens = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    if model.lm_head is None:
        model.lm_head_blocks = model.embed_blocks
    else:
        head = _native(native, ["lm_head.weight"], model.lm_head.shape[1])
        model.lm_head_blocks = head or BlockWeight.quantize(model.lm_head, Q8_0)
        model.lm_head = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return model


def _native(
    native: dict[str, tuple[str, torch.Tensor]], names: list[str], in_features: int
) -> BlockWeight | None:
    """The GGUF blocks of `names` stacked by rows, when all are there in one kept type."""
    kind = _native_kind(native, names)
    if kind is None:
        return None
    raws = [native[name][1] for name in names]
    if kind == "Q4_0":
        raws, kind = [q4_0_to_q4_1(raw) for raw in raws], "Q4_1"
    return BlockWeight(torch.cat(raws) if len(raws) > 1 else raws[0], _QTYPES[kind],
                       in_features)


#: The block types a projection is served in as the GGUF holds it (Q4_0 becomes Q4_1).
_QTYPES = {"Q8_0": Q8_0, "Q4_1": Q4_1, "Q4_0": Q4_1}


def _native_kind(native: dict[str, tuple[str, torch.Tensor]], names: list[str]) -> str | None:
    """The one kept GGUF type that every one of `names` has in `native`, else None."""
    kinds = {native[name][0] if name in native else None for name in names}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in _QTYPES else None


def native_names(native: dict[str, tuple[str, torch.Tensor]], config: ModelConfig) -> set[str]:
    """The float weights `quantize_blocks` will not read for a model of `config`: those
    of every projection, the embedding and the LM head that it takes from `native` as
    they are. The model need not hold their float32 values (frontend.py skips them: a
    full float32 copy of SmolLM2-135M is ~540 MB of page faults at every start)."""
    groups = [[f"model.layers.{i}.{piece}.weight" for piece in pieces]
              for i in range(config.num_hidden_layers) for pieces in _FUSED.values()]
    groups += [["model.embed_tokens.weight"], ["lm_head.weight"]]
    return {name for names in groups if _native_kind(native, names) for name in names}


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> object:
    """fbgemm packed params for a [out, in] float weight, quantized per output channel."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
    b = None if bias is None else bias.detach().float().contiguous()
    return torch.ops.quantized.linear_prepack(qweight, b)


def quantize_int8(model: CausalLM) -> CausalLM:
    """Switch every projection and the LM head of `model` to int8, in place.

    The float32 projection weights are released (the embedding table is kept).
    """
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 weights need torch's fbgemm backend (x86 CPUs)")
    torch.backends.quantized.engine = "fbgemm"
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            module.packed = pack_int8(module.weight, module.bias)
            module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            module.bias = None
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head_packed = pack_int8(head, None)
    return model
