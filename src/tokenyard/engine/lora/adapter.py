"""A PEFT LoRA adapter read from its folder: `adapter_config.json` and
`adapter_model.safetensors`, as `peft`'s `save_pretrained` writes them.

Only what the engine can apply exactly is accepted: plain LoRA (no DoRA, no bias, no
modules saved whole) on the Llama family's projections. Each tensor is kept under the
fused projection it adapts (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`) with the
slice of that projection's output it writes, and B already carries the scale
(`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tokenyard.engine.models.hf_loader import read_json_object

#: A Hugging Face projection -> (the fused Linear of a decoder layer, its output slice).
FUSED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
#: Output slices per fused projection.
SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """The folder is not a LoRA adapter this engine can apply."""


@dataclass(frozen=True)
class LoraPart:
    """One adapted HF projection: A [r, in] and B [out_slice, r] (scaled)."""

    slice: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoraAdapter:
    name: str
    rank: int
    path: Path
    #: (layer, fused projection) -> the parts it adapts.
    parts: dict[tuple[int, str], list[LoraPart]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for parts in self.parts.values() for p in parts)


def _config(folder: Path) -> dict[str, Any]:
    config = read_json_object(folder / "adapter_config.json", AdapterError)
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{folder}: peft_type {kind!r}; only LORA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if config.get(flag):
            raise AdapterError(f"{folder}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: LoRA biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{folder}: modules_to_save is not supported")
    return config


def load_adapter(folder: str | Path, name: str, max_rank: int | None = None) -> LoraAdapter:
    """Read the adapter in `folder`; AdapterError when it cannot be applied exactly."""
    folder = Path(folder)
    config = _config(folder)
    rank = int(config.get("r", 8))
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} is over the engine's max_lora_rank "
                           f"{max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = folder / "adapter_model.safetensors"
    try:
        tensors = load_file(str(weights_path))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {weights_path}: {exc}") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in FUSED:
            raise AdapterError(f"{folder}: unsupported tensor {key!r}")
        layer, proj, ab = int(match.group(1)), match.group(2), match.group(3)
        found.setdefault((layer, proj), {})[ab] = tensor.float()
    adapter = LoraAdapter(name, rank, folder)
    for (layer, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{folder}: layer {layer} {proj}: rank is not {rank}")
        fused, index = FUSED[proj]
        adapter.parts.setdefault((layer, fused), []).append(LoraPart(index, a, b * scale))
    if not adapter.parts:
        raise AdapterError(f"{folder}: the adapter holds no LoRA weights")
    return adapter
