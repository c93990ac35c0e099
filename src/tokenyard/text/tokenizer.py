"""Text <-> token ids for a served model.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the fast Rust implementation) and keeps the
few facts the server needs beside it: the chat template, the BOS/EOS ids and whether prompts start
with BOS. It can be built from a GGUF file's `tokenizer.ggml.*` metadata, from a Hugging Face model
folder, or from the small cache that `save` writes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from tokenyard.text.sentencepiece import sentencepiece_bpe

if TYPE_CHECKING:
    from tokenyard.text.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# File names used by `save` / `load`.
BACKEND_FILE = "tokenizer.json"
META_FILE = "tokenyard_tokenizer.json"
#: tokenizers 0.21 added encode_batch_fast (ids without offsets); older ones lack it.
_HAS_FAST_ENCODE = hasattr(_Backend, "encode_batch_fast")

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special markers such as <|im_end|>,
# USER_DEFINED ones are added tokens that must still be matched whole (e.g. <think>).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns, keyed by what llama.cpp writes in `tokenizer.ggml.pre`. The merges
# were learned on pieces cut by these patterns, so using another one silently changes token ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# StarCoder-derived vocabularies (SmolLM, SmolLM2, ...) first isolate every digit, then apply the
# GPT-2 pattern; this matters for a whitespace run before a number ("a  1" -> "a", "  ", "1").
_DIGIT_SPLIT = r"\p{N}"

_GPT2_FAMILY = ("gpt2", "gpt-2", "mpt", "olmo", "jais")
_STARCODER_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell")
_LLAMA3_FAMILY = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "smaug-bpe", "dbrx")
_QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen", "megrez")

# pre name -> (split patterns applied in order, BPE ignore_merges). Llama 3 looks whole words up in
# the vocabulary before merging, which the other families do not.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2_SPLIT,), False) for name in _GPT2_FAMILY},
    **{name: ((_DIGIT_SPLIT, _GPT2_SPLIT), False) for name in _STARCODER_FAMILY},
    **{name: ((_LLAMA3_SPLIT,), True) for name in _LLAMA3_FAMILY},
    **{name: ((_QWEN2_SPLIT,), False) for name in _QWEN2_FAMILY},
}

# Tokens that close a chat turn in common templates. When one appears in the template it also ends
# generation, even if the file's EOS is a different token (e.g. Llama 3's <|eot_id|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@cache
def _byte_decoder() -> dict[str, int]:
    """Map from the printable characters GPT-2 byte-level BPE uses back to the raw byte values."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    # Bytes that are not printable are spelled with code points from 256 up, in byte order.
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


@dataclass
class TokenizerInfo:
    """Everything about a tokenizer that `tokenizer.json` does not record (saved beside it)."""

    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    # Extra ids that end generation, e.g. from generation_config.json.
    extra_eos_token_ids: list[int] = field(default_factory=list)


