"""The deployments this process serves, as the pipeline sees them.

`Served` is one deployment: its spec, its pool of replicas and, for the kinds that need
them here, its tokenizer and model facts (`build_served` makes one over its replicas'
clients). `Fleet` is every deployment and the router that picks among them; the HTTP
application's state extends it with what only HTTP needs, so a fleet reload seen by the
routes is seen by the pipeline too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaClient, ReplicaError
from tokenyard.deployments import BalancerSpec, DeploymentSpec, FleetSpec
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.routing import Router
from tokenyard.sampling_defaults import NONE, SamplingDefaults
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.text.model_files import load_tokenizer, recommended_sampling
from tokenyard.text.prepare import Preparer
from tokenyard.text.reasoning import detect_reasoning_parser, prompt_opens_reasoning
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tool_formats import detect_tool_parser
from tokenyard.wire.replica_info import ReplicaInfo


def now() -> int:
    """Seconds since the epoch (an object's `created`)."""
    return int(time.time())


@dataclass(eq=False)
class Served:
    """One deployment as this process serves it: its spec, its pool of replicas and, for
    the kinds that need them here, its tokenizer and model facts."""

    spec: DeploymentSpec
    pool: Pool
    created: int
    #: The tokenizer prompts are prepared with (an upstream's: ours, for estimates).
    tokenizer: Tokenizer | None = None
    #: The engine's model facts (context window, vocabulary); None for other kinds.
    info: ReplicaInfo | None = None
    #: What a request that leaves a sampling parameter out gets (`sampling_defaults.py`):
    #: the fleet file's `defaults` over the model's recommendation.
    sampling: SamplingDefaults = NONE
    preparer: Preparer | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self.preparer = Preparer(self.tokenizer, self.window, self.spec.max_output_tokens,
                                    self.spec.max_tool_calls)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def vocab_size(self) -> int | None:
        return self.info.vocab_size if self.info is not None else None

    @property
    def tool_syntax(self) -> str:
        """The tool-call syntax its model writes (text/tool_formats.py): the fleet's
        choice, else what the chat template shows."""
        if self.spec.tool_call_parser != "auto":
            return self.spec.tool_call_parser
        return detect_tool_parser(None if self.tokenizer is None else self.tokenizer.chat_template)

    @property
    def reasoning(self) -> str | None:
        """Its reasoning parser (text/reasoning.py): the fleet's choice, else what the
        chat template shows; None: its replies have no reasoning to split."""
        choice = self.spec.reasoning_parser
        if choice == "auto":
            template = None if self.tokenizer is None else self.tokenizer.chat_template
            return detect_reasoning_parser(template)
        return None if choice == "none" else choice

    def reasoning_for(self, prompt: list[int]) -> tuple[str, bool] | None:
        """Its reasoning parser, and whether `prompt` (token ids) ends inside the block it
        opened (the reply then starts in it); None: no reasoning to split."""
        name = self.reasoning
        if name is None:
            return None
        tail = "" if self.tokenizer is None else self.tokenizer.decode(
            prompt[-8:], skip_special_tokens=False)
        return name, prompt_opens_reasoning(tail, name)

    @property
    def window(self) -> int:
        """The context window in tokens (an upstream's declared one, else unbounded)."""
        return (self.info.max_model_len if self.info is not None
                else self.spec.max_context or 1 << 20)

    async def listed_window(self) -> int | None:
        """The context window a model card states; an embeddings model's is the most
        tokens one input may have (its replica's), not the unbounded window of a
        deployment that declares none (None while no replica has answered)."""
        if self.kind != "embeddings":
            return self.window
        if self.spec.max_context is not None:
            return self.spec.max_context
        try:
            model = await self.pool.info()
        except ReplicaError:
            return None
        return getattr(model, "max_tokens", None)

    @property
    def vision(self) -> bool:
        return "vision" in self.spec.capabilities

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the tokenizer spells (at least 1): a text of
        B bytes has at least B / this many tokens, whatever the tokenizer makes of it."""
        tok = self.tokenizer
        if tok is None:
            return 1 << 10
        return max(1, max(len(tok.id_to_token_bytes(i)) for i in range(tok.vocab_size)))


@dataclass
class Fleet:
    """Every deployment this process serves, and the router that picks among them."""

    deployments: dict[str, Served]
    router: Router
    created: int
    metrics: TokenyardMetrics = field(default_factory=TokenyardMetrics)
    #: Keys, limits, billing and the ledger; None serves without authentication.
    gateway: Gateway | None = None
    #: Pools of removed deployments still finishing their requests.
    retired: list[Pool] = field(default_factory=list)
    #: A regional endpoint's region (`serve --region`; its fleet holds only that
    #: region's deployments); None: every region.
    region: str | None = None

    @property
    def default(self) -> Served:
        """The first chat deployment (what a bare `tokenyard serve` serves)."""
        for served in self.deployments.values():
            if served.kind != "embeddings":
                return served
        return next(iter(self.deployments.values()))

    @property
    def model(self) -> str:
        return self.default.name

    def replace_fleet(self, fleet: FleetSpec, deployments: dict[str, Served]) -> list[Pool]:
        """Swap in a reloaded fleet; returns the pools no deployment uses any more (the
        caller drains and closes them)."""
        kept = {id(s.pool) for s in deployments.values()}
        gone = [s.pool for s in self.deployments.values() if id(s.pool) not in kept]
        self.deployments = deployments
        self.router = Router(fleet)
        return gone


def replica_client(url: str, *, token: str | None = None) -> ReplicaClient:
    """A client of one engine replica at `url` (`token`: its shared secret)."""
    return ReplicaClient(url, token=token)


async def build_served(
    spec: DeploymentSpec,
    clients: Sequence[tuple[str, Any]],
    cache_dir: Path,
    *,
    balancer: BalancerSpec | None = None,
    affinity: AffinityTable | None = None,
    tokenizers: dict[str | None, Tokenizer] | None = None,
) -> Served:
    """One deployment over its replicas' `clients` (id, client): an engine's model facts
    are asked of its first replica that answers, and its tokenizer is loaded (in a
    thread: a GGUF read takes seconds); an upstream gets the embedded tokenizer for its
    admission estimates. `tokenizers` shares loaded tokenizers between deployments."""
    tokenizers = {} if tokenizers is None else tokenizers
    info: ReplicaInfo | None = None
    pool = Pool(spec.name, clients, balancer, affinity=affinity)
    if spec.kind == "engine":
        info = await pool.info()
        pool.block_size = info.block_size
    tokenizer = None
    if spec.kind != "embeddings":
        key = spec.model if spec.kind == "engine" else None
        if key not in tokenizers:
            tokenizers[key] = await asyncio.to_thread(load_tokenizer, key, cache_dir)
        tokenizer = tokenizers[key]
    if info is not None and tokenizer is not None and tokenizer.vocab_size > info.vocab_size:
        # A replica serving another model than `model` would get ids it cannot embed.
        raise ValueError(
            f"the tokenizer of {spec.model or 'the embedded model'} has "
            f"{tokenizer.vocab_size} tokens but the replica's model {info.model} only "
            f"{info.vocab_size}: pass the replica's --model"
        )
    sampling = spec.defaults
    if spec.kind == "engine":
        sampling = sampling.over(await asyncio.to_thread(recommended_sampling, spec.model))
    served = Served(spec, pool, now(), tokenizer, info, sampling)
    if tokenizer is not None:  # the byte bound's table, built now rather than per request
        await asyncio.to_thread(lambda: served.max_token_bytes)
    return served
