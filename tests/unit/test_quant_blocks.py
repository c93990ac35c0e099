"""Block-quantized weights: the C++ kernel against the torch reference, the block formats,
and the GGUF blocks the loader keeps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tokenyard.engine.kernels import blocks
from tokenyard.engine.kernels.blocks import Q4_1, Q8_0, BlockWeight
from tokenyard.engine.kernels.build import unavailable_reason
from tokenyard.engine.models import quant
from tokenyard.engine.models.loader import LoadedModel, build_model, load_gguf_blocks, load_model


@pytest.fixture(scope="module")
def ops() -> object:
    if not blocks.kernel_available():
        pytest.skip(f"quant_matmul kernel unavailable: {unavailable_reason('quant_matmul')}")
    return torch.ops.tokenyard_quant


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[:, 3] *= 40.0  # an outlier input channel
    w[1] = 0.0  # an all-zero row (d = 0 blocks)
    return w


def _acts(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 5] = 3000.0  # SmolLM2-like outlier channel
    x[0, :32] = 0.0  # an all-zero activation block
    return x


@pytest.mark.parametrize("qtype", [Q8_0, Q4_1])
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize(("n", "k", "m"), [(960, 576, 1), (70, 64, 3), (129, 1536, 5),
                                           (200, 576, 17), (64, 96, 64),
                                           # groups of 4 rows (AVX2): whole, partial, passes
                                           (130, 576, 4), (67, 1536, 8), (96, 64, 7),
                                           (65, 576, 16), (33, 96, 21), (40, 64, 36)])
def test_kernel_matches_the_torch_reference(
    ops: object, qtype: int, bits: int, n: int, k: int, m: int
) -> None:
    w = BlockWeight.quantize(_weight(n, k, seed=n + k), qtype)
    x = _acts(m, k, seed=m)
    got = ops.quant_matmul(x, w.data, qtype, bits)  # type: ignore[attr-defined]
    want = blocks.reference_matmul(x, w.data, qtype, bits)
    assert got.shape == (m, n)
    scale = want.abs().amax()
    assert ((got - want).abs().amax() / scale).item() < 5e-5


def test_kernel_takes_non_contiguous_rows(ops: object) -> None:
    w = BlockWeight.quantize(_weight(96, 128, seed=1), Q4_1)
    x = _acts(8, 256, seed=2)[:, ::2]
    got = ops.quant_matmul(x, w.data, Q4_1, 16)  # type: ignore[attr-defined]
    torch.testing.assert_close(got, blocks.reference_matmul(x.contiguous(), w.data, Q4_1, 16),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", [Q8_0, Q4_1])
def test_dequantize_and_embedding_match_torch(ops: object, qtype: int) -> None:
    w = BlockWeight.quantize(_weight(300, 192, seed=3), qtype)
    ref = blocks.dequantize_torch(w.data, qtype)
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(w.dequantize(7, 100), ref[7:100])
    ids = torch.tensor([0, 299, 5, 5, 1])
    assert torch.equal(w.embedding(ids), ref[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        w.embedding(torch.tensor([300]))


@pytest.mark.parametrize("qtype", [Q8_0, Q4_1])
def test_gemm_path_is_float_activations_times_dequantized_weights(ops: object, qtype: int) -> None:
    w = BlockWeight.quantize(_weight(5000, 64, seed=4), qtype)  # > one GEMM tile of rows
    x = torch.randn(blocks.KERNEL_MAX_ROWS + 1, 64)
    want = F.linear(x, blocks.dequantize_torch(w.data, qtype))
    torch.testing.assert_close(w.matmul(x), want, rtol=1e-5, atol=1e-4)


def test_formats_round_trip_within_their_step() -> None:
    w = _weight(64, 128, seed=5)
    for qtype, levels in ((Q8_0, 254), (Q4_1, 15)):
        back = blocks.dequantize_torch(BlockWeight.quantize(w, qtype).data, qtype)
        span = w.reshape(64, 4, 32).abs().amax(-1, keepdim=True) * 2
        err = (back - w).reshape(64, 4, 32).abs()
        assert bool((err <= span / levels * 0.51 + 1e-3).all()), qtype


def test_q8_0_and_q4_1_bytes_are_gguf_bytes() -> None:
    """Our dequantization reads llama.cpp's own blocks (written by the gguf package)."""
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for qtype, kind in ((Q8_0, GGMLQuantizationType.Q8_0), (Q4_1, GGMLQuantizationType.Q4_1)):
        raw = gguf_quantize(w, kind)
        ours = blocks.dequantize_torch(torch.from_numpy(raw.copy()), qtype)
        torch.testing.assert_close(ours, torch.from_numpy(gguf_dequantize(raw, kind)))


