"""Our LlamaForCausalLM must reproduce transformers' float32 logits for every family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tokenyard.engine.attention_backend import CausalAttention
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.engine.models.loader import LoadedModel, build_model, load_model

VOCAB = 256
SEQ_LEN = 24

_TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the head's frequencies fall in all three llama3 bands (kept/smoothed/scaled).
    "original_max_position_embeddings": 64,
}

# case id -> (transformers config class, its model class, extra config kwargs, our config)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_theta": 50000.0},
        {"architecture": "llama", "head_dim": 16, "rope_theta": 50000.0},
    ),
    "llama-tied-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "rope_theta": 10000.0, "rope_scaling": _LLAMA3_ROPE},
        {
            "architecture": "llama",
            "head_dim": 16,
            "tie_word_embeddings": True,
            "rope_scaling": _LLAMA3_ROPE,
        },
    ),
    "qwen2-bias": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_theta": 1000000.0},
        {"architecture": "qwen2", "head_dim": 16, "rope_theta": 1000000.0, "attention_bias": True},
    ),
    "qwen3-qknorm-head_dim": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32},
        {"architecture": "qwen3", "head_dim": 32, "qk_norm": True},
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": None},
        {"architecture": "mistral", "head_dim": 16},
    ),
}


def _randomize(model: torch.nn.Module) -> None:
    """Replace transformers' tiny init (std 0.02, unit norms) with values large enough for
    attention to be far from uniform, so RoPE, norm or bias mistakes change the logits."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)


def _tiny_pair(case: str) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    hf_config_cls, hf_model_cls, hf_extra, ours_extra = CASES[case]
    torch.manual_seed(0)
    hf_config = getattr(transformers, hf_config_cls)(**_TINY, **hf_extra)
    hf = getattr(transformers, hf_model_cls)(hf_config).eval()
    _randomize(hf)
    ours = LlamaForCausalLM(ModelConfig(**_TINY, **ours_extra))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None], position_ids=positions[None]).logits[0].float()


def _ours_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), CausalAttention())
    return model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_for_tiny_random_models(case: str) -> None:
    hf, ours = _tiny_pair(case)
    ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(7))
    expected = _hf_logits(hf, ids, torch.arange(SEQ_LEN))
    got = _ours_logits(ours, ids)
    assert got.dtype == torch.float32
    assert got.shape == (SEQ_LEN, VOCAB)
    # The logits are O(10) with this init, so a wrong rotation or norm is far outside this.
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _SegmentedAttention:
    """Block-diagonal causal attention over concatenated sequences (what an engine does)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.calls: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        assert window is None  # no case here has a sliding window
        self.calls.append((layer, tuple(q.shape), tuple(k.shape)))
        outs = []
        start = 0
        for n in self.lengths:
            sl = slice(start, start + n)
            outs.append(CausalAttention()(layer, q[sl], k[sl], v[sl]))
            start += n
        return torch.cat(outs)


def test_flat_batch_of_two_sequences_matches_each_run_alone() -> None:
    hf, ours = _tiny_pair("qwen3-qknorm-head_dim")
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, VOCAB, (9,), generator=gen)
    second = torch.randint(0, VOCAB, (14,), generator=gen)
    ids = torch.cat([first, second])
    positions = torch.cat([torch.arange(9), torch.arange(14)])
    attention = _SegmentedAttention([9, 14])

    logits = ours.compute_logits(ours(ids, positions, attention))

    torch.testing.assert_close(
        logits[:9], _hf_logits(hf, first, torch.arange(9)), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        logits[9:], _hf_logits(hf, second, torch.arange(14)), rtol=1e-4, atol=1e-4
    )
    # One call per layer, in order, with q [T, Hq, D] and k [T, Hkv, D] after the fusions.
    assert attention.calls == [(0, (23, 4, 32), (23, 2, 32)), (1, (23, 4, 32), (23, 2, 32))]


class _GrowingKVAttention:
    """Causal attention that keeps every layer's k/v, for cheap greedy decoding in tests."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        assert window is None  # no case here has a sliding window
        if layer in self.k:
            k = torch.cat([self.k[layer], k])
            v = torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        new, total = q.shape[0], k.shape[0]
        # Query i sits at absolute position total - new + i and sees keys up to it.
        mask = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        groups = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(groups, dim=1).transpose(0, 1),
            v.repeat_interleave(groups, dim=1).transpose(0, 1),
            attn_mask=mask,
        )
        return out.transpose(0, 1)


def test_decoding_against_cached_keys_uses_the_given_positions() -> None:
    # RoPE only sees relative offsets, so shifting a whole sequence changes nothing; the
    # positions matter once new tokens attend to keys computed in an earlier step.
    hf, ours = _tiny_pair("llama")
    ids = torch.randint(0, VOCAB, (15,), generator=torch.Generator().manual_seed(5))
    expected = _hf_logits(hf, ids, torch.arange(15))
    attention = _GrowingKVAttention()
    rows = [ours.compute_logits(ours(ids[:10], torch.arange(10), attention))]
    for pos in range(10, 15):
        rows.append(ours.compute_logits(ours(ids[pos : pos + 1], torch.tensor([pos]), attention)))
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-4, atol=1e-4)


