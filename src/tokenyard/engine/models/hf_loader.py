"""Read a local Hugging Face model folder (config.json + *.safetensors) into float32 tensors.

Handles both config dialects: transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters` holding theta and the scaling type).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.families import HF_MODEL_TYPES


class HFModelError(ValueError):
    """The folder is not a loadable Hugging Face checkpoint."""


def read_json_object(path: Path, error: type[ValueError] = HFModelError) -> dict[str, Any]:
    """The JSON object in `path`; `error` when it cannot be read or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path} does not hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config dialect."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items()
                   if k not in ("rope_theta", "partial_rotary_factor")}
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        elif scaling["rope_type"] in ("longrope", "su"):  # "su": Phi-3's first name for it
            scaling["rope_type"] = "longrope"
            # Phi-3 keeps the original context beside the scaling, and the attention
            # factor follows from how far the context was stretched.
            original = int(scaling.get("original_max_position_embeddings")
                           or cfg["original_max_position_embeddings"])
            scaling["original_max_position_embeddings"] = original
            scaling.setdefault(
                "factor", int(cfg.get("max_position_embeddings", original)) / original)
    return float(theta if theta is not None else 10000.0), scaling


def _rotary_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """The dims of each head RoPE rotates (Phi-4-mini's partial_rotary_factor); None: all."""
    params = cfg.get("rope_parameters")
    factor = cfg.get("partial_rotary_factor")
    if factor is None and isinstance(params, dict):
        factor = params.get("partial_rotary_factor")
    if factor is None or float(factor) == 1.0:
        return None
    return int(head_dim * float(factor))


def _sliding_window(folder: Path, cfg: dict[str, Any]) -> int | None:
    """Mistral's and Phi-3's window over every layer. Qwen2/3 name one too but apply it
    only with `use_sliding_window`, to some layers: not supported."""
    if cfg.get("use_sliding_window"):
        raise HFModelError(f"{folder}: use_sliding_window=true is not supported")
    if "use_sliding_window" in cfg:
        return None
    window = cfg.get("sliding_window")
    return None if window is None else int(window)


def read_hf_config(folder: str | Path) -> ModelConfig:
    """Build a ModelConfig from `folder/config.json` (+ generation_config.json eos ids)."""
    folder = Path(folder)
    cfg = read_json_object(folder / "config.json")
    model_type = cfg.get("model_type")
    family = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise HFModelError(
            f"{folder}: unsupported model_type {model_type!r}; "
            f"supported: {tuple(HF_MODEL_TYPES)}"
        )
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    theta, scaling = _rope_settings(cfg)

    eos_ids = _as_id_list(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        for tid in _as_id_list(read_json_object(gen_path).get("eos_token_id")):
            if tid not in eos_ids:
                eos_ids.append(tid)

    # Bias conventions differ per family (its `hf_attention_biases`).
    qkv_bias, o_bias = family.hf_attention_biases(cfg)
    if cfg.get("mlp_bias"):
        raise HFModelError(f"{folder}: mlp_bias=true is not supported")

    bos = cfg.get("bos_token_id")
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        qk_norm=family.hf_qk_norm,
        rotary_dim=_rotary_dim(cfg, int(head_dim)),
        sliding_window=_sliding_window(folder, cfg),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        name=folder.name,
    )


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's safetensors files; HFModelError if there are none.

    Prefers `model.safetensors.index.json` (sharded) and `model.safetensors`, because some
    repositories also ship other formats, e.g. Mistral's `consolidated.safetensors`.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFModelError(f"{folder}: shards listed in {index.name} are missing: {missing}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFModelError(f"{folder}: no *.safetensors files (PyTorch .bin is not supported)")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Load every tensor of `files` as float32 (bf16/f16 checkpoints are upcast)."""
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                weights[name] = tensor if tensor.dtype == torch.float32 else tensor.float()
    return weights


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and float32 weights (HF names) from a Hugging Face model folder.

    If the checkpoint has no `lm_head.weight` the embeddings are treated as tied, whatever
    the config says (some exports drop the duplicate tensor).
    """
    folder = Path(folder)
    config = read_hf_config(folder)
    weights = read_safetensors(safetensors_files(folder))
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    return config, weights