def test_q4_0_becomes_q4_1_without_loss() -> None:
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType.Q4_0)
    q41 = blocks.q4_0_to_q4_1(torch.from_numpy(raw.copy()))
    want = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q4_0))
    assert torch.equal(blocks.dequantize_torch(q41, Q4_1), want)


def test_block_weight_rejects_misshapen_data() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        BlockWeight(torch.zeros(4, 33, dtype=torch.uint8), Q8_0, 32)
    with pytest.raises(ValueError, match="K % 32"):
        blocks.quantize_q8_0(torch.zeros(4, 33))


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # Same folder as test_model_loader.py uses, so the model is dequantized once per session.
    cache = tmp_path_factory.getbasetemp() / "tokenyard-model-cache"
    return load_model(None, cache_dir=cache, show_progress=False)


def test_gguf_blocks_are_the_float_weights_undequantized(smollm: LoadedModel) -> None:
    native = load_gguf_blocks(smollm)
    assert smollm.cache_path is not None and (smollm.cache_path / "blocks.safetensors").exists()
    assert load_gguf_blocks(smollm).keys() == native.keys()  # read back from the cache
    kinds = {kind for kind, _ in native.values()}
    assert kinds == {"Q4_1", "Q8_0"}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.5.mlp.down_proj.weight", "model.embed_tokens.weight"):
        kind, raw = native[name]
        qtype = Q8_0 if kind == "Q8_0" else Q4_1
        assert torch.equal(blocks.dequantize_torch(raw, qtype), smollm.weights[name]), name


def test_block_model_keeps_no_float_copy(smollm: LoadedModel, ops: object) -> None:
    model = quant.convert_weights(build_model(smollm), smollm, "q4_1")
    for module in model.modules():
        if isinstance(module, quant.Linear):
            assert module.blocks is not None and module.weight.numel() == 0
    assert model.embed_tokens.numel() == 0
    assert model.embed_blocks is model.lm_head_blocks
    kept = sum(b.nbytes for m in model.modules() if isinstance(m, quant.Linear)
               for b in [m.blocks] if b is not None)
    assert kept + model.embed_blocks.nbytes < 100e6  # 135M weights at ~5-8.5 bits


def test_weights_served_as_gguf_blocks_are_never_read_as_floats(
    smollm: LoadedModel, ops: object
) -> None:
    """A replica serving the GGUF's own blocks skips their float32 copies (frontend.py):
    every projection and the embedding, and the model computes what the full load does."""
    native = load_gguf_blocks(smollm)
    skipped = quant.native_names(native, smollm.config)
    assert "model.embed_tokens.weight" in skipped
    for layer in range(smollm.config.num_hidden_layers):
        for piece in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert f"model.layers.{layer}.{piece}.weight" in skipped
    read: list[str] = []

    class Watched(dict[str, torch.Tensor]):
        def __getitem__(self, name: str) -> torch.Tensor:
            read.append(name)
            return super().__getitem__(name)

    watched = LoadedModel(smollm.config, Watched(smollm.weights), smollm.tokenizer,
                          smollm.source, cache_path=smollm.cache_path)
    lean = quant.convert_weights(build_model(watched, skip=skipped), watched, "q4_1", native)
    assert read and not set(read) & skipped  # only the norms
    full = quant.convert_weights(build_model(smollm), smollm, "q4_1")
    ids = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        assert torch.equal(lean.embed_blocks.embedding(ids), full.embed_blocks.embedding(ids))
        for a, b in zip(lean.modules(), full.modules(), strict=True):
            if isinstance(a, quant.Linear):
                assert a.blocks is not None and b.blocks is not None
                assert torch.equal(a.blocks.data, b.blocks.data)


def test_without_the_kernel_the_model_stays_float32(
    smollm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "kernel_available", lambda: False)
    model = quant.convert_weights(build_model(smollm), smollm, "q8_0")
    assert model.embed_blocks is None and model.embed_tokens.numel() > 0


def test_text_file_is_shipped() -> None:
    from tokenyard.bench.micro import TEXT_FILE

    assert Path(TEXT_FILE).stat().st_size > 8000
