"""Gemma 3 (text): the second model family beside models/llama.py.

What differs from Llama, all read from `ModelConfig`:
- RMSNorm scales are `1 + w` (stored here already added, so a norm is one multiply);
- the embedding is scaled by sqrt(hidden) on the way in (not on the tied LM head);
- four norms a layer: before and after attention, before and after the MLP;
- per-head q/k RMSNorm, and attention logits scaled by query_pre_attn_scalar ** -0.5
  (folded into the q norm's scale: the attention backends scale by head_dim ** -0.5);
- GeGLU (gelu, tanh approximation) instead of SwiGLU;
- "sliding_attention" layers see only the last `sliding_window` keys and use their own
  RoPE base (`rope_local_theta`); "full_attention" layers see everything, with
  `rope_theta` / `rope_scaling`. The window is passed to the attention backend, so the
  paged KV cache, the scheduler and prefix reuse work as they do for Llama.

Projections reuse llama.Linear (fused q/k/v and gate/up, the same Hugging Face names).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenyard.engine.attention_backend import AttentionBackend
from tokenyard.engine.kernels.blocks import BlockWeight
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.llama import (
    CausalLMHead,
    Linear,
    _param,
    _preview,
    _rms_norm,
)
from tokenyard.engine.models.rope import apply_rope, rope_tables

SLIDING = "sliding_attention"
FULL = "full_attention"

#: Gemma's per-layer norms, by Hugging Face name (each holds `w`; we keep `1 + w`).
_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-normed attention (local or global) + GeGLU MLP block."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.intermediate_size = config.intermediate_size
        self.eps = config.rms_norm_eps
        kind = (config.layer_types or [FULL] * config.num_hidden_layers)[index]
        if kind not in (SLIDING, FULL):
            raise ValueError(f"layer {index}: unknown Gemma layer type {kind!r}")
        self.sliding = kind == SLIDING
        self.window = config.sliding_window if self.sliding else None
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.input_layernorm = _param(hidden)
        self.post_attention_layernorm = _param(hidden)
        self.pre_feedforward_layernorm = _param(hidden)
        self.post_feedforward_layernorm = _param(hidden)
        self.qkv_proj = Linear(hidden, q_size + 2 * kv_size, False)
        self.o_proj = Linear(q_size, hidden, False)
        # q norm rows first, then k norm rows: one norm + multiply covers both.
        self.qk_norm_weight = _param(self.num_heads + self.num_kv_heads, self.head_dim)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, False)
        self.down_proj = Linear(config.intermediate_size, hidden, False)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Update the residual stream `x` [T, hidden] in place and return it.

        `rope[sliding]` is this layer kind's (cos, sin), each [T, 1, head_dim // 2].
        """
        num_tokens = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope[self.sliding]

        h = _rms_norm(x, self.input_layernorm, self.eps)
        qkv = self.qkv_proj.apply_(h).view(num_tokens, hq + 2 * hkv, d)
        qk = _rms_norm(qkv[:, : hq + hkv], None, self.eps).mul_(self.qk_norm_weight)
        qk = apply_rope(qk, cos, sin)
        attn = attention(self.index, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :],
                         window=self.window)
        out = self.o_proj.apply_(attn.reshape(num_tokens, hq * d))
        x.add_(_rms_norm(out, self.post_attention_layernorm, self.eps))

        h = _rms_norm(x, self.pre_feedforward_layernorm, self.eps)
        gate_up = self.gate_up_proj.apply_(h)
        act = F.gelu(gate_up[:, : self.intermediate_size], approximate="tanh")
        act.mul_(gate_up[:, self.intermediate_size :])
        out = self.down_proj.apply_(act)
        x.add_(_rms_norm(out, self.post_feedforward_layernorm, self.eps))
        return x


