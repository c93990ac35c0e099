"""Block-quantized weights against float32 on real text: a looser, faster version of the
figures `tokenyard bench micro` prints (2,359 positions there, 256 here)."""

from __future__ import annotations

import pytest
import torch

from tokenyard.bench.micro import public_domain_tokens, teacher_forced_logits, weights_quality
from tokenyard.engine.kernels import blocks
from tokenyard.engine.kernels.build import unavailable_reason
from tokenyard.engine.models.loader import LoadedModel, build_model, load_model

POSITIONS = 256


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    if not blocks.kernel_available():
        pytest.skip(f"quant_matmul kernel unavailable: {unavailable_reason('quant_matmul')}")
    # Same folder as test_model_loader.py uses, so the model is dequantized once per session.
    cache = tmp_path_factory.getbasetemp() / "tokenyard-model-cache"
    return load_model(None, cache_dir=cache, show_progress=False)


@pytest.fixture(scope="module")
def reference(smollm: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    ids = public_domain_tokens(smollm.tokenizer, POSITIONS)
    return ids, teacher_forced_logits(build_model(smollm), ids)


# (format, min top-1 agreement, max mean KL, max perplexity change). q4_1 keeps the GGUF's
# own blocks, so only the int16 activations differ from float32; q8_0 requantizes them.
@pytest.mark.parametrize(("weights", "top1", "kl", "ppl"),
                         [("q4_1", 0.99, 1e-3, 0.002), ("q8_0", 0.93, 0.02, 0.03)])
def test_block_weights_agree_with_float32(
    smollm: LoadedModel, reference: tuple[torch.Tensor, torch.Tensor],
    weights: str, top1: float, kl: float, ppl: float,
) -> None:
    ids, logits = reference
    q = weights_quality(smollm, logits, ids, weights)
    assert q.positions == POSITIONS
    assert q.top1 >= top1, q
    assert q.kl <= kl, q
    assert abs(q.ppl_quant / q.ppl_float - 1) <= ppl, q
