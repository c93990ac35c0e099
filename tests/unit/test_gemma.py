"""Gemma 3 (models/gemma.py) against transformers' Gemma3ForCausalLM: logits on tiny random
configs, a tiny GGUF written as llama.cpp writes Gemma, and greedy decoding through the
paged engine (chunked prefill, decode past the sliding window, prefix reuse)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tokenyard.engine.attention_backend import CausalAttention
from tokenyard.engine.llm import LLM
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.gemma import GemmaForCausalLM
from tokenyard.engine.models.gguf_loader import load_gguf
from tokenyard.wire.sampling_params import SamplingParams

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "bc", "\u2581ab", "abc"]
VOCAB = len(SPECIALS) + len(BYTES) + len(PIECES)
SLIDING, FULL = "sliding_attention", "full_attention"

_TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}


def _hf_gemma(layer_types: list[str], window: int, scalar: float, full_rope: dict[str, Any]
              ) -> Any:
    config = transformers.Gemma3TextConfig(
        **_TINY,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=window,
        query_pre_attn_scalar=int(scalar),
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: full_rope,
        },
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        # Values far from transformers' tiny init (zero norms, std 0.02), so a wrong norm
        # offset, scale, window or RoPE base moves the logits far outside the tolerance.
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.3 * noise if "norm" in name else noise if "embed" in name else 0.15 * noise)
    return model


def _ours(layer_types: list[str], window: int, scalar: float, rope: dict[str, Any] | None
          ) -> GemmaForCausalLM:
    return GemmaForCausalLM(ModelConfig(
        architecture="gemma3", **_TINY, num_hidden_layers=len(layer_types),
        tie_word_embeddings=True, qk_norm=True, rope_theta=1e6, rope_scaling=rope,
        layer_types=layer_types, sliding_window=window, rope_local_theta=10000.0,
        query_pre_attn_scalar=scalar,
    ))


def _hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


@pytest.mark.parametrize(
    ("layer_types", "window", "scalar", "rope"),
    [
        ([SLIDING, FULL, SLIDING], 5, 24.0, {"rope_type": "linear", "factor": 4.0}),
        ([FULL, SLIDING], 64, 16.0, None),  # window longer than the sequence: all causal
    ],
)
def test_logits_match_transformers_gemma3(
    layer_types: list[str], window: int, scalar: float, rope: dict[str, Any] | None
) -> None:
    full_rope = {"rope_type": "default", "rope_theta": 1e6, **(rope or {})}
    hf = _hf_gemma(layer_types, window, scalar, full_rope)
    ours = _ours(layer_types, window, scalar, rope)
    ours.load_weights(hf.state_dict().items())
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(7))

    expected = _hf_logits(hf, ids)
    got = ours.compute_logits(ours(ids, torch.arange(24), CausalAttention()))

    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_sliding_window_changes_the_logits() -> None:
    # Guards the parity test against a window that is never applied.
    hf = _hf_gemma([SLIDING, FULL], 4, 16.0, {"rope_type": "default", "rope_theta": 1e6})
    windowed = _ours([SLIDING, FULL], 4, 16.0, None)
    windowed.load_weights(hf.state_dict().items())
    unwindowed = _ours([SLIDING, FULL], 64, 16.0, None)
    unwindowed.load_weights(hf.state_dict().items())
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(2))
    a = windowed.compute_logits(windowed(ids, torch.arange(16), CausalAttention()))
    b = unwindowed.compute_logits(unwindowed(ids, torch.arange(16), CausalAttention()))
    torch.testing.assert_close(a[:4], b[:4])  # the first `window` rows see the same keys
    assert (a[4:] - b[4:]).abs().max() > 1e-2


# ------------------------------------------------------------------ GGUF and the engine

#: Six layers: llama.cpp's Gemma 3 pattern makes the sixth global, the others sliding.
GGUF_LAYERS = [SLIDING] * 5 + [FULL]
GGUF_WINDOW = 5


def _gguf_name(hf_name: str) -> str:
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    part = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{names[part]}.weight"


def write_tiny_gemma_gguf(path: Path, hf: Any) -> dict[str, torch.Tensor]:
    """`hf` written as llama.cpp's converter writes Gemma 3: norm scales stored as 1 + w,
    no q/k permutation, a SentencePiece vocabulary; returns the HF tensors written."""
    cfg = hf.config
    state = {k: v.detach().clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_uint32("gemma3.attention.sliding_window", GGUF_WINDOW)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPECIALS + BYTES + PIECES)
    writer.add_token_scores([-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))])
    writer.add_token_types([3] * 4 + [6] * 256 + [1] * len(PIECES))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    for name, tensor in state.items():
        data = tensor.numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture()
def tiny_gemma(tmp_path: Path) -> tuple[Any, Path]:
    hf = _hf_gemma(GGUF_LAYERS, GGUF_WINDOW, 16.0, {"rope_type": "default", "rope_theta": 1e6})
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma_gguf(path, hf)
    return hf, path


def test_gemma3_gguf_loads_hf_names_norms_and_config(tiny_gemma: tuple[Any, Path]) -> None:
    hf, path = tiny_gemma
    config, weights = load_gguf(path)

    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        # Norms come back through (w + 1) - 1 in float32: equal up to rounding.
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6)
    assert config.architecture == "gemma3"
    assert config.layer_types == GGUF_LAYERS
    assert config.sliding_window == GGUF_WINDOW
    assert config.rope_theta == 1e6 and config.rope_local_theta == 10000.0
    assert config.query_pre_attn_scalar == 16.0  # llama.cpp's rule: head_dim
    assert config.tie_word_embeddings and config.qk_norm
    assert config.eos_token_ids == [1] and config.bos_token_id == 2


def _hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_hf_logits(hf, torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt):]


def test_paged_engine_decodes_gemma3_like_transformers(tiny_gemma: tuple[Any, Path]) -> None:
    hf, path = tiny_gemma
    # Blocks of 4 tokens and 8-token steps: prompts are prefilled in chunks, the sliding
    # layers' window (5) cuts through blocks, and decoding runs far past it. (The default
    # cache: the tiny model's entry is a few KB, and the decode kernel is built there once.)
    llm = LLM(str(path), weights="float32", device="cpu",
              block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (19, 3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    first = llm.generate(prompts, params)
    again = llm.generate(prompts[0], params)

    for prompt, result in zip(prompts, first, strict=True):
        assert result.completions[0].token_ids == _hf_greedy(hf, prompt, 10)
    assert again[0].completions[0].token_ids == first[0].completions[0].token_ids
    assert again[0].num_cached_tokens == 16  # the prompt's full blocks came from the cache
