"""The engine's busy loop: schedule, execute, update. No I/O and no text live here.

With async scheduling (vLLM's reference design) the loop keeps one step in flight: while
the kernels compute step N on the kernel thread, this thread schedules and prepares step
N+1 (whose inputs for the requests of step N are the tokens N is still sampling,
placeholders the runner fills in on the kernel thread) and then applies N's tokens. The
scheduler's Python then overlaps the kernels, which release the GIL. A request whose next
sampling needs the token in flight (a grammar, penalties, `min_tokens` not yet reached)
turns the overlap off for as long as it runs; a request that stops on a token in flight
has had one more token computed for nothing, as in vLLM.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from tokenyard.config import EngineConfig
from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.lora.manager import LoraManager
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.loader import CausalLM
from tokenyard.engine.request import Request
from tokenyard.engine.runner import ModelRunner, StepResult
from tokenyard.engine.sample.grammar import GrammarCompiler
from tokenyard.engine.sample.prompt_logprobs import join_scores
from tokenyard.engine.scheduler import Scheduler, SchedulerOutput
from tokenyard.engine.spec.draft import DraftConfig, DraftModel, DraftProposer, Greedy
from tokenyard.engine.spec.speculator import Speculator, may_speculate, parse_speculative_config
from tokenyard.lora_spec import lora_salt, parse_lora_modules
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import EngineCoreOutput, EngineStats

# How long an idle step waits for a compiling grammar before the loop looks at its
# commands again (seconds).
GRAMMAR_WAIT_S = 0.005

#: A launched step: what was scheduled, and its forward pass's result to come.
_InFlight = tuple[SchedulerOutput, Future[StepResult]]


def kernel_thread() -> ThreadPoolExecutor:
    """The one thread that runs an async-scheduled engine's torch work, in submission order.

    The model is built on it too: with OpenMP each thread that opens a parallel region gets
    its own worker pool, and two pools on a small CPU stop the workers spinning between
    regions (see engine/async_core.py). An executor's worker is joined before the
    interpreter tears down (a thread still exiting then aborts the process).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenyard-kernels")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA GPU")
    return torch.device(name)


def speculator(config: EngineConfig, draft: DraftProposer | None = None) -> Speculator | None:
    """The engine's speculation, from `speculative_config` (None: off); `draft`: the
    proposer of the draft model it names (EngineCore builds it)."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return None
    if not isinstance(spec, DraftConfig):
        return Speculator(spec)
    if draft is None:
        raise ValueError("speculative_config names a draft model, but none was loaded")
    return Speculator(spec, draft)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for `EngineConfig.kv_cache_dtype` ("auto": the model's)."""
    return model_dtype if name == "auto" else getattr(torch, name)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * elem
    return per_token * block_size


