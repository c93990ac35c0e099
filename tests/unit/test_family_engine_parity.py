"""Each model family, saved by transformers as a Hugging Face folder, loaded through
tokenyard's loader and run by the paged engine (chunked prefill, block-sized KV pages,
decode steps), scores every token as transformers does: float32 logprobs within 1e-3 over
the prompt and each decoded token, and the same greedy tokens.

Families: Qwen3 (q/k norms, free head_dim), Llama 3.x (llama3 RoPE scaling), Mistral (a
sliding window shorter than the sequence), Phi-3 (fused qkv / gate_up tensors, its own
sliding window) and Phi-4-mini's shape (LongRoPE crossing its original context during
decoding, RoPE over 3/4 of each head). Mistral and Phi-3 also load from GGUF files written
the way llama.cpp's converter lays them out (written here with the gguf package's writer:
llama.cpp's converter itself is not installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tests.unit.test_model_loader import _byte_tokens, _llama_cpp_permute
from tests.unit.test_model_parity import _randomize
from tokenyard.engine.llm import LLM
from tokenyard.engine.models.hf_loader import read_hf_config
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB = 256
TOP = 20
TOL = 1e-3

_TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small, so the head's frequencies fall in all three bands (kept / smoothed / scaled).
    "original_max_position_embeddings": 16, "rope_theta": 500000.0,
}
_LONGROPE = {  # 12 rotated dims of 16 -> 6 frequencies
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
    "long_factor": [1.0, 1.8, 3.0, 5.0, 8.0, 12.0],
    "original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
}

#: case -> (transformers config class, model class, config kwargs, expected ModelConfig fields)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True},
              {"architecture": "qwen3", "qk_norm": True, "head_dim": 32}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": _LLAMA3_ROPE},
               {"architecture": "llama", "rope_theta": 500000.0}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6},
                       {"architecture": "mistral", "sliding_window": 6}),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM",
                    {"sliding_window": 7, "original_max_position_embeddings": 64},
                    {"architecture": "phi3", "sliding_window": 7, "rotary_dim": None}),
    "phi4mini-longrope": ("Phi3Config", "Phi3ForCausalLM",
                          {"rope_parameters": _LONGROPE, "original_max_position_embeddings": 16,
                           "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
                          {"architecture": "phi3", "rotary_dim": 12, "sliding_window": None}),
}


def _byte_tokenizer(folder: Path) -> None:
    """A complete byte-level BPE vocabulary of 256 tokens (no merges) as tokenizer.json."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))


def _hf_model(case: str) -> Any:
    config_cls, model_cls, extra, _ = CASES[case]
    config = getattr(transformers, config_cls)(**_TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model)  # attention far from uniform: a wrong window or rotation shows
    return model


def _hf_scores(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """transformers' logprobs after each prefix: the prompt in one pass, then one token a
    step through its KV cache (as its own generate() runs, which decides LongRoPE's
    factor per step). Row i predicts token i + 1 of prompt + continuation."""
    rows = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        rows.append(out.logits[0].float())
        past = out.past_key_values
        for token in continuation[:-1]:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0].float())
            past = out.past_key_values
    return torch.log_softmax(torch.cat(rows), dim=-1)


def _assert_scored(entry: Any, token: int, ref: torch.Tensor, where: str) -> None:
    assert entry.token_id == token, where
    want = float(ref[token])
    assert abs(entry.logprob - want) <= TOL * max(1.0, abs(want)), (where, entry.logprob, want)
    for tid, value in entry.top:
        want = float(ref[tid])
        assert abs(value - want) <= TOL * max(1.0, abs(want)), (where, tid, value, want)
    best = set(ref.topk(TOP).indices.tolist())
    assert len(best & {tid for tid, _ in entry.top}) >= TOP - 2, where  # ties at the edge


@pytest.mark.parametrize("case", list(CASES))
def test_family_through_the_paged_engine_scores_like_transformers(
        tmp_path: Path, case: str) -> None:
    hf = _hf_model(case)
    folder = tmp_path / case
    hf.save_pretrained(folder)
    _byte_tokenizer(folder)
    config = read_hf_config(folder)
    for key, value in CASES[case][3].items():
        assert getattr(config, key) == value, key

    _assert_engine_matches(hf, folder)


def _assert_engine_matches(hf: Any, model_path: Path) -> None:
    # 4-token KV blocks and 8-token steps: the prompt is prefilled in chunks across pages,
    # windows cut through blocks, decoding runs past the window (and LongRoPE's original
    # context of 16).
    llm = LLM(str(model_path), weights="float32", device="cpu",
              block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompt = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)
    completion = llm.generate([prompt], params)[0].completions[0]

    continuation = completion.token_ids
    assert len(continuation) == 9
    ref = _hf_scores(hf, prompt, continuation)
    assert ref.max(-1).values.min() < -0.01 or ref.min() < -5.0  # not a degenerate model
    scored = completion.prompt_logprobs
    assert scored is not None and len(scored.entries) == len(prompt) - 1
    for i, entry in enumerate(scored.entries):
        _assert_scored(entry, prompt[i + 1], ref[i], f"prompt token {i + 1}")
    assert completion.logprobs is not None
    for step, (token, entry) in enumerate(zip(continuation, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert token == int(row.argmax()), f"greedy step {step}"
        _assert_scored(entry, token, row, f"decode step {step}")


def test_the_window_and_longrope_change_the_scores(tmp_path: Path) -> None:
    """Guards the parity test: without its window / with the short factors only, the same
    weights score differently, so a window or factor set never applied would fail it."""
    for case, field, value in (("mistral-window", "sliding_window", None),
                               ("phi4mini-longrope", "rope_parameters", {
                                   **_LONGROPE, "long_factor": _LONGROPE["short_factor"]})):
        hf = _hf_model(case)
        other = _hf_model(case)
        setattr(other.config, field, value)
        other = type(other)(other.config).eval()
        other.load_state_dict(hf.state_dict())
        ids = list(range(3, 25))
        a = _hf_scores(hf, ids[:12], ids[12:])
        b = _hf_scores(other, ids[:12], ids[12:])
        assert (a - b).abs().max() > 0.05, case


# ------------------------------------------------------------------------------ GGUF

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(path: Path, hf: Any, arch: str) -> None:
    """`hf` as llama.cpp's converter writes it: Mistral's q/k rows permuted; Phi-3's fused
    tensors as they are, LongRoPE's factors as tensors, its partial rotary as
    rope.dimension_count; the sliding window as metadata."""
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg.num_hidden_layers),
                       ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("rope.dimension_count",
                        int(head_dim * rope.get("partial_rotary_factor", 1.0)))):
        writer.add_uint32(f"{arch}.{key}", value)
    if cfg.sliding_window is not None:
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope.get("rope_type") == "longrope":
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(_byte_tokens())
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf.state_dict().items():
        data = tensor.numpy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        elif name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"
            if arch == "mistral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                data = _llama_cpp_permute(data, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("case", "arch"), [("mistral-window", "mistral"),
                                            ("phi4mini-longrope", "phi3"),
                                            ("phi3-window", "phi3")])
def test_family_from_gguf_scores_like_transformers(tmp_path: Path, case: str, arch: str) -> None:
    hf = _hf_model(case)
    path = tmp_path / f"{case}.gguf"
    _write_gguf(path, hf, arch)
    _assert_engine_matches(hf, path)
