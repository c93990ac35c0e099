"""A pure decode step of a Llama-family model in one C++ call (CPU, block weights).

`LlamaForCausalLM.forward` with `PagedAttention` runs ~25 dispatched torch ops a layer
(RMSNorm, RoPE, the KV writes, residual adds, SiLU * up, ...), each 5-50 us on a small
CPU: at one stream that was about half of a token's time. `kernels/decode_step.cpp` runs
the same layer loop (the same block matmul and paged attention code) in one op. It is
used when every projection holds block weights (`--weights q8_0 / q4_1`, `auto` for a Q4
GGUF) and the KV cache is the CPU one the paged decode kernel reads, for steps whose rows
are all decodes or prompt tails of at most `paged_attention.ONE_OP_TAIL_ROWS` tokens (a
prefix-cache hit's uncached rest: each tail token a row with its own context length,
`paged_attention.as_decode_rows`). Longer prefills, and every other setup (float32 or int8
weights, CUDA), run the eager torch path, which is the reference this op is tested against
(tests/unit/test_decode_step.py).

Rows of LoRA adapters run in the op too (`lora_slots`: each row's slot, 0 none): after each
base matmul it adds each adapted row's update from the slots' stacked A and B that the
projections' `lora` hold (engine/lora/bank.py), so an adapted step keeps the one op
(tests/unit/test_decode_step_lora.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenyard.engine.kernels import blocks
from tokenyard.engine.kernels.build import load_ops
from tokenyard.engine.models.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM
from tokenyard.engine.paged_attention import AttentionMetadata, PagedAttention

log = logging.getLogger(__name__)

_KERNEL = "decode_step"
_EMPTY = torch.empty(0)


class DecodeStep:
    """The model's weights gathered once into the lists the op takes; call per step."""

    def __init__(self, model: LlamaForCausalLM, attention: PagedAttention) -> None:
        cfg = model.config
        self.model = model
        self.attention = attention
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.eps = float(cfg.rms_norm_eps)
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.qtypes: list[int] = []
        self.biases: list[torch.Tensor] = []
        self.qk_norms: list[torch.Tensor] = []
        self.linears: list[Linear] = []  # 4 a layer, as `weights`: where adapters sit
        for layer in model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                assert linear.blocks is not None
                self.linears.append(linear)
                self.weights.append(linear.blocks.data)
                self.qtypes.append(linear.blocks.qtype)
            self.biases += [_or_empty(layer.qkv_proj.bias), _or_empty(layer.o_proj.bias)]
            qk = layer.qk_norm_weight
            self.qk_norms.append(_EMPTY if qk is None else qk.detach().contiguous())
        self.norms.append(model.norm.weight)
        self.norms = [n.detach().contiguous() for n in self.norms]

    @classmethod
    def build(
        cls, model: torch.nn.Module, attention: PagedAttention, cache_dir: Path | None = None
    ) -> DecodeStep | None:
        """The op for this model, or None where the eager path must run (see the module)."""
        if attention.decode_kernel is None or attention.k_cache.device.type != "cpu":
            return None
        # Exactly the Llama-family decoder: another family (or a subclass changing the
        # layer) computes something else and keeps the eager path.
        if type(model) is not LlamaForCausalLM or any(
            type(layer) is not LlamaDecoderLayer for layer in model.layers
        ):
            return None
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        if not linears or any(m.blocks is None for m in linears):
            return None
        if model.embed_blocks is None and model.embed_tokens.numel() == 0:
            return None
        if not load_ops(_KERNEL, _cache_dir(cache_dir)):
            return None
        return cls(model, attention)

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [M, hidden] of M decode rows (one token each), their
        k/v written into the cache; what `model.forward` returns for the same step.
        `lora_slots`: [M] each row's LoRA slot (0: none); None: no adapted row."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        model = self.model
        if model.embed_blocks is not None:
            x = model.embed_blocks.embedding(input_ids)
        else:
            x = torch.nn.functional.embedding(input_ids, model.embed_tokens)
        out: torch.Tensor = torch.ops.tokenyard_decode.decode_layers(
            x, self.norms, self.weights, self.qtypes, self.biases, self.qk_norms,
            self.attention.k_cache, self.attention.v_cache, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_context_lens, positions,
            model.rope_cos, model.rope_sin, self.num_heads, self.num_kv_heads, self.eps,
            blocks.ACT_BITS, *self._lora(lora_slots),
        )
        return out

    def _lora(self, slots: torch.Tensor | None) -> tuple[
            list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor, int]:
        """The op's LoRA arguments: every projection's stacked A and B and its slots' ranks
        (empty where no adapter reaches), the rows' slots and the slots' width per slice
        (`max_rank`); all empty for None."""
        if slots is None:
            return [], [], [], _EMPTY, 0
        a: list[torch.Tensor] = []
        bt: list[torch.Tensor] = []
        ranks: list[torch.Tensor] = []
        width = 0
        for linear in self.linears:
            lora = linear.lora
            a.append(_EMPTY if lora is None else lora.a)
            bt.append(_EMPTY if lora is None else lora.bt)
            ranks.append(_EMPTY if lora is None else lora.ranks)
            width = width if lora is None else lora.max_rank
        return (a, bt, ranks, slots, width) if width else ([], [], [], _EMPTY, 0)


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t.detach().contiguous()


def _cache_dir(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return cache_dir
    from tokenyard.config import default_cache_dir

    return default_cache_dir()
