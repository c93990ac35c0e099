"""SentencePiece BPE vocabularies from GGUF metadata (`tokenizer.ggml.model == "llama"`).

A SentencePiece BPE model (Gemma, Llama 2, Mistral v0.1) ships pieces with scores, not
merge rules: encoding starts from single characters and repeatedly joins the adjacent
pair whose concatenation is a piece with the highest score (llama.cpp's SPM tokenizer).
That is byte-pair encoding with the merges ranked by the score of the piece they make,
so the vocabulary becomes a `tokenizers` BPE model: every way of splitting a piece into
two pieces is a merge, best-scored pieces first. Spaces are spelled "▁" (U+2581);
characters outside the vocabulary fall back to their UTF-8 bytes (`<0xE6>` pieces).
"""

from __future__ import annotations

from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, normalizers

#: The word-boundary mark SentencePiece writes for a space.
SPACE = "\u2581"
#: llama.cpp token type of ordinary pieces (gguf.TokenType.NORMAL); merges only make these.
_TOKEN_TYPE_NORMAL = 1


def sentencepiece_merges(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """Merge rules, best first, that rebuild every normal piece from two normal pieces.

    A piece made in several ways (a+bc, ab+c) gets one rule per way, next to each other;
    ties between pieces of equal score go to the lower id, as SentencePiece ranks them.
    """
    normal: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == _TOKEN_TYPE_NORMAL:
            normal.setdefault(token, index)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = normal.get(left), normal.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[index], index, left_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    unk_token: str | None,
    add_space_prefix: bool,
) -> _Backend:
    """A `tokenizers` BPE model equivalent to the SentencePiece vocabulary described.

    `add_space_prefix` (GGUF `tokenizer.ggml.add_space_prefix`; Llama 2 yes, Gemma no)
    puts "▁" before the text, as SentencePiece's dummy prefix, and decoding drops it.
    Control and user-defined tokens are added by the caller (tokenizer.py).
    """
    if len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise ValueError(
            f"GGUF SentencePiece vocabulary: {len(tokens)} tokens but {len(scores)} scores "
            f"and {len(token_types)} token types"
        )
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicated spelling keeps its first id, like llama.cpp
    bpe = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores, token_types),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = _Backend(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    decode: list[decoders.Decoder] = [
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()
    ]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(decode)
    return backend
