"""Random PEFT LoRA adapters for a model's shape, written as `peft` saves them (a folder of
`adapter_config.json` and `adapter_model.safetensors`): what `bench lora` and the HTTP
tests serve when no trained adapter is at hand. Their weights are large enough to change
the model's greedy output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Shape:
    """What an adapter of the Llama family must fit: layers and projection widths."""

    num_layers: int
    hidden: int
    q_out: int
    kv_out: int

    @classmethod
    def embedded(cls) -> Shape:
        """SmolLM2-135M-Instruct (the embedded model): 30 layers, 576 wide, 9 query heads
        and 3 key/value heads of 64."""
        return cls(num_layers=30, hidden=576, q_out=576, kv_out=192)


def write_adapter(folder: Path, shape: Shape, *, rank: int = 8, seed: int = 0,
                  std: float = 0.1) -> Path:
    """A q/v LoRA adapter of `rank` with random A and B (seeded) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        for proj, out in (("q_proj", shape.q_out), ("v_proj", shape.kv_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, shape.hidden, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def write_adapters(root: Path, count: int, shape: Shape | None = None,
                   rank: int = 8) -> dict[str, Path]:
    """`count` adapters `a0`, `a1`, … under `root`, each of its own seed."""
    shape = shape or Shape.embedded()
    return {f"a{i}": write_adapter(root / f"a{i}", shape, rank=rank, seed=100 + i)
            for i in range(count)}
