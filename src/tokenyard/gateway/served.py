"""The deployments this process serves, as the pipeline sees them.

`Served` is one deployment: its spec, its pool of replicas and, for the kinds that need
them here, its tokenizer and model facts (`kinds.build_served` makes one over its
replicas' clients, as its kind says). `Fleet` is every deployment and the router that
picks among them; the HTTP application's state extends it with what only HTTP needs, so a
fleet reload seen by the routes is seen by the pipeline too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from tokenyard.balancer.pool import Pool
from tokenyard.deployments import DeploymentSpec, FleetSpec
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.routing import Router
from tokenyard.sampling_defaults import NONE, SamplingDefaults
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.text.prepare import Preparer
from tokenyard.text.reasoning import detect_reasoning_parser, prompt_opens_reasoning
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tool_formats import detect_tool_parser
from tokenyard.wire.replica_info import ReplicaInfo


def now() -> int:
    """Seconds since the epoch (an object's `created`)."""
    return int(time.time())


def check_vocabulary(spec: DeploymentSpec, tokenizer: Tokenizer | None,
                     info: ReplicaInfo | None) -> None:
    """ValueError when the replica's model has fewer tokens than the tokenizer the prompts
    are prepared with: a replica serving another model than `model` would get ids it
    cannot embed."""
    if info is not None and tokenizer is not None and tokenizer.vocab_size > info.vocab_size:
        raise ValueError(
            f"the tokenizer of {spec.model or 'the embedded model'} has "
            f"{tokenizer.vocab_size} tokens but the replica's model {info.model} only "
            f"{info.vocab_size}: pass the replica's --model")


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

    async def learn_model_facts(self) -> None:
        """An on-demand engine's model facts, asked of its replicas once they first load
        (its window and vocabulary were unknown until then)."""
        if self.info is not None:
            return
        info = await self.pool.info()
        check_vocabulary(self.spec, self.tokenizer, info)
        self.pool.block_size = info.block_size
        self.info = info
        if self.tokenizer is not None:
            self.preparer = Preparer(self.tokenizer, self.window, self.spec.max_output_tokens,
                                     self.spec.max_tool_calls)

    @property
    def name(self) -> str:
        return self.spec.name

    def adapter(self, spec: DeploymentSpec) -> Served:
        """The deployment of one of its LoRA adapters (`spec`, named `base:adapter`):
        this one's replicas, tokenizer and model facts (`lora_spec.py`)."""
        return Served(spec, self.pool, self.created, self.tokenizer, self.info,
                      self.sampling)

    @property
    def status(self) -> str:
        """Whether its model is loaded: "loaded" (always, for one not loaded on demand),
        "loading", "unloading" or "unloaded" (`balancer/on_demand.py`)."""
        demand = self.pool.demand
        return "loaded" if demand is None else demand.state

    @property
    def kind(self) -> str:
        """Its kind's name (`gateway/kinds.py` holds what each kind does)."""
        return self.spec.kind

    @property
    def generates(self) -> bool:
        """Whether it generates text (its prompts are prepared here): not an embeddings
        model."""
        return self.preparer is not None

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
            if served.generates:
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