def test_load_weights_reports_missing_unexpected_and_misshapen_names() -> None:
    hf, ours = _tiny_pair("qwen2-bias")
    state = dict(hf.state_dict())

    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(
        ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.k_proj\.bias"
    ):
        ours.load_weights(missing.items())

    extra = {**state, "model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}
    with pytest.raises(
        ValueError, match=r"unexpected weights: model\.layers\.0\.mlp\.gate_proj\.bias"
    ):
        ours.load_weights(extra.items())

    bad = {**state, "model.norm.weight": torch.zeros(65)}
    with pytest.raises(ValueError, match=r"wrong shapes: model\.norm\.weight"):
        ours.load_weights(bad.items())


def test_unknown_architecture_and_rope_type_are_rejected() -> None:
    base = ModelConfig("llama", 16, 8, 16, 1, 2, 1, 4)
    with pytest.raises(ValueError, match="unsupported architecture"):
        LlamaForCausalLM(ModelConfig(**{**base.__dict__, "architecture": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        LlamaForCausalLM(ModelConfig(**{**base.__dict__, "rope_scaling": {"rope_type": "yarn"}}))


# ----------------------------------------------------------------- the embedded SmolLM2


def _shared_cache_dir(factory: pytest.TempPathFactory) -> Path:
    # Same folder as test_model_loader.py uses, so the model is dequantized once per session.
    return factory.getbasetemp() / "tokenyard-model-cache"


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(None, cache_dir=_shared_cache_dir(tmp_path_factory), show_progress=False)


@pytest.fixture(scope="module")
def smollm_model(smollm: LoadedModel) -> LlamaForCausalLM:
    return build_model(smollm)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_smollm(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """transformers' LlamaForCausalLM holding the same dequantized weights as ours."""
    cfg = smollm.config
    assert smollm.cache_path is not None
    folder = tmp_path_factory.mktemp("hf-smollm")
    transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # accepted by 4.x and 5.x
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    ).save_pretrained(folder)
    # Our cache's safetensors already hold HF names; from_pretrained skips the seconds of
    # random init that constructing the class directly would spend on 135M parameters.
    (folder / "model.safetensors").symlink_to(smollm.cache_path / "model.safetensors")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(hf.lm_head.weight, smollm.weights["model.embed_tokens.weight"])
    return hf


def _hf_greedy_choices(
    hf: torch.nn.Module, prompt: list[int], continuation: list[int]
) -> list[int]:
    """transformers' argmax after each prefix of prompt + continuation.

    Equal to `continuation` exactly when transformers' own greedy decoding would produce the
    same tokens, at the cost of one forward pass instead of one per token.
    """
    seq = torch.tensor(prompt + continuation)
    logits = _hf_logits(hf, seq, torch.arange(len(seq)))
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def _ours_greedy(model: LlamaForCausalLM, ids: list[int], steps: int) -> list[int]:
    attention = _GrowingKVAttention()
    out: list[int] = []
    step_ids = torch.tensor(ids)
    start = 0
    for _ in range(steps):
        positions = torch.arange(start, start + len(step_ids))
        hidden = model(step_ids, positions, attention)
        token = int(model.compute_logits(hidden[-1:])[0].argmax())
        out.append(token)
        start += len(step_ids)
        step_ids = torch.tensor([token])
    return out


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers_logits_and_greedy_text(
    smollm: LoadedModel, smollm_model: LlamaForCausalLM, hf_smollm: torch.nn.Module
) -> None:
    for prompt in PROMPTS:
        ids = smollm.tokenizer.encode(prompt)
        assert len(ids) >= 4
        expected = _hf_logits(hf_smollm, torch.tensor(ids), torch.arange(len(ids)))
        got = _ours_logits(smollm_model, torch.tensor(ids))
        rel = (got - expected).abs().max() / expected.abs().max()
        assert rel < 1e-3, f"{prompt!r}: relative logit error {rel:.2e}"
    ids = smollm.tokenizer.encode(PROMPTS[2])
    continuation = _ours_greedy(smollm_model, ids, 32)
    assert _hf_greedy_choices(hf_smollm, ids, continuation) == continuation


@pytest.mark.slow
def test_embedded_smollm2_knows_the_capital_of_france(
    smollm: LoadedModel, smollm_model: LlamaForCausalLM
) -> None:
    # Parity above loads the same tensors into both models, so it cannot see a wrong GGUF
    # conversion (e.g. q/k left in llama.cpp's permuted layout); real text can.
    ours = smollm_model
    ids = smollm.tokenizer.encode("The capital of France is")
    continuation = smollm.tokenizer.decode(_ours_greedy(ours, ids, 6))
    assert "Paris" in continuation
