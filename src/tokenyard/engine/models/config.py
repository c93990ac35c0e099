"""Model configuration shared by every architecture (models/families.py), and the error
of reading one from a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class GGUFError(ValueError):
    """The GGUF file is unreadable or describes a model we cannot run."""


@dataclass
class ModelConfig:
    """Shape and numerics of one decoder-only model.

    `architecture` names its family (models/families.py): "llama" (Llama 1-3, SmolLM2),
    "mistral", "qwen2", "qwen3", "phi3" (models/llama.py) or "gemma3" (models/gemma.py,
    which also reads the Gemma fields below).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    # RoPE rotates only the first `rotary_dim` dims of each head (Phi-4-mini's
    # partial_rotary_factor); None: the whole head.
    rotary_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    # Gemma 3: which layers attend over a sliding window ("sliding_attention") and which
    # over the whole context ("full_attention"); the window (keys with q_pos - k_pos <
    # sliding_window; Mistral and Phi-3 apply it on every layer, with no layer_types);
    # the RoPE base of the sliding layers (`rope_theta` and `rope_scaling`
    # are the full layers'); attention logits scaled by query_pre_attn_scalar ** -0.5.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
