"""The pure parts of `tokenyard bench peers --model 1.7b`: the model's shape (as a
transformers config, and its parameter count against SmolLM2-1.7B's published one), the
`--model` choices, the roofline arithmetic and its table, and the 1.7B model's own page
section beside the embedded model's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tokenyard.bench import peers
from tokenyard.bench.bench_model import (
    DEFAULT_QUANT,
    MODEL_CHOICES,
    SMOLLM2_1_7B,
    gguf_path,
    model_quant,
    parameter_count,
)
from tokenyard.bench.peers_table import PAGE_SECTION, PAGE_SECTION_1_7B, write_section
from tokenyard.bench.roofline import (
    Roofline,
    kv_bytes,
    measure_bandwidth,
    model_roofline,
    roofline_table,
    weight_bytes,
)
from tokenyard.text.gguf_file import GGUFFile
from tokenyard.text.model_files import embedded_model_path


def test_the_shape_is_smollm2_1_7b_as_a_transformers_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**SMOLLM2_1_7B)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings) == (24, 2048, 32, 32, 8192, 49_152, 8192)
    assert config.tie_word_embeddings and config.hidden_act == "silu"
    theta = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert theta["rope_theta"] == 130_000.0
    assert config.initializer_range == 0.02  # a sane random init: logits not degenerate
    # SmolLM2-1.7B's model card: 1.71B parameters; the count of this shape, exactly.
    assert parameter_count(SMOLLM2_1_7B) == 1_711_376_384


def test_parameter_count_of_an_untied_small_shape() -> None:
    shape = dict(SMOLLM2_1_7B, vocab_size=10, hidden_size=8, intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 tie_word_embeddings=False)
    # per layer: q, o 8x8; k, v 8x4; gate, up, down 8x16; two norms of 8
    per_layer = 2 * 64 + 2 * 32 + 3 * 128 + 16
    assert parameter_count(shape) == 2 * per_layer + 2 * 80 + 8


def test_model_choices() -> None:
    assert model_quant("1.7b") == DEFAULT_QUANT == "Q4_1"
    assert model_quant("1.7b-q4_0") == "Q4_0" and model_quant("1.7b-q8_0") == "Q8_0"
    assert model_quant("embedded") is None and model_quant("/x/model.gguf") is None
    assert model_quant("1.7b-q5_k") is None and "1.7b-q4_1" in MODEL_CHOICES
    assert gguf_path(Path("/c"), "Q4_0").name.endswith("-Q4_0.gguf")


def test_kv_bytes_per_token_read() -> None:
    # 1.7B: 24 layers x K and V x 32 heads x 64 x float16 = 196,608 bytes a token of context
    assert kv_bytes(24, 32, 64, 1) == 196_608
    assert kv_bytes(24, 32, 64, 100) == 19_660_800
    assert kv_bytes(2, 1, 4, 3, element_bytes=4) == 2 * 2 * 1 * 4 * 3 * 4


def test_the_roofline_is_bandwidth_over_bytes_per_token() -> None:
    roof = Roofline(bandwidth=20e9, weights=990_000_000, kv=10_000_000, context=100)
    assert roof.bytes_per_token == 1_000_000_000
    assert roof.ceiling_tok_s == pytest.approx(20.0)
    assert roof.share(14.0) == pytest.approx(0.7)
    table = roofline_table(roof, {"llama-server": [9.0, 10.0, 12.0], "tokenyard": []})
    assert "20.0 GB/s" in table and "**20.0 tok/s**" in table and "1,000 MB" in table
    assert "| llama-server | 10.0 | 50% |" in table  # the median, as a share
    assert "| tokenyard | - | - |" in table


def test_weight_bytes_of_a_gguf_count_a_tied_embedding_once() -> None:
    path = embedded_model_path()
    tensors = GGUFFile(path).tensors
    names = {t.name for t in tensors}
    total = sum(t.data.nbytes for t in tensors)
    if "output.weight" in names:  # untied: the lookup reads one row, not the table
        embd = next(t for t in tensors if t.name == "token_embd.weight")
        assert weight_bytes(path) == total - embd.data.nbytes
    else:
        assert weight_bytes(path) == total
    # The file is its tensors, metadata and padding: the bytes read are most of it.
    assert 0.8 * path.stat().st_size < total <= path.stat().st_size
    roof = model_roofline(path, 10e9, 100)
    assert roof.weights == weight_bytes(path) and roof.kv == kv_bytes(30, 3, 64, 100)


def test_bandwidth_measure_is_a_finite_rate() -> None:
    rate = measure_bandwidth(1, gib=0.01, repeats=2, slices=2)
    assert math.isfinite(rate) and rate > 1e8  # over 0.1 GB/s from any memory


def test_the_1_7b_plan_and_section_stand_beside_the_embedded_ones(tmp_path: Path) -> None:
    assert peers.PLAN_1_7B.long_input >= 1000 and peers.PLAN_1_7B.requests_32 >= 32
    assert peers.PLAN_1_7B.rounds >= peers.MIN_ROUNDS  # the issue: >= 5 rounds per figure
    assert PAGE_SECTION not in PAGE_SECTION_1_7B and PAGE_SECTION_1_7B not in PAGE_SECTION
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    write_section(page, f"{PAGE_SECTION}\n\nsmall\n")
    write_section(page, f"{PAGE_SECTION_1_7B}\n\nlarge 1\n", PAGE_SECTION_1_7B)
    write_section(page, f"{PAGE_SECTION_1_7B}\n\nlarge 2\n", PAGE_SECTION_1_7B)
    text = page.read_text()
    assert "small" in text and "large 2" in text and "large 1" not in text


def test_bench_peers_takes_a_model(tmp_path: Path) -> None:
    import argparse
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    args: Any = parser.parse_args(["--model", "1.7b", "--rounds", "2"])
    assert args.model == "1.7b" and args.rounds == 2
    flags = peers.tokenyard_flags(embedded_model_path(), 2)
    assert flags[:4] == ["--model", str(embedded_model_path()), "--threads", "2"]