class EngineCore:
    """One replica's scheduler, KV cache and model runner."""

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        tokenizer: Tokenizer | None = None,
        kernels: ThreadPoolExecutor | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        """`tokenizer`: the vocabulary grammars compile against (None: no constrained
        decoding; a request with a grammar is refused). `kernels`: async scheduling, the
        forward passes run there (None: each step runs on the caller's thread). `draft`:
        the draft model `speculative_config` names, loaded (spec/draft.py)."""
        self.model_config = model_config
        self.config = config
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_gib * 2**30) // kv_block_bytes(
                model_config, config.block_size, cache_dtype
            )
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.draft_runner: ModelRunner | None = None
        proposer = None if draft is None else self._draft_proposer(
            draft, num_blocks, device, dtype, cache_dtype, kernels)
        self.loras = LoraManager(model, config.max_loras, config.max_lora_rank, device, dtype)
        for name, path in parse_lora_modules(config.lora_modules).items():
            self.loras.register(name, path)
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            # The cap is the CPU's, where a prompt token is real compute and a budget-long
            # step holds every stream. On an accelerator a step's prompt tokens cost little
            # next to its host work, and the cap only throttles admission: on an H200 it
            # let in one 256-word prompt a step, so at 256 streams requests waited ~15 s
            # with seats free (issue 37). There the budget alone bounds a step.
            prefill_chunk=config.prefill_chunk if device.type == "cpu" else None,
            max_num_seqs=config.max_num_seqs,
            max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens,
            speculator=speculator(config, proposer),
            loras=self.loras,
        )
        self.runner = ModelRunner(
            model, model_config, self.kv, device, dtype, kernel_cache_dir=config.cache_dir,
            cache_dtype=cache_dtype, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, loras=self.loras,
            cuda_graphs=config.cuda_graphs,
        )
        self.grammars: GrammarCompiler | None = None
        if tokenizer is not None:
            self.grammars = GrammarCompiler(
                tokenizer, model_config.vocab_size, tokenizer.eos_token_ids
            )
        self._compiling: list[Request] = []  # added while their grammar compiled
        self.kernels = kernels
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0

    def _draft_proposer(self, draft: DraftModel, num_blocks: int, device: torch.device,
                        dtype: torch.dtype, cache_dtype: torch.dtype,
                        kernels: ThreadPoolExecutor | None) -> DraftProposer:
        """The draft model's proposer: its own pool of as many blocks as the target's (a
        request's draft KV never outgrows its target KV), no prefix caching, and its own
        runner, whose forwards run on `kernels` where the engine has that thread."""
        config = self.config
        kv = KVCacheManager(num_blocks, config.block_size, enable_caching=False)
        runner = self.draft_runner = ModelRunner(
            draft.model, draft.config, kv, device, dtype, kernel_cache_dir=config.cache_dir,
            cache_dtype=cache_dtype, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len)
        greedy: Greedy = runner.greedy
        if kernels is not None:
            def on_kernels(step: SchedulerOutput, fills: dict[str, int]) -> dict[str, int]:
                return kernels.submit(runner.greedy, step, fills).result()
            greedy = on_kernels
        max_len = min(self.max_model_len, draft.config.max_position_embeddings)
        return DraftProposer(greedy, kv, max_len)

    def close(self) -> None:
        """Stop the kernel thread, if any (after the step in flight)."""
        if self.kernels is not None:
            self.kernels.shutdown()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @property
    def max_tokens_in_pool(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it can never fit, QueueFullError if shed."""
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        longest = request.num_prompt_tokens + (request.params.max_tokens or 0)
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context window is "
                f"{self.max_model_len}"
            )
        if min(longest, self.max_model_len) > self.max_tokens_in_pool:
            raise ValueError(
                f"request needs up to {longest} tokens of KV cache; the pool holds "
                f"{self.max_tokens_in_pool}"
            )
        request.max_model_len = self.max_model_len
        if request.lora is not None and not request.lora_slot:
            self.loras.check(request.lora)  # UnknownAdapter, a ValueError
            # Its KV is the adapter's own: never shared with the base's or another's.
            request.cache_salt = lora_salt(request.cache_salt,
                                           self.loras.cache_name(request.lora))
        guided = request.params.guided
        if guided is not None and request.guided is None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer to compile grammars with")
            request.guided = self.grammars.state(guided, request.eos_token_ids)
            if request.guided.error is not None:
                raise request.guided.error
        self.scheduler.add_request(request)
        if request.guided is not None and not request.guided.ready:
            self._compiling.append(request)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def finish_with_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_with_stop_string(request_id, stop)

    def step(self) -> list[EngineCoreOutput]:
        """Run one batch; return an output for every request that got a token (and a
        last, empty one with finish_reason "abort" for a request whose grammar failed).

        With async scheduling the batch whose outputs are returned may have been launched
        by the call before, and the next one is already launched."""
        outputs = self._check_grammars()
        if self.kernels is None:
            step = self.scheduler.schedule()
            if step.is_empty:
                self._wait_for_grammars(outputs)
                return outputs
            return outputs + self._outputs(step, self.runner.execute(step))
        if self._inflight is None:
            self._inflight = self._launch(self.kernels)
            if self._inflight is None:
                self._wait_for_grammars(outputs)
                return outputs
        step, result = self._inflight
        self._inflight = self._launch(self.kernels) if self._can_overlap() else None
        self.num_overlapped_steps += self._inflight is not None
        try:
            done = result.result()
        except BaseException:
            if self._inflight is not None:  # let the next one finish before failing
                wait([self._inflight[1]])
                self._inflight = None
            raise
        return outputs + self._outputs(step, done)

    def _launch(self, kernels: ThreadPoolExecutor) -> _InFlight | None:
        """Schedule and prepare a step here, and queue its forward pass on the kernels."""
        step = self.scheduler.schedule()
        if step.is_empty:
            return None
        prepared = self.runner.prepare(step)
        return step, kernels.submit(self.runner.run, prepared)

    def _can_overlap(self) -> bool:
        """Whether the next step may be planned before the tokens in flight are known: not
        while a running request samples from its own outputs so far (a grammar,
        penalties, stop tokens banned until `min_tokens`)."""
        speculating = self.scheduler.speculator is not None
        for request in self.scheduler.running:
            params = request.params
            if (request.guided is not None or params.has_penalties
                    or request.num_output_tokens < params.min_tokens
                    or (speculating and may_speculate(request))):  # drafts need the token
                return False
        return True

    def _wait_for_grammars(self, outputs: list[EngineCoreOutput]) -> None:
        if self._compiling and not outputs:
            # Only compiles to wait for: wait on one briefly instead of spinning.
            wait([r.guided.future for r in self._compiling if r.guided is not None],
                 timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)

    def _outputs(self, step: SchedulerOutput, result: StepResult) -> list[EngineCoreOutput]:
        for request_id, (first, scored) in result.prompt_logprobs.items():
            scoring = self.scheduler.requests.get(request_id)
            if scoring is not None:
                join_scores(scoring.prompt_logprobs, first, scored)
        outputs = []
        for request in self.scheduler.update(step, result.sampled, result.accepted):
            lp = result.logprobs.get(request.request_id)
            num_outputs = request.num_output_tokens
            first = num_outputs <= 1 and request.params.prompt_logprobs is not None
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    # The tokens the step appended; none when only the prompt was scored.
                    new_token_ids=request.all_token_ids[-request.num_new_tokens:]
                    if num_outputs else [],
                    new_logprobs=[lp] if lp is not None else None,
                    finish_reason=request.status.value if request.is_finished else None,
                    stop_reason=request.stop_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=request.prompt_logprobs if first else None,
                    **(_first_token_times(request) if num_outputs == 1 else {}),
                )
            )
        return outputs

    def _check_grammars(self) -> list[EngineCoreOutput]:
        """Forget finished compiles; abort the requests whose grammar failed to compile."""
        if not self._compiling:
            return []
        failed = []
        pending = []
        for request in self._compiling:
            assert request.guided is not None
            if request.is_finished or not request.guided.ready:
                if not request.is_finished:
                    pending.append(request)
                continue
            if request.guided.error is not None and self.scheduler.abort(request.request_id):
                failed.append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[], new_logprobs=None,
                    finish_reason=request.status.value, stop_reason=str(request.guided.error),
                    num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=0,
                ))
        self._compiling = pending
        return failed

    def stats(self) -> EngineStats:
        spec = self.scheduler.speculator
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.pool.usage,
            num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_tokens=self.scheduler.num_computed_tokens_total,
            num_pinned_kv_blocks=self.kv.num_pinned_blocks,
            num_overlapped_steps=self.num_overlapped_steps,
            num_draft_tokens=spec.num_drafts if spec is not None else 0,
            num_accepted_draft_tokens=spec.num_accepted if spec is not None else 0,
            num_evicted_kv_blocks=self.kv.pool.num_evicted,
        )


def _first_token_times(request: Request) -> dict[str, float]:
    """queue_time and prefill_time (seconds) for a request's first output, else nothing."""
    first, scheduled = request.first_token_time, request.scheduled_time
    if request.num_output_tokens != 1 or first is None or scheduled is None:
        return {}
    return {
        "queue_time": max(0.0, scheduled - request.arrival_time),
        "prefill_time": max(0.0, first - scheduled),
    }
