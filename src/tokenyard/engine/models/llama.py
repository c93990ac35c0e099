"""One decoder for the Llama family: Llama 1-3 / SmolLM2, Mistral, Qwen2, Qwen3 and Phi-3.

The architectures differ only in switches carried by `ModelConfig`: q/k/v bias (Qwen2),
per-head q/k RMSNorm and a free head_dim (Qwen3), RoPE scaling (Llama 3.1, Phi-3's
LongRoPE), a sliding window on every layer (Mistral, Phi-3), RoPE over part of each head
(Phi-4-mini) and tied embeddings. The model works on a flat batch of tokens from many sequences; the
`AttentionBackend` passed to `forward` owns sequence boundaries and the KV cache.

For speed q/k/v live in one fused projection (`qkv_proj`) and gate/up in another
(`gate_up_proj`); `load_weights` accepts Hugging Face parameter names and copies each
piece into its slice (Phi-3's checkpoints hold the fused tensors already).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenyard.engine.attention_backend import AttentionBackend
from tokenyard.engine.kernels.blocks import BlockWeight
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.rope import apply_rope, rope_tables

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

if hasattr(F, "rms_norm"):

    def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

else:  # pragma: no cover - torch < 2.4

    def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return out if weight is None else out * weight


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by load_weights, and random
    # init of a 100M+ parameter model would cost seconds on a small CPU.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


#: Up to this many rows, a projection runs as a batched matmul over row slices of its
#: weight: MKL runs a small-M matmul on one core (about 11 GB/s of weights here), while a
#: bmm spreads the slices over the cores (1.4-3.7x faster for M = 1..64 on 2 cores:
#: `tokenyard bench micro`). Large prefill GEMMs are compute-bound and use F.linear.
SPLIT_MAX_ROWS = 256


def split_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T as `parts` slices of the weight's rows in one bmm."""
    rows, (out_features, in_features) = x.shape[0], weight.shape
    if parts < 2 or rows > SPLIT_MAX_ROWS or out_features % parts:
        return F.linear(x, weight)
    slices = weight.view(parts, out_features // parts, in_features)
    y = torch.bmm(slices, x.t().unsqueeze(0).expand(parts, in_features, rows))
    return y.permute(2, 0, 1).reshape(rows, out_features)


class ProjectionDelta(Protocol):
    """What a projection adds to its output for this step's rows (LoRA adapters:
    engine/lora/bank.py's LoraWeights). The one-op decode step (models/decode_step.py)
    reads the slots' stacked `a` [slots * w, in] and `bt` [slots * w, out], w = the
    projection's output slices * `max_rank`, and `ranks` [slots, slices] (int64), each
    slot's rank on each slice (0: none)."""

    a: torch.Tensor
    bt: torch.Tensor
    ranks: torch.Tensor
    max_rank: int

    @property
    def active(self) -> bool: ...

    def delta(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """Holds a [out, in] weight and optional [out] bias.

    `apply` is called directly (not through nn.Module.__call__, whose hooks cost a few
    microseconds per projection). With `packed` set (see models/quant.py) the projection
    runs as an fbgemm int8 dynamic-quantized matmul instead of float32; with `blocks` set
    it computes on Q8_0/Q4_1 blocks in place (kernels/blocks.py) and `weight` is empty.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.in_features, self.out_features = in_features, out_features
        self.packed: object | None = None
        self.blocks: BlockWeight | None = None
        self.parts = 1  # row slices for split_linear; set by LlamaForCausalLM.set_threads
        #: Resident LoRA adapters of this projection (engine/lora/bank.py), if any.
        self.lora: ProjectionDelta | None = None

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        if self.blocks is not None:
            y = self.blocks.matmul(x)
        elif self.packed is not None:  # the packed weight carries the bias
            y = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        else:
            y = split_linear(x, self.weight, self.parts)
        if self.bias is not None and self.packed is None:
            y = y.add_(self.bias)
        if self.lora is not None and self.lora.active:
            y = y.add_(self.lora.delta(x))
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_(x)


class _RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = _param(size)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused projections."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.intermediate_size = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.rotary_dim = config.rotary_dim or config.head_dim
        self.window = config.sliding_window
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim

        self.input_layernorm = _RMSNorm(config.hidden_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_proj_bias)
        # Qwen3: q_norm rows first, then k_norm rows, so one norm + multiply covers both.
        self.qk_norm_weight = (
            _param(self.num_heads + self.num_kv_heads, self.head_dim) if config.qk_norm else None
        )
        self.post_attention_layernorm = _RMSNorm(config.hidden_size)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Update the residual stream `x` [T, hidden] in place and return it.

        `cos`/`sin` are [T, 1, head_dim // 2] for this step's positions.
        """
        num_tokens = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim

        h = _rms_norm(x, self.input_layernorm.weight, self.eps)
        qkv = self.qkv_proj.apply_(h).view(num_tokens, hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]
        if self.qk_norm_weight is not None:
            qk = _rms_norm(qk, None, self.eps).mul_(self.qk_norm_weight)
        if self.rotary_dim == d:
            qk = apply_rope(qk, cos, sin)
        else:  # the dims past rotary_dim pass through unrotated
            qk = qk.contiguous()
            qk[..., : self.rotary_dim] = apply_rope(qk[..., : self.rotary_dim], cos, sin)
        attn = attention(self.index, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :],
                         window=self.window)
        x.add_(self.o_proj.apply_(attn.reshape(num_tokens, hq * d)))

        h = _rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        gate_up = self.gate_up_proj.apply_(h)
        act = F.silu(gate_up[:, : self.intermediate_size])
        act.mul_(gate_up[:, self.intermediate_size :])
        x.add_(self.down_proj.apply_(act))
        return x


class CausalLMHead(nn.Module):
    """The LM head and thread split both families share (Llama here, Gemma in gemma.py):
    a model class sets these attributes in its __init__."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor | None
    lm_head_blocks: Any
    lm_head_packed: Any
    parts: int

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states [N, hidden] to float32 logits [N, vocab]."""
        if self.lm_head_blocks is not None:
            return self.lm_head_blocks.matmul(hidden)
        if self.lm_head_packed is not None:
            return torch.ops.quantized.linear_dynamic(hidden, self.lm_head_packed, True).float()
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return split_linear(hidden, weight, self.parts).float()

    def set_threads(self, num_threads: int) -> None:
        """Slice small-batch projections over this many cores (CPU); 1 disables it."""
        self.parts = num_threads
        for module in self.modules():
            if isinstance(module, Linear):
                module.parts = num_threads


class LlamaForCausalLM(CausalLMHead):
    """Llama-family causal LM over a flat token batch.

    Parameters are float32 (torch's default dtype) and start uninitialised: call
    `load_weights` before use.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {config.architecture!r}; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size)
        self.lm_head = (
            None if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size)
        )
        if config.layer_types is not None:
            raise ValueError(f"{config.architecture}: per-layer attention types are not supported")
        rotary_dim = config.rotary_dim or config.head_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= config.head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim")
        cos, sin = rope_tables(
            rotary_dim,
            config.rope_theta,
            config.max_position_embeddings,
            config.rope_scaling,
        )
        # Buffers so `.to(device)` moves them; not persistent since they are derived.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.lm_head_packed: object | None = None  # int8 LM head (models/quant.py)
        # Block weights (models/quant.py): the embedding table (its rows are dequantized
        # as they are looked up) and the LM head (the same object when tied).
        self.embed_blocks: BlockWeight | None = None
        self.lm_head_blocks: BlockWeight | None = None
        self.parts = 1

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Run all layers on a flat batch.

        input_ids, positions: int64 [T] (tokens of all sequences concatenated; positions
        are each token's index within its own sequence, < max_position_embeddings).
        `attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])` is called once per
        layer after RoPE. Returns final-normed hidden states [T, hidden].
        """
        # One gather per step; every layer reuses it. unsqueeze broadcasts over heads.
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        if self.embed_blocks is not None:
            x = self.embed_blocks.embedding(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return _rms_norm(x, self.norm.weight, self.config.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Collection[str] = ()) -> None:
        """Copy Hugging Face-named tensors into this model (fusing q/k/v and gate/up).

        Accepts e.g. `model.layers.3.self_attn.k_proj.weight` [Hkv*D, hidden]. Tensors are
        cast to the parameter dtype. `lm_head.weight` is ignored when embeddings are tied
        and `rotary_emb.inv_freq` buffers of old checkpoints are skipped. Raises ValueError
        listing any unexpected, misshapen or missing names.
        """
        targets = self._weight_targets()
        loaded: set[str] = set()
        unexpected: list[str] = []
        bad_shapes: list[str] = []
        with torch.no_grad():
            for name, tensor in self._split_fused(weights):
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and self.lm_head is None:
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                dest, shape = target
                if tuple(tensor.shape) != shape:
                    bad_shapes.append(f"{name}: got {tuple(tensor.shape)}, expected {shape}")
                    continue
                dest.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(targets) - loaded - set(skip))  # skip: left uninitialized
        problems = []
        if unexpected:
            problems.append(f"unexpected weights: {_preview(unexpected)}")
        if bad_shapes:
            problems.append(f"wrong shapes: {_preview(bad_shapes)}")
        if missing:
            problems.append(f"missing weights: {_preview(missing)}")
        if problems:
            raise ValueError(
                f"cannot load {self.config.architecture} weights: " + "; ".join(problems)
            )

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Phi-3's fused `qkv_proj` / `gate_up_proj` tensors as the q/k/v and gate/up
        pieces other checkpoints hold (row views; the rest pass through)."""
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        pieces = {
            "self_attn.qkv_proj": (("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size),
                                   ("self_attn.v_proj", kv_size)),
            "mlp.gate_up_proj": (("mlp.gate_proj", cfg.intermediate_size),
                                 ("mlp.up_proj", cfg.intermediate_size)),
        }
        for name, tensor in weights:
            prefix, _, rest = name.rpartition(".layers.")
            index, _, part = rest.partition(".")
            module, _, kind = part.rpartition(".")
            split = pieces.get(module) if prefix else None
            total = None if split is None else sum(rows for _, rows in split)
            if split is None or tensor.shape[0] != total:
                yield name, tensor  # misshapen fused tensors are reported as unexpected
                continue
            start = 0
            for piece, rows in split:
                yield f"{prefix}.layers.{index}.{piece}.{kind}", tensor[start : start + rows]
                start += rows

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
        """HF name -> (destination view inside our parameters, expected source shape)."""
        cfg = self.config
        targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
            "model.embed_tokens.weight": (self.embed_tokens, tuple(self.embed_tokens.shape)),
            "model.norm.weight": (self.norm.weight, (cfg.hidden_size,)),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = (self.lm_head, tuple(self.lm_head.shape))
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        qkv_slices = {
            "q_proj": slice(0, q_size),
            "k_proj": slice(q_size, q_size + kv_size),
            "v_proj": slice(q_size + kv_size, q_size + 2 * kv_size),
        }
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            for proj, rows in qkv_slices.items():
                w = layer.qkv_proj.weight[rows]
                targets[f"{attn}{proj}.weight"] = (w, tuple(w.shape))
                if layer.qkv_proj.bias is not None:
                    b = layer.qkv_proj.bias[rows]
                    targets[f"{attn}{proj}.bias"] = (b, tuple(b.shape))
            targets[f"{attn}o_proj.weight"] = (
                layer.o_proj.weight,
                tuple(layer.o_proj.weight.shape),
            )
            if layer.o_proj.bias is not None:
                targets[f"{attn}o_proj.bias"] = (layer.o_proj.bias, (cfg.hidden_size,))
            if layer.qk_norm_weight is not None:
                # Each [D] norm weight broadcasts over the head rows it owns.
                nq = cfg.num_attention_heads
                targets[f"{attn}q_norm.weight"] = (layer.qk_norm_weight[:nq], (cfg.head_dim,))
                targets[f"{attn}k_norm.weight"] = (layer.qk_norm_weight[nq:], (cfg.head_dim,))
            mlp = prefix + "mlp."
            gate_up = layer.gate_up_proj.weight
            targets[f"{mlp}gate_proj.weight"] = (gate_up[:inter], (inter, cfg.hidden_size))
            targets[f"{mlp}up_proj.weight"] = (gate_up[inter:], (inter, cfg.hidden_size))
            targets[f"{mlp}down_proj.weight"] = (
                layer.down_proj.weight,
                tuple(layer.down_proj.weight.shape),
            )
            targets[f"{prefix}input_layernorm.weight"] = (
                layer.input_layernorm.weight,
                (cfg.hidden_size,),
            )
            targets[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight,
                (cfg.hidden_size,),
            )
        return targets


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"
