"""Model configuration shared by every Llama-family architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Shape and numerics of one Llama-family model.

    `architecture` is one of "llama" (Llama 1-3, SmolLM2), "mistral", "qwen2", "qwen3".
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
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
