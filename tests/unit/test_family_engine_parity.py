"""Each model family, saved by transformers as a Hugging Face folder, loaded through
tokenyard's loader and run by the paged engine (chunked prefill, block-sized KV pages,
decode steps), scores every token as transformers does: float32 logprobs within 1e-3 over
the prompt and each decoded token, and the same greedy tokens.

Families: Qwen3 (q/k norms, free head_dim), Llama 3.x (llama3 RoPE scaling), Mistral (a
sliding window shorter than the sequence), Phi-3 (fused qkv / gate_up tensors, its own
sliding window) and Phi-4-mini's shape (LongRoPE crossing its original context during
decoding, RoPE over 3/4 of each head)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tokenyard.engine.llm import LLM
from tokenyard.engine.models.hf_loader import read_hf_config
from tokenyard.wire.sampling_params import SamplingParams

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
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        # Far from transformers' tiny init, so attention is far from uniform and a wrong
        # rotation, window, norm or split moves the logprobs well past the tolerance.
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise if "embed" in name else 0.15 * noise)
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

    # 4-token KV blocks and 8-token steps: the prompt is prefilled in chunks across pages,
    # windows cut through blocks, decoding runs past the window (and LongRoPE's original
    # context of 16).
    llm = LLM(str(folder), weights="float32", device="cpu",
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
