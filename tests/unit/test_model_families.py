"""The registry of model families (engine/models/families.py): every architecture the GGUF
and Hugging Face loaders accept reads into a config whose family builds its model, and an
architecture no family runs is a clear error wherever it turns up."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.families import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    family,
)
from tokenyard.engine.models.gguf_loader import GGUFError, open_gguf, read_gguf_config
from tokenyard.engine.models.hf_loader import HFModelError, read_hf_config
from tokenyard.engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from tokenyard.engine.models.loader import LoadedModel, build_model

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB, CONTEXT = 64, 4, 2, 2, 128, 256, 128


def _write_gguf(path: Path, arch: str) -> None:
    """The metadata and the one tensor `read_gguf_config` needs, as llama.cpp names them."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("embedding_length", HIDDEN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("block_count", LAYERS),
                       ("feed_forward_length", FFN), ("context_length", CONTEXT)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_hf_config(folder: Path, model_type: str) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
        "intermediate_size": FFN, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT,
    }))


def _builds(config: ModelConfig) -> None:
    model = family(config.architecture).model(config)
    assert model.config is config
    assert len(model.layers) == LAYERS


@pytest.mark.parametrize("gguf_arch", sorted(GGUF_ARCHITECTURES))
def test_every_gguf_architecture_reads_into_a_family_that_builds(
        tmp_path: Path, gguf_arch: str) -> None:
    path = tmp_path / f"{gguf_arch}.gguf"
    _write_gguf(path, gguf_arch)
    config = read_gguf_config(open_gguf(path))
    assert FAMILIES[config.architecture] is GGUF_ARCHITECTURES[gguf_arch]
    _builds(config)


@pytest.mark.parametrize("model_type", sorted(HF_MODEL_TYPES))
def test_every_hf_model_type_reads_into_a_family_that_builds(
        tmp_path: Path, model_type: str) -> None:
    folder = tmp_path / model_type
    _write_hf_config(folder, model_type)
    config = read_hf_config(folder)
    assert FAMILIES[config.architecture] is HF_MODEL_TYPES[model_type]
    _builds(config)


def test_every_family_is_loadable_and_the_llama_module_runs_its_own() -> None:
    for name, fam in FAMILIES.items():
        assert fam.name == name
        assert fam.gguf_architecture or fam.hf_model_type, f"{name}: no loader reads it"
        # The Llama module refuses configs it was not written for: its list must name
        # exactly the families it is registered to run.
        assert (fam.model is LlamaForCausalLM) == (name in SUPPORTED_ARCHITECTURES), name


def test_an_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    supported = r"supported: \['gemma3', 'llama', 'mistral', 'phi3', 'qwen2', 'qwen3'\]"
    with pytest.raises(ValueError, match=rf"unsupported architecture 'gpt2'; {supported}"):
        family("gpt2")
    config = ModelConfig(architecture="gpt2", vocab_size=VOCAB, hidden_size=HIDDEN,
                         intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HIDDEN // HEADS)
    with pytest.raises(ValueError, match=rf"unsupported architecture 'gpt2'; {supported}"):
        build_model(LoadedModel(config, {}, None, tmp_path))  # type: ignore[arg-type]
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, "falcon")
    with pytest.raises(GGUFError, match=rf"unsupported GGUF architecture 'falcon'; {supported}"):
        read_gguf_config(open_gguf(path))
    _write_hf_config(tmp_path / "gemma3-hf", "gemma3_text")  # Gemma 3 reads from GGUF only
    with pytest.raises(HFModelError, match="unsupported model_type 'gemma3_text'; supported: "
                                           r"\('llama', 'mistral', 'qwen2', 'qwen3', 'phi3'\)"):
        read_hf_config(tmp_path / "gemma3-hf")
