"""Tokenizer built from GGUF metadata, checked against transformers' independent builder."""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from tokenyard.text.tokenizer import META_FILE, Tokenizer, TokenizerInfo

# Texts covering ASCII, code, emoji (incl. ZWJ sequences and skin tones), CJK, whitespace runs,
# contractions and special-token text.
CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    'def add(a, b):\n    """Add."""\n    return a + b  # sum\n\n\n',
    "if (x != y) { y += x->z; }\t// tab\r\n",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "tabs\t\tand   spaces    end   ",
    "\n\n\n   \n",
    "don't I'll we've THEY'RE",
    "In 2024, pi=3.14159 and 1e-10",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé àccents — “quotes” … ñ",
    "",
]
# A whitespace run or a non-ASCII numeral next to a digit: here SmolLM2's own pre-tokenizer (and
# llama.cpp's "smollm") isolate each digit first, while transformers' GGUF loader does not.
DIGIT_CORPUS = ["a  1", "x\n\n  12", "½ ² ① Ⅻ", "total:   42 items", "v1.2.3   \n  7"]


@functools.cache
def embedded_reader(path: Path) -> gguf.GGUFReader:
    """One parsed GGUF per test session (parsing takes seconds)."""
    return gguf.GGUFReader(str(path))


@functools.cache
def embedded_tokenizer(path: Path) -> Tokenizer:
    """Our tokenizer for the embedded model, shared by the text test modules."""
    return Tokenizer.from_gguf(path)


@functools.cache
def transformers_gguf_reference(path: Path) -> Any:
    """transformers' own GGUF tokenizer builder, fed the metadata parsed by the gguf package."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    reader = embedded_reader(path)
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: reader.fields[f"tokenizer.{key}"].contents()
        for key, name in renames.items()
        if f"tokenizer.{key}" in reader.fields
    }
    architecture = reader.fields["general.architecture"].contents()
    backend, _ = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


@functools.cache
def upstream_smollm2_reference(path: Path) -> Any:
    """transformers' build with SmolLM2's published pre-tokenizer (tokenizer.json on the Hub):
    Digits(individual_digits=True) then ByteLevel with the GPT-2 regex."""
    from tokenizers import pre_tokenizers

    backend = copy.deepcopy(transformers_gguf_reference(path))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return backend


@pytest.fixture(scope="module")
def tok(embedded_gguf_path: Path) -> Tokenizer:
    return embedded_tokenizer(embedded_gguf_path)


@pytest.mark.parametrize("text", CORPUS + DIGIT_CORPUS)
def test_decode_of_encode_returns_the_original_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_transformers_gguf_loader(
    tok: Tokenizer, embedded_gguf_path: Path, text: str
) -> None:
    reference = transformers_gguf_reference(embedded_gguf_path)
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS + DIGIT_CORPUS)
def test_ids_equal_upstream_smollm2_pretokenizer(
    tok: Tokenizer, embedded_gguf_path: Path, text: str
) -> None:
    reference = upstream_smollm2_reference(embedded_gguf_path)
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_smollm_pre_splits_digits_before_the_gpt2_regex(tok: Tokenizer) -> None:
    # "a  1": the digit is cut off first, so the two spaces stay one "ĠĠ" token (llama.cpp does
    # the same for pre="smollm"); the plain GPT-2 regex would give "Ġ", "Ġ1" -> "Ġ", "Ġ", "1".
    assert tok.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "ĠĠ", "1"]


def test_special_token_text_encodes_to_its_single_id(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.encode("x<|endoftext|>y") == [tok.encode("x")[0], 0, tok.encode("y")[0]]


def test_decode_skips_special_tokens_only_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_gguf_metadata_is_exposed(tok: Tokenizer, embedded_gguf_path: Path) -> None:
    reader = embedded_reader(embedded_gguf_path)
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert (tok.eos_token_id, tok.eos_token) == (2, "<|im_end|>")
    assert (tok.unk_token_id, tok.pad_token_id) == (0, 2)
    assert tok.add_bos_token is False
    assert tok.chat_template == reader.fields["tokenizer.chat_template"].contents()
    # EOS is already the template's end-of-turn token, so it is not listed twice.
    assert tok.eos_token_ids == [2]
    assert tok.all_special_ids == set(range(17))  # the 17 CONTROL tokens


def test_encode_adds_bos_only_when_the_model_asks(tok: Tokenizer) -> None:
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    info = TokenizerInfo(bos_token_id=1, eos_token_id=2, add_bos_token=True)
    with_bos = Tokenizer(tok.backend, info)
    assert with_bos.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert with_bos.encode("hi") == tok.encode("hi")


@pytest.mark.parametrize("text", ["😀 hi", "中文", " über"])
def test_token_bytes_concatenate_to_the_utf8_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert b"".join(tok.id_to_token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_of_a_special_token_is_its_text(tok: Tokenizer) -> None:
    assert tok.id_to_token_bytes(2) == b"<|im_end|>"


def test_save_then_load_keeps_ids_and_metadata(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "cache")
    loaded = Tokenizer.load(tmp_path / "cache")
    for text in CORPUS + DIGIT_CORPUS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template
    assert loaded.eos_token_ids == tok.eos_token_ids
    assert loaded.all_special_ids == tok.all_special_ids
    assert (loaded.bos_token_id, loaded.add_bos_token) == (tok.bos_token_id, tok.add_bos_token)


def test_hf_folder_reads_config_and_generation_eos(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "chat_template": "{{ messages[0]['content'] }}",
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert loaded.encode("hello world", add_special_tokens=True) == [1, *tok.encode("hello world")]
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.eos_token_ids == [2, 0]


def test_hf_folder_without_flag_takes_bos_from_post_processor(
    tok: Tokenizer, tmp_path: Path
) -> None:
    from tokenizers import processors

    backend = copy.deepcopy(tok.backend)
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}")
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert loaded.add_bos_token is True
    assert loaded.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert loaded.chat_template == "{{ bos_token }}"


def _write_gguf(path: Path, model: str, pre: str, tokens: list[str], merges: list[str]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_byte_level_gguf_applies_its_merges(tmp_path: Path) -> None:
    tokens = ["<s>", "h", "i", "Ġ", "hi", "Ġhi"]
    _write_gguf(tmp_path / "t.gguf", "gpt2", "gpt2", tokens, ["h i", "Ġ hi"])
    tiny = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tiny.encode("hi hi<s>") == [4, 5, 0]


def test_unsupported_tokenizer_model_raises_value_error(tmp_path: Path) -> None:
    # SentencePiece unigram (T5's); SentencePiece BPE ('llama') is tests/unit/test_sentencepiece.py.
    _write_gguf(tmp_path / "ugm.gguf", "t5", "default", ["<unk>", "▁a"], [])
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'"):
        Tokenizer.from_gguf(tmp_path / "ugm.gguf")


def test_unknown_pre_tokenizer_raises_value_error(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "odd.gguf", "gpt2", "no-such-pre", ["<s>", "a"], [])
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_gguf(tmp_path / "odd.gguf")


def test_meta_file_is_plain_json(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["eos_token_id"] == 2 and meta["chat_template"] == tok.chat_template
