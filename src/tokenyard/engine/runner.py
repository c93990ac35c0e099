"""Turns a scheduled step into one flat forward pass and a sampled token per finished row."""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenyard.engine.cuda_graphs import DecodeGraphs, build_decode_graphs
from tokenyard.engine.input_batch import InputBatch, PreparedStep
from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.lora.manager import LoraManager
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.decode_step import DecodeStep
from tokenyard.engine.models.loader import CausalLM
from tokenyard.engine.paged_attention import AttentionMetadata, PagedAttention, as_decode_rows
from tokenyard.engine.request import Request
from tokenyard.engine.sample import Sampler, SamplingBatch, make_generator
from tokenyard.engine.sample.grammar import fill_bitmask
from tokenyard.engine.sample.prompt_logprobs import score_prompt_rows
from tokenyard.engine.scheduler import SchedulerOutput
from tokenyard.engine.spec.verify import verify_rows
from tokenyard.engine.to_device import to_device
from tokenyard.wire.outputs import TokenLogprobs

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "PreparedStep", "StepResult"]


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    #: Per request asking for prompt logprobs: (first prompt position scored, its scores).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    #: Per request that verified drafts: the tokens it keeps (engine/spec/verify.py).
    accepted: dict[str, list[int]] = field(default_factory=dict)


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
        *,
        max_num_seqs: int = 128,
        max_model_len: int = 8192,
        loras: LoraManager | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """`cache_dtype`: the KV pool's elements (None: `dtype`); `max_num_seqs` and
        `max_model_len` size the persistent batch's block tables (they grow if short);
        `loras`: the adapters whose slots the step's rows name (None: none);
        `cuda_graphs`: replay pure decode steps from CUDA graphs where they apply
        (engine/cuda_graphs.py)."""
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        graphs = (cuda_graphs and device.type == "cuda" and loras is None
                  and config.sliding_window is None)
        self.attention = PagedAttention(
            num_layers=config.num_hidden_layers,
            # With graphs, one block more than the KV manager hands out: padding rows of
            # a replayed step write their keys and values there.
            num_blocks=kv.num_blocks + (1 if graphs else 0),
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
        self.graphs: DecodeGraphs | None = None
        if graphs and self.attention.decode_kernel is not None:
            self.graphs = build_decode_graphs(
                model, self.attention, max_num_seqs, -(-max_model_len // kv.block_size) + 1,
                kv.num_blocks * kv.block_size, config.vocab_size)
        elif graphs:
            log.warning("CUDA graphs are off: they need the paged decode kernel")
        self.batch = InputBatch(kv, device, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len)
        self.sampler = Sampler()
        self.loras = loras
        self._last_sampled: dict[str, int] = {}  # the last step's tokens, for placeholders
        # The last sampling batch's requests and their parameters as tensors: reused
        # while the same requests sample, in the same order (see `_sampling_batch`).
        self._sampling_requests: list[Request] = []
        self._sampling_base: SamplingBatch | None = None
        self._min_tokens_rows: list[int] = []  # its rows whose params have min_tokens

    def execute(self, step: SchedulerOutput) -> StepResult:
        return self.run(self.prepare(step))

    @torch.inference_mode()
    def prepare(self, step: SchedulerOutput) -> PreparedStep:
        """The step's flat inputs (input_batch.py). Cheap Python: with async scheduling it
        runs while the previous step is still computing, so a pending token is a
        placeholder here."""
        loras = self.loras
        if loras is None:
            return self.batch.prepare(step, masks=self.attention.decode_kernel is None)
        prepared = self.batch.prepare(step, masks=self.attention.decode_kernel is None,
                                      lora=loras.in_use)
        prepared.lora_writes = loras.take_writes()
        return prepared

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> StepResult:
        """The forward pass and sampling of a prepared step. Steps must run in the order
        they were scheduled: a placeholder takes the token the step before sampled."""
        sample_requests = prepared.sample_requests
        hidden = self._forward(prepared, self._last_sampled)
        prompt_logprobs = {}
        if prepared.prompt_spans:
            prompt_logprobs = score_prompt_rows(hidden, self.model.compute_logits,
                                                prepared.prompt_spans)
        if not sample_requests:
            self._last_sampled = {}
            return StepResult({}, {}, prompt_logprobs)
        logits = self._logits(prepared, hidden)

        batch = self._sampling_batch(sample_requests)
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
        self._last_sampled = sampled if not accepted else {
            **sampled, **{i: kept[-1] for i, kept in accepted.items()}}
        logprobs: dict[str, TokenLogprobs] = {}
        if out.logprobs is not None:
            for i, r in enumerate(sample_requests):
                if r.params.logprobs is not None:
                    top = out.top_logprobs[i] if out.top_logprobs is not None else []
                    logprobs[r.request_id] = TokenLogprobs(out.logprobs[i], top)
        return StepResult(sampled, logprobs, prompt_logprobs, accepted=accepted)

    @torch.inference_mode()
    def greedy(self, step: SchedulerOutput, fills: dict[str, int]) -> dict[str, int]:
        """The argmax token at each sampled row of `step`, by request id: a draft model's
        proposals (spec/draft.py). A placeholder row takes the token `fills` gives its
        request. Neither the requests' samplers nor their generators are touched."""
        prepared = self.prepare(step)
        logits = self._logits(prepared, self._forward(prepared, fills))
        tokens = logits.argmax(dim=-1).tolist()
        return {r.request_id: t
                for r, t in zip(prepared.sample_requests, tokens, strict=True)}

    def _forward(self, prepared: PreparedStep, fills: dict[str, int]) -> torch.Tensor:
        """The model's hidden state at every row of `prepared`; a placeholder row takes
        the token `fills` gives its request."""
        input_ids, meta = prepared.input_ids, prepared.meta
        if prepared.fill_rows is not None:
            tokens = torch.tensor([fills[i] for i in prepared.fill_ids], dtype=torch.long)
            input_ids[prepared.fill_rows] = to_device(tokens, self.device)
        if self.loras is not None:
            if prepared.lora_writes:
                self.loras.apply(prepared.lora_writes)
            self.loras.rows.set(prepared.lora_slots)
        # Pure decode steps, and tails over a cached prefix as decode rows: the one op
        # (LoRA rows too: it adds each row's adapter).
        one_op: AttentionMetadata | None = None
        if self.decode_step is not None:
            one_op = (meta if meta.num_decodes == len(prepared.positions)
                      else as_decode_rows(meta, prepared.positions))
        if self.decode_step is not None and one_op is not None:
            return self.decode_step(input_ids, prepared.positions, one_op,
                                    prepared.lora_slots)
        graphs = self.graphs
        if graphs is not None and graphs.fits(meta, len(prepared.positions)):
            return graphs.run(input_ids, prepared.positions, meta)
        self.attention.metadata = meta
        hidden = self.model(input_ids, prepared.positions, self.attention)
        self.attention.metadata = None
        return hidden

    def _logits(self, prepared: PreparedStep, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the rows `prepared` samples."""
        if prepared.sample_index is not None:
            hidden = hidden.index_select(0, prepared.sample_index)
        return self.model.compute_logits(hidden)

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        """The sampling batch of `requests`: their parameters' tensors are made again only
        when the requests sampling (or their order) changed since the step before; what
        changes every step (bans until `min_tokens`, outputs for penalties) is fresh."""
        base = self._sampling_base
        same = (base is not None and len(requests) == len(self._sampling_requests)
                and all(map(operator.is_, requests, self._sampling_requests)))
        if base is None or not same:
            base = SamplingBatch.from_params(
                [r.params for r in requests], [self._generator(r) for r in requests],
                [r.prompt_token_ids for r in requests], device=self.device)
            self._sampling_requests, self._sampling_base = list(requests), base
            # A constrained request's grammar alone decides where EOS may come.
            self._min_tokens_rows = [i for i, r in enumerate(requests)
                                     if r.params.min_tokens > 0 and r.guided is None]
        bans = _stops_banned(requests, self._min_tokens_rows)
        logit_bias = base.logit_bias
        if bans:
            logit_bias = list(logit_bias)
            for row, banned in bans:
                logit_bias[row] = {**(logit_bias[row] or {}), **banned}
        return dataclasses.replace(
            base, logit_bias=logit_bias,
            # Only penalties read the outputs: a copy of each list, made only for them.
            output_token_ids=(base.output_token_ids if base.no_penalties
                              else [r.output_token_ids for r in requests]),
        )

    def _generator(self, request: Request) -> torch.Generator | None:
        """The request's seeded generator, made on this replica's device at first use."""
        seed = request.params.seed
        if seed is None:
            return None
        if request.generator is None or request.generator.device != self.device:
            request.generator = make_generator(seed, self.device)
        return request.generator


def _stops_banned(requests: list[Request],
                  rows: list[int]) -> list[tuple[int, dict[int, float]]]:
    """Until a request has `min_tokens` outputs, EOS and its stop token ids cannot be
    sampled (as in vLLM), rather than being sampled and then ignored: (row, -inf bias per
    banned id) for the `rows` (those with `min_tokens`) still short of them."""
    out = []
    for row in rows:
        request = requests[row]
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= request.eos_token_ids
        if banned:
            out.append((row, dict.fromkeys(banned, float("-inf"))))
    return out
