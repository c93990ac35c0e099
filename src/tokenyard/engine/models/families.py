"""Every model family the engine runs, in one registry (`FAMILIES`).

A `Family` holds what the loaders and `loader.build_model` need to know of one
architecture, so that none of them branches on its name: the model class, how its config
is read from a GGUF file's metadata and from a Hugging Face `config.json`, and how
llama.cpp's tensors (names and values) map to Hugging Face's, which the model classes
load. Adding a family is one entry here (a variant the Llama module runs also goes into
`llama.SUPPORTED_ARCHITECTURES`, the configs that module was written for; the families'
unit test checks the two agree).

No family has a tokenizer or chat-template quirk: the tokenizer follows the file's own
`tokenizer.ggml.model` / `tokenizer.json`, and the chat template ships with the model, so
text/ (torch-free) keeps no table of families.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tokenyard.engine.models.config import GGUFError, ModelConfig
from tokenyard.engine.models.gemma import GemmaForCausalLM
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.text.gguf_file import GGUFFile

#: The model classes the families build; they share one interface (forward,
#: compute_logits, set_threads, load_weights, the block-weight attributes of
#: models/quant.py).
CausalLM = LlamaForCausalLM | GemmaForCausalLM

#: llama.cpp's per-layer tensor names (`blk.N.<key>`) -> Hugging Face's
#: (`model.layers.N.<value>`).
LLAMA_BLOCK_NAMES: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})

#: Gemma 3 norms a layer four times; llama.cpp's names for them differ from Llama's.
GEMMA3_BLOCK_NAMES: Mapping[str, str] = MappingProxyType({
    **LLAMA_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
})

#: Phi-3 keeps q/k/v in one tensor and gate/up in another (`ffn_up` holds both), in
#: llama.cpp as in Hugging Face; LlamaForCausalLM.load_weights splits them.
PHI3_BLOCK_NAMES: Mapping[str, str] = MappingProxyType({
    **LLAMA_BLOCK_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
})

#: Gemma 3 as llama.cpp runs it, where its GGUF metadata is silent: every 6th layer
#: attends globally, the sliding layers' RoPE base is 10,000.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _biases_if_configured(cfg: Mapping[str, Any]) -> tuple[bool, bool]:
    """Llama / Qwen3: `attention_bias` covers q/k/v and o."""
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias


def _qkv_bias_only(cfg: Mapping[str, Any]) -> tuple[bool, bool]:
    """Qwen2: q/k/v always have a bias, o_proj never."""
    return True, False


def _no_biases(cfg: Mapping[str, Any]) -> tuple[bool, bool]:
    """Mistral: no bias anywhere, whatever the config says."""
    return False, False


@dataclass(frozen=True)
class Family:
    """One architecture: `name` is `ModelConfig.architecture`."""

    name: str
    #: Builds the (uninitialised) model for a config of this family.
    model: Callable[[ModelConfig], CausalLM]
    #: Its GGUF `general.architecture` (also the prefix of its metadata keys); None: not
    #: loadable from a GGUF file.
    gguf_architecture: str | None
    #: Its Hugging Face `config.json` `model_type`; None: not loadable from a folder.
    hf_model_type: str | None
    #: llama.cpp's per-layer tensor names -> Hugging Face's.
    gguf_block_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_BLOCK_NAMES)
    #: llama.cpp's converter permuted the q/k rows (the interleaved "GPT-J" RoPE layout of
    #: llama-arch models; NEOX-RoPE ones such as Qwen are stored as they are).
    gguf_permuted_qk: bool = False
    #: llama.cpp stores the norm scales as `offset + w` where Hugging Face keeps `w`.
    gguf_norm_offset: float = 0.0
    #: Fills the family's own `ModelConfig` fields from the GGUF metadata (after the
    #: common ones); raises GGUFError for what the model cannot run.
    gguf_config: Callable[[GGUFFile, ModelConfig], None] | None = None
    #: (q/k/v bias, o_proj bias) from a Hugging Face config.
    hf_attention_biases: Callable[[Mapping[str, Any]], tuple[bool, bool]] = (
        _biases_if_configured)
    #: Per-head q/k RMSNorm, as a Hugging Face config implies it (a GGUF file shows it
    #: by its tensors).
    hf_qk_norm: bool = False


def _gemma3_gguf_config(reader: GGUFFile, config: ModelConfig) -> None:
    """Gemma 3's sliding-window layers, local RoPE base and attention scale from the
    metadata, with llama.cpp's defaults."""
    fields = reader.fields
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields.get(f"gemma3.{key}") is not None:
            raise GGUFError(f"gemma3.{key} (logit soft-capping) is not supported")
    window = fields.get("gemma3.attention.sliding_window")
    config.sliding_window = None if window is None else int(window)
    pattern = fields.get("gemma3.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    layers = config.num_hidden_layers
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise GGUFError(f"sliding_window_pattern has {len(sliding)} layers, expected {layers}")
    if config.sliding_window is None:
        sliding = [False] * layers
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    config.rope_local_theta = float(
        fields.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    # llama.cpp's rule (the GGUF has no query_pre_attn_scalar): head_dim, except the 27B
    # model (62 layers), which scales by hidden / heads.
    scalar = config.head_dim
    if layers == 62:
        scalar = config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = float(scalar)


def _window_gguf_config(reader: GGUFFile, config: ModelConfig) -> None:
    """Mistral / Phi-3: one sliding window on every layer, where the metadata has one."""
    arch = reader.fields.get("general.architecture")
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    config.sliding_window = None if window is None else int(window)


#: Architecture name -> its family.
FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("llama", LlamaForCausalLM, "llama", "llama", gguf_permuted_qk=True),
    Family("mistral", LlamaForCausalLM, "mistral", "mistral", gguf_permuted_qk=True,
           hf_attention_biases=_no_biases, gguf_config=_window_gguf_config),
    Family("qwen2", LlamaForCausalLM, "qwen2", "qwen2", hf_attention_biases=_qkv_bias_only),
    Family("qwen3", LlamaForCausalLM, "qwen3", "qwen3", hf_qk_norm=True),
    Family("phi3", LlamaForCausalLM, "phi3", "phi3", gguf_block_names=PHI3_BLOCK_NAMES,
           gguf_config=_window_gguf_config, hf_attention_biases=_no_biases),
    Family("gemma3", GemmaForCausalLM, "gemma3", None, gguf_block_names=GEMMA3_BLOCK_NAMES,
           gguf_norm_offset=1.0, gguf_config=_gemma3_gguf_config),
)}

#: GGUF `general.architecture` -> the family the GGUF loader reads it as.
GGUF_ARCHITECTURES: dict[str, Family] = {
    f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture is not None}
#: Hugging Face `model_type` -> the family the folder loader reads it as.
HF_MODEL_TYPES: dict[str, Family] = {
    f.hf_model_type: f for f in FAMILIES.values() if f.hf_model_type is not None}


def family(architecture: str) -> Family:
    """The family of `architecture` (a `ModelConfig.architecture`); ValueError naming
    the supported ones if there is none."""
    found = FAMILIES.get(architecture)
    if found is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(FAMILIES)}")
    return found