class GemmaForCausalLM(CausalLMHead):
    """Gemma 3 causal LM over a flat token batch; the same interface as LlamaForCausalLM.

    Parameters are float32 and start uninitialised: call `load_weights` before use.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture != "gemma3":
            raise ValueError(f"GemmaForCausalLM runs gemma3, not {config.architecture!r}")
        if config.rope_local_theta is None or config.query_pre_attn_scalar is None:
            raise ValueError("a gemma3 config needs rope_local_theta and query_pre_attn_scalar")
        if any(t == SLIDING for t in config.layer_types or []) and not config.sliding_window:
            raise ValueError("gemma3 sliding_attention layers need a sliding_window")
        self.config = config
        self.embed_scale = math.sqrt(config.hidden_size)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _param(config.hidden_size)
        self.lm_head = (
            None if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size)
        )
        max_pos = config.max_position_embeddings
        cos, sin = rope_tables(config.head_dim, config.rope_theta, max_pos, config.rope_scaling)
        local_cos, local_sin = rope_tables(config.head_dim, config.rope_local_theta, max_pos)
        for name, table in (("rope_cos", cos), ("rope_sin", sin),
                            ("rope_local_cos", local_cos), ("rope_local_sin", local_sin)):
            self.register_buffer(name, table, persistent=False)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.rope_local_cos: torch.Tensor
        self.rope_local_sin: torch.Tensor
        # The weight formats of models/quant.py set these, as on LlamaForCausalLM.
        self.lm_head_packed: object | None = None
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
        """Run all layers on a flat batch (see LlamaForCausalLM.forward); sliding layers
        call `attention(layer, q, k, v, window=sliding_window)`, full ones window=None."""
        rope = {
            False: (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)),
            True: (self.rope_local_cos[positions].unsqueeze(1),
                   self.rope_local_sin[positions].unsqueeze(1)),
        }
        if self.embed_blocks is not None:
            x = self.embed_blocks.embedding(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        # HF rounds the scale to the weights' dtype first (sqrt(640) in float32 here).
        x.mul_(torch.tensor(self.embed_scale, dtype=x.dtype))
        for layer in self.layers:
            x = layer(x, rope, attention)
        return _rms_norm(x, self.norm, self.config.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Collection[str] = ()) -> None:
        """Copy Hugging Face-named Gemma 3 tensors in (fusing q/k/v and gate/up; norm
        scales become 1 + w). Raises ValueError listing unexpected, misshapen or missing
        names."""
        targets = self._weight_targets()
        # The q norm also carries the attention scale: the backends multiply q k^T by
        # head_dim ** -0.5, Gemma by query_pre_attn_scalar ** -0.5.
        assert self.config.query_pre_attn_scalar is not None
        q_scale = math.sqrt(self.config.head_dim / self.config.query_pre_attn_scalar)
        loaded: set[str] = set()
        unexpected: list[str] = []
        bad_shapes: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and self.lm_head is None
                ):
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                dest, shape = target
                if tuple(tensor.shape) != shape:
                    bad_shapes.append(f"{name}: got {tuple(tensor.shape)}, expected {shape}")
                    continue
                if name.endswith("norm.weight"):
                    tensor = tensor.float() + 1.0
                    if name.endswith("q_norm.weight"):
                        tensor = tensor * q_scale
                dest.copy_(tensor)
                loaded.add(name)
        problems = []
        if unexpected:
            problems.append(f"unexpected weights: {_preview(unexpected)}")
        if bad_shapes:
            problems.append(f"wrong shapes: {_preview(bad_shapes)}")
        missing = sorted(set(targets) - loaded - set(skip))  # skip: left uninitialized
        if missing:
            problems.append(f"missing weights: {_preview(missing)}")
        if problems:
            raise ValueError("cannot load gemma3 weights: " + "; ".join(problems))

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
        """HF name -> (destination view inside our parameters, expected source shape)."""
        cfg = self.config
        hidden = cfg.hidden_size
        targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
            "model.embed_tokens.weight": (self.embed_tokens, tuple(self.embed_tokens.shape)),
            "model.norm.weight": (self.norm, (hidden,)),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = (self.lm_head, tuple(self.lm_head.shape))
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        rows = {
            "q_proj": slice(0, q_size),
            "k_proj": slice(q_size, q_size + kv_size),
            "v_proj": slice(q_size + kv_size, q_size + 2 * kv_size),
        }
        inter = cfg.intermediate_size
        nq = cfg.num_attention_heads
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, GemmaDecoderLayer)
            attn = f"model.layers.{i}.self_attn."
            for proj, sl in rows.items():
                w = layer.qkv_proj.weight[sl]
                targets[f"{attn}{proj}.weight"] = (w, tuple(w.shape))
            targets[f"{attn}o_proj.weight"] = (layer.o_proj.weight, (hidden, q_size))
            # Each [D] norm weight broadcasts over the head rows it owns.
            targets[f"{attn}q_norm.weight"] = (layer.qk_norm_weight[:nq], (cfg.head_dim,))
            targets[f"{attn}k_norm.weight"] = (layer.qk_norm_weight[nq:], (cfg.head_dim,))
            mlp = f"model.layers.{i}.mlp."
            gate_up = layer.gate_up_proj.weight
            targets[f"{mlp}gate_proj.weight"] = (gate_up[:inter], (inter, hidden))
            targets[f"{mlp}up_proj.weight"] = (gate_up[inter:], (inter, hidden))
            targets[f"{mlp}down_proj.weight"] = (layer.down_proj.weight, (hidden, inter))
            for norm in _LAYER_NORMS:
                targets[f"model.layers.{i}.{norm}.weight"] = (getattr(layer, norm), (hidden,))
        return targets