class Tokenizer:
    """A model's tokenizer: encoding, decoding, special tokens and chat template."""

    def __init__(self, backend: _Backend, info: TokenizerInfo) -> None:
        """Wrap an already configured `tokenizers.Tokenizer` and its side information."""
        self._backend = backend
        self._info = info
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        self._bytes_cache: dict[int, bytes] = {}
        added = backend.get_added_tokens_decoder()
        known = (info.bos_token_id, info.eos_token_id, info.unk_token_id, info.pad_token_id)
        self._special_ids = {i for i, tok in added.items() if tok.special}
        self._special_ids.update(i for i in known if i is not None)
        self._eos_ids = self._collect_eos_ids()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFFile) -> Tokenizer:
        """Build the tokenizer a GGUF file describes.

        `source` is a path or an already opened `GGUFFile` (a model loader passes the one
        it has).
        Byte-level BPE ("gpt2") and SentencePiece ("llama": Gemma, Llama 2) vocabularies are
        implemented. Raises ValueError for another tokenizer model or an unknown pre-tokenizer.
        """
        from tokenyard.text.gguf_file import GGUFFile  # numpy and gguf: only when needed

        reader = source if isinstance(source, GGUFFile) else GGUFFile(source)

        def field_value(key: str, default: Any = None) -> Any:
            value = reader.fields.get(key)
            return default if value is None else value

        model = field_value("tokenizer.ggml.model")
        tokens = field_value("tokenizer.ggml.tokens")
        token_types = field_value("tokenizer.ggml.token_type", [])
        unk_id = field_value("tokenizer.ggml.unknown_token_id")
        if model == "llama":
            backend = sentencepiece_bpe(
                tokens,
                scores=field_value("tokenizer.ggml.scores", []),
                token_types=token_types,
                unk_token=None if unk_id is None else tokens[unk_id],
                # llama.cpp's default for SentencePiece vocabularies that do not say.
                add_space_prefix=bool(field_value("tokenizer.ggml.add_space_prefix", True)),
            )
        elif model == "gpt2":
            pre = field_value("tokenizer.ggml.pre")
            if pre is None:
                # Converted before llama.cpp recorded the pre-tokenizer: GPT-2 is its fallback.
                logger.warning("GGUF has no tokenizer.ggml.pre; assuming the GPT-2 pre-tokenizer")
                pre = "gpt2"
            backend = _byte_level_bpe(
                tokens, merges=field_value("tokenizer.ggml.merges", []), pre=pre
            )
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r}: byte-level BPE ('gpt2') and "
                "SentencePiece ('llama') are implemented; load the model from a Hugging Face "
                "folder with tokenizer.json instead"
            )
        _add_gguf_added_tokens(backend, tokens, token_types)
        info = TokenizerInfo(
            chat_template=field_value("tokenizer.chat_template"),
            bos_token_id=field_value("tokenizer.ggml.bos_token_id"),
            eos_token_id=field_value("tokenizer.ggml.eos_token_id"),
            unk_token_id=unk_id,
            pad_token_id=field_value("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(field_value("tokenizer.ggml.add_bos_token", False)),
        )
        return cls(backend, info)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model folder.

        Reads `tokenizer.json`, `tokenizer_config.json` (chat template, BOS/EOS, add_bos_token),
        an optional `chat_template.jinja` and optional `generation_config.json` EOS ids.
        """
        folder = Path(path)
        backend = _Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the post-processor in tokenizer.json decides, as in transformers.
            with_specials = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_specials[:1] == [bos_id]

        template = _pick_chat_template(config.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        gen_eos = generation.get("eos_token_id")
        extra_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        info = TokenizerInfo(
            chat_template=template,
            bos_token_id=bos_id,
            eos_token_id=eos_id if eos_id is not None else (extra_eos or [None])[0],
            unk_token_id=_token_id(backend, config.get("unk_token")),
            pad_token_id=_token_id(backend, config.get("pad_token")),
            add_bos_token=bool(add_bos),
            extra_eos_token_ids=extra_eos,
        )
        return cls(backend, info)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and the side information into `directory` (created if needed)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / BACKEND_FILE))
        (out / META_FILE).write_text(json.dumps(asdict(self._info), indent=2), encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read back a tokenizer written by `save`."""
        folder = Path(directory)
        backend = _Backend.from_file(str(folder / BACKEND_FILE))
        saved = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        # Ignore keys this version does not know, so an older reader accepts a newer cache.
        known = {f.name for f in fields(TokenizerInfo)}
        info = TokenizerInfo(**{k: v for k, v in saved.items() if k in known})
        return cls(backend, info)

    # ------------------------------------------------------------------ facts

    @property
    def backend(self) -> _Backend:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, if it ships one."""
        return self._info.chat_template

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts the ids with BOS."""
        return self._info.add_bos_token

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token."""
        return self._info.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token named by the model files."""
        return self._info.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token."""
        return self._info.pad_token_id

    @property
    def unk_token_id(self) -> int | None:
        """Id of the unknown token."""
        return self._info.unk_token_id

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (what chat templates get as `bos_token`)."""
        return self._token_text(self._info.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (what chat templates get as `eos_token`)."""
        return self._token_text(self._info.eos_token_id)

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of special tokens: control tokens plus BOS/EOS/UNK/PAD."""
        return set(self._special_ids)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: EOS, generation-config EOS ids, end-of-turn tokens."""
        return list(self._eos_ids)

    # ------------------------------------------------------------------ conversion

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special-token text such as "<|im_end|>" maps to its single id.

        With `add_special_tokens`, BOS is prepended when the model asks for it (`add_bos_token`).
        """
        backend = self._backend
        if _HAS_FAST_ENCODE:
            # Skips the character offsets encode() computes and we never read: the same
            # ids for ~20% less time.
            ids: list[int] = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        else:
            ids = backend.encode(text, add_special_tokens=False).ids
        bos = self._info.bos_token_id
        if add_special_tokens and self._info.add_bos_token and bos is not None:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary spelling of each id ("" for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled exactly `token`, or None."""
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """Raw bytes the token stands for (for logprobs' `bytes`); may be a partial UTF-8 char."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._token_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    # ------------------------------------------------------------------ internals

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def _token_bytes(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._special_ids:
            return token.encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            # A character outside the byte alphabet can only be literal text (an added token).
            return b"".join(
                bytes([table[ch]]) if ch in table else ch.encode("utf-8") for ch in token
            )
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])  # sentencepiece byte-fallback token
        return token.replace("\u2581", " ").encode("utf-8")

    def _collect_eos_ids(self) -> list[int]:
        candidates: list[int | None] = [self._info.eos_token_id, *self._info.extra_eos_token_ids]
        template = self._info.chat_template or ""
        for marker in _END_OF_TURN_TOKENS:
            if marker in template:
                candidates.append(self.token_to_id(marker))
        ordered: list[int] = []
        for candidate in candidates:
            if candidate is not None and candidate not in ordered:
                ordered.append(candidate)
        return ordered


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> _Backend:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp-style vocabulary metadata."""
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r} for a byte-level BPE vocabulary; "
            f"known: {sorted(_PRE_TOKENIZERS)}"
        )
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicated spelling keeps its first id, like llama.cpp
    # Tokens never contain a real space (it is spelled "Ġ"), so one split per merge is exact.
    pairs = [_merge_pair(m) for m in merges]
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_gguf_added_tokens(backend: _Backend, tokens: list[str], token_types: list[int]) -> None:
    """Register a GGUF vocabulary's control and user-defined tokens as added tokens."""
    control = [
        t for t, kind in zip(tokens, token_types, strict=False) if kind == _TOKEN_TYPE_CONTROL
    ]
    user = [
        t for t, kind in zip(tokens, token_types, strict=False) if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    # Added tokens are matched whole in the raw text before pre-tokenization, so they never split.
    # Control tokens are special (dropped by skip_special_tokens); user-defined ones are kept.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_id(backend: _Backend, token: Any) -> int | None:
    """Id for a tokenizer_config.json token entry (a string or an AddedToken-style dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found = backend.token_to_id(token)
    return None if found is None else int(found)


def _pick_chat_template(value: Any) -> str | None:
    """The default template from tokenizer_config.json's `chat_template` (string or named list)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
