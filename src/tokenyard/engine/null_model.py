"""A model that costs nothing, for measuring the host path (`tokenyard bench host`).

`EngineConfig.null_model` (``TOKENYARD_NULL_MODEL=on``) makes a replica build this in place
of the model's weights: the embedded model's tokenizer and configuration, one layer of KV
pool, and a forward pass that computes nothing. Everything around it is the real engine:
scheduler, KV manager (blocks, prefix cache), runner input preparation, sampler, output
processing, replica server, balancer and gateway. What a step then costs is the host's
work alone, which on an accelerator runs beside the device's and bounds it.

Its logits cover the tokenizer's first `NULL_VOCAB` ids, while its configuration keeps
the whole vocabulary (prompt ids, the gateway's checks): a sampler over 49,152 logits a
row is real arithmetic on a CPU (argmax over 256 rows of them takes ~10 ms here), work an
accelerator does on the device; 2,048 keeps the rows' tensors shaped as a real model's
while their arithmetic stays negligible. So it is a benchmark's model, not one to serve:
penalties, `logit_bias` and grammars over ids past `NULL_VOCAB` are outside its rows.

Each row's logits put one token far above the rest, a different one per position and
input token, skipping the special ids (below `FIRST_TEXT_ID`), so the answers are text
and a stream sends one chunk per token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import nn

from tokenyard.engine.attention_backend import AttentionBackend
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.gguf_loader import open_gguf, read_gguf_config
from tokenyard.text.model_files import embedded_model_path, file_sha256, load_tokenizer
from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: The null model's vocabulary: the tokenizer's first ids (see the module).
NULL_VOCAB = 2048
#: SmolLM2's special tokens take ids 0-16; the null model never picks them.
FIRST_TEXT_ID = 17
#: How far the chosen token's logit stands above the rest (any sampling picks it).
HOT_LOGIT = 40.0


class NullModel(nn.Module):
    """The forward pass of a model that computes nothing (see the module)."""

    def __init__(self, vocab_size: int = NULL_VOCAB) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionBackend) -> torch.Tensor:
        """Stands for hidden states: one number a row that decides its logits."""
        return (positions * 31 + input_ids).to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits: zero but for one hot token a row."""
        span = self.vocab_size - FIRST_TEXT_ID
        hot = hidden[:, 0].to(torch.long) % span + FIRST_TEXT_ID
        logits = torch.zeros(hidden.shape[0], self.vocab_size, device=hidden.device)
        logits.scatter_(1, hot[:, None], HOT_LOGIT)
        return logits

    def set_threads(self, num_threads: int) -> None:
        """Nothing to slice over cores."""


def null_model_config(cache_dir: Path) -> tuple[ModelConfig, Tokenizer]:
    """The embedded model's configuration reshaped for the null model (one layer) and
    its tokenizer, read from the conversion cache where a replica of
    it has started before (milliseconds), else from the GGUF's header."""
    path = embedded_model_path()
    tokenizer = load_tokenizer(None, cache_dir)
    cached = cache_dir / file_sha256(path) / "config.json"
    try:
        config = ModelConfig(**json.loads(cached.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        logger.info("no cached config in %s (%s); reading the GGUF", cached, exc)
        config = read_gguf_config(open_gguf(path), name=path.stem)
    config = dataclasses.replace(config, num_hidden_layers=1)
    return config, tokenizer
