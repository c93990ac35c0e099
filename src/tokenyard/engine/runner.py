"""Turns a scheduled step into one flat forward pass and a sampled token per finished row."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.decode_step import DecodeStep
from tokenyard.engine.models.loader import CausalLM
from tokenyard.engine.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillSpan,
    as_decode_rows,
)
from tokenyard.engine.request import Request
from tokenyard.engine.sample import Sampler, SamplingBatch, make_generator
from tokenyard.engine.sample.grammar import fill_bitmask
from tokenyard.engine.sample.prompt_logprobs import PromptSpan, prompt_span, score_prompt_rows
from tokenyard.engine.scheduler import SchedulerOutput
from tokenyard.engine.spec.verify import verify_rows
from tokenyard.wire.outputs import TokenLogprobs


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    #: Per request asking for prompt logprobs: (first prompt position scored, its scores).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    #: Per request that verified drafts: the tokens it keeps (engine/spec/verify.py).
    accepted: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PreparedStep:
    """A scheduled step as tensors, ready for `ModelRunner.run`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows whose hidden state is sampled
    sample_requests: list[Request]
    #: (row, request id): inputs that are the token the step before sampled (async).
    fills: list[tuple[int, str]]
    #: Prefill rows to score against the next prompt token (prompt logprobs).
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    #: Per speculating request: its drafts (its rows in `sample_rows` are consecutive).
    drafts: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, the KV tensors and the sampler of one replica."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        kv: KVCacheManager,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        kernel_cache_dir: Path | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`cache_dtype`: the KV pool's elements (None: `dtype`)."""
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.attention = PagedAttention(
            num_layers=config.num_hidden_layers,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            kernel_cache_dir=kernel_cache_dir,
            cache_dtype=cache_dtype,
        )
        # Pure decode steps in one C++ op where the model and cache allow it (CPU, block
        # weights); None: every step runs the eager model (see models/decode_step.py).
        self.decode_step = DecodeStep.build(model, self.attention, kernel_cache_dir)
        self.sampler = Sampler()
        self._last_sampled: dict[str, int] = {}  # the last step's tokens, for placeholders

    def execute(self, step: SchedulerOutput) -> StepResult:
        return self.run(self.prepare(step))

    @torch.inference_mode()
    def prepare(self, step: SchedulerOutput) -> PreparedStep:
        """The step's flat inputs. Cheap Python: with async scheduling it runs while the
        previous step is still computing, so a pending token is a placeholder here."""
        # Single-token rows first: the attention batches them together.
        items = sorted(step.scheduled, key=lambda item: item[1] > 1)
        input_ids, positions, meta, fills = self._prepare(items, step.starts, step.drafts)
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        spans: list[PromptSpan] = []
        row = 0
        for request, n in items:
            if request.scores_prompt:
                span = prompt_span(request.request_id, request.prompt_token_ids,
                                   request.params.prompt_logprobs, row,
                                   step.starts[request.request_id], n,
                                   len(request.prompt_logprobs))
                if span is not None:
                    spans.append(span)
            row += n
            if request.request_id in step.sampling:
                # A row that verifies drafts samples every position it computes.
                width = len(step.drafts.get(request.request_id, ())) + 1
                sample_rows.extend(range(row - width, row))
                sample_requests.extend([request] * width)
        return PreparedStep(input_ids, positions, meta, sample_rows, sample_requests, fills,
                            spans, step.drafts)

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> StepResult:
        """The forward pass and sampling of a prepared step. Steps must run in the order
        they were scheduled: a placeholder takes the token the step before sampled."""
        input_ids, meta = prepared.input_ids, prepared.meta
        sample_requests = prepared.sample_requests
        if prepared.fills:
            rows, ids = zip(*prepared.fills, strict=True)
            input_ids[list(rows)] = torch.tensor(
                [self._last_sampled[i] for i in ids], dtype=torch.long, device=self.device
            )
        # Pure decode steps, and tails over a cached prefix as decode rows: the one op.
        one_op: AttentionMetadata | None = None
        if self.decode_step is not None:
            one_op = (meta if meta.num_decodes == len(prepared.positions)
                      else as_decode_rows(meta, prepared.positions))
        if self.decode_step is not None and one_op is not None:
            hidden = self.decode_step(input_ids, prepared.positions, one_op)
        else:
            self.attention.metadata = meta
            hidden = self.model(input_ids, prepared.positions, self.attention)
            self.attention.metadata = None
        prompt_logprobs = {}
        if prepared.prompt_spans:
            prompt_logprobs = score_prompt_rows(hidden, self.model.compute_logits,
                                                prepared.prompt_spans)
        if not sample_requests:
            self._last_sampled = {}
            return StepResult({}, {}, prompt_logprobs)
        if len(prepared.sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(prepared.sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        batch = SamplingBatch.from_params(
            [r.params for r in sample_requests],
            [self._generator(r) for r in sample_requests],
            [r.prompt_token_ids for r in sample_requests],
            [r.output_token_ids for r in sample_requests],
            device=self.device,
        )
        _ban_stops_before_min_tokens(batch, sample_requests)
        if any(r.guided is not None for r in sample_requests):
            mask = fill_bitmask([r.guided for r in sample_requests],
                                [r.output_token_ids for r in sample_requests], logits.shape[1])
            if mask is not None:
                batch.token_bitmask, batch.bitmask_rows = mask
        out = self.sampler(logits, batch)
        accepted: dict[str, list[int]] = {}
        if prepared.drafts:
            sampled, accepted = verify_rows(sample_requests, out.token_ids, prepared.drafts)
        else:
            sampled = {r.request_id: t
                       for r, t in zip(sample_requests, out.token_ids, strict=True)}
        self._last_sampled = {**sampled, **{i: kept[-1] for i, kept in accepted.items()}}
        logprobs: dict[str, TokenLogprobs] = {}
        if out.logprobs is not None:
            for i, r in enumerate(sample_requests):
                if r.params.logprobs is not None:
                    top = out.top_logprobs[i] if out.top_logprobs is not None else []
                    logprobs[r.request_id] = TokenLogprobs(out.logprobs[i], top)
        return StepResult(sampled, logprobs, prompt_logprobs, accepted=accepted)

    def _generator(self, request: Request) -> torch.Generator | None:
        """The request's seeded generator, made on this replica's device at first use."""
        seed = request.params.seed
        if seed is None:
            return None
        if request.generator is None or request.generator.device != self.device:
            request.generator = make_generator(seed, self.device)
        return request.generator

    def _prepare(
        self, items: list[tuple[Request, int]], starts: dict[str, int],
        step_drafts: dict[str, list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, str]]]:
        """Flat inputs for `items`, which must list single-token rows first, and the
        rows whose token is still pending."""
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        prefills: list[PrefillSpan] = []
        fills: list[tuple[int, str]] = []
        for request, n in items:
            start = starts[request.request_id]
            table = self.kv.block_ids(request.request_id)
            if n == 1:
                decode_tables.append(table[: start // bs + 1])
                decode_ctx.append(start + 1)
            else:
                context_blocks = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long)
                prefills.append(
                    PrefillSpan(
                        start=len(ids),
                        num_tokens=n,
                        context_len=start + n,
                        block_table=None if start == 0 else context_blocks.to(dev),
                    )
                )
            drafts = step_drafts.get(request.request_id, [])
            known = request.all_token_ids[start:start + n - len(drafts)] + drafts
            if len(known) < n:  # the one pending token of a decode row
                fills.append((len(ids) + len(known), request.request_id))
                known.append(0)
            ids.extend(known)
            p = torch.arange(start, start + n)
            pos.append(p)
            slots.append(torch.tensor(table, dtype=torch.long)[p // bs] * bs + p % bs)
        num_decodes = len(decode_ctx)
        decode_block_tables = decode_mask = decode_context_lens = None
        if num_decodes:
            width = max(len(t) for t in decode_tables)
            decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long
            ).to(dev)
            ctx = torch.tensor(decode_ctx, dtype=torch.long)
            if self.attention.decode_kernel is not None:
                decode_context_lens = ctx  # the kernel stops at each row's length: no mask
            else:
                visible = torch.arange(width * bs)[None, :] < ctx[:, None]
                decode_mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
                decode_mask = decode_mask[:, None, None, :].to(dev)
        slot_mapping = torch.cat(slots).to(dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            decode_block_tables=decode_block_tables,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_context_lens=decode_context_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.cat(pos).to(dev), meta, fills


def _ban_stops_before_min_tokens(batch: SamplingBatch, requests: list[Request]) -> None:
    """Until a request has `min_tokens` outputs, EOS and its stop token ids cannot be
    sampled (as in vLLM), rather than being sampled and then ignored. A constrained
    request's grammar alone decides where EOS may come."""
    for row, request in enumerate(requests):
        params = request.params
        if request.num_output_tokens >= params.min_tokens or request.guided is not None:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= request.eos_token_ids
        if banned:
            batch.logit_bias[row] = {
                **(batch.logit_bias[row] or {}), **dict.fromkeys(banned, float("-inf"))
            }
