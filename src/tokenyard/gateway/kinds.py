"""Every kind of deployment the gateway serves, in one registry (`KINDS`).

A `Kind` holds what the gateway needs to know of one kind, so that nothing else branches
on its name: the client of one of its replicas and the command line that runs one
locally; what serving it needs (its model's tokenizer, the embedded one for admission
estimates, or none; its engine's model facts); where a request's tools go; and how it
opens a request's generations and the token spelling their logprobs use. `build_served`
makes a deployment of any kind from this. Adding a kind is one entry here (and its name
in `deployments.KINDS`, which the fleet file's parser checks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.embeddings_client import EmbeddingsClient
from tokenyard.balancer.generation import Generation
from tokenyard.balancer.member_clients import MemberClient
from tokenyard.balancer.on_demand import OnDemand
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaClient, ReplicaError
from tokenyard.balancer.upstream import UpstreamClient
from tokenyard.balancer.upstream_generation import TokenTable, UpstreamGeneration
from tokenyard.deployments import BalancerSpec, DeploymentSpec
from tokenyard.gateway.call import Generating
from tokenyard.gateway.served import Served, check_vocabulary, now
from tokenyard.lora_spec import lora_modules_arg
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage
from tokenyard.text.model_files import load_tokenizer, recommended_sampling
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tools import ToolUse
from tokenyard.wire.protocol import Pin
from tokenyard.wire.sampling_params import SamplingParams


@dataclass(frozen=True)
class Opening:
    """One generation to open: one prompt of an admitted request, or of its shadow copy."""

    request_id: str
    #: The prompt's token ids (an upstream's: our estimate of its length).
    prompt: list[int]
    params: SamplingParams
    #: The chat messages, or the prompt's text: what an upstream is sent.
    messages: Sequence[TemplateMessage] | None = None
    text: str | None = None
    pins: Sequence[Pin] = ()
    #: Tools an upstream gets in its body.
    tools: ToolUse | None = None
    cache_salt: str | None = None
    priority: int = 0
    timeline: Timeline | None = None
    metrics: TokenyardMetrics | None = None
    #: False: an upstream's 429 ends the attempt at once (it has a fallback to go to)
    #: rather than waiting in the pool's queue.
    queues: bool = True


@dataclass
class Opened:
    """A request's generations on one deployment, and how their logprobs' token ids are
    spelled (the formats' `token_bytes`)."""

    gens: list[Generating]
    token_bytes: Callable[[int], bytes]


class Kind:
    """One kind of deployment; the registry's entries override what differs."""

    name: str = ""
    #: It generates text: its prompts are prepared here, with a tokenizer
    #: (`tokenizer_model`).
    generates: bool = True
    #: Its engine's model facts (window, vocabulary, block size, recommended sampling)
    #: are asked of its first replica that answers.
    model_facts: bool = False
    #: Its replicas are ours: they share the replica token (an upstream is someone
    #: else's server and gets its own key or none).
    own_replicas: bool = True
    #: A request's active tools go in the upstream's body, not into the prompt.
    passes_tools_on: bool = False

    def client(self, spec: DeploymentSpec, url: str, token: str | None) -> MemberClient:
        """The client of one of its replicas at `url`."""
        return replica_client(url, token=token)

    def tokenizer_model(self, spec: DeploymentSpec) -> str | None:
        """The model whose tokenizer its prompts are prepared with (None: the embedded
        model's)."""
        return spec.model

    def replica_command(self, spec: DeploymentSpec, engine_args: Sequence[str]) -> list[str]:
        """The `tokenyard` command line that runs one of its replicas as a local child
        (`engine_args`: serve's engine flags)."""
        model = ["--model", spec.model] if spec.model and "--model" not in engine_args else []
        return ["engine", *engine_args, *spec.engine_args, *model,
                *lora_modules_arg(spec.adapters)]

    def open(self, served: Served, openings: Sequence[Opening]) -> Opened:
        """`openings`' generations on `served`, not yet started."""
        tokenizer = served.tokenizer
        assert tokenizer is not None  # built with its model's tokenizer
        return Opened([Generation(
            served.pool, tokenizer, o.request_id, o.prompt, o.params, timeline=o.timeline,
            metrics=o.metrics, cache_salt=o.cache_salt, priority=o.priority, pins=o.pins,
            lora=served.spec.lora,
        ) for o in openings], tokenizer.id_to_token_bytes)

    def takes_copy(self, shadow: Served, primary: Served, messages: object,
                   texts: Sequence[str | None] | None) -> bool:
        """Whether `shadow` of this kind can run a copy of `primary`'s request: an engine
        takes the token ids when its vocabulary is the primary's tokenizer's."""
        return (shadow.tokenizer is not None and primary.tokenizer is not None
                and shadow.tokenizer.vocab_size == primary.tokenizer.vocab_size)

    async def listed_window(self, served: Served) -> int | None:
        """The context window its model card states."""
        return served.window


class Upstream(Kind):
    """An external OpenAI-compatible server: it tokenizes, samples and counts itself."""

    name = "upstream"
    own_replicas = False
    passes_tools_on = True

    def client(self, spec: DeploymentSpec, url: str, token: str | None) -> MemberClient:
        return UpstreamClient(url, api_key=token, model=spec.model or spec.name,
                              deployment=spec.name, salts_cache=spec.salts_cache)

    def tokenizer_model(self, spec: DeploymentSpec) -> str | None:
        """The embedded model's tokenizer, for admission estimates (the upstream counts
        for real)."""
        return None

    def replica_command(self, spec: DeploymentSpec, engine_args: Sequence[str]) -> list[str]:
        raise ValueError(f"deployment {spec.name}: an upstream has no local replicas")

    def open(self, served: Served, openings: Sequence[Opening]) -> Opened:
        table = TokenTable()  # one per request: its generations' logprobs share the ids
        return Opened([UpstreamGeneration(
            served.pool, o.request_id, messages=o.messages,
            prompt=None if o.messages is not None else o.text, params=o.params,
            model=served.spec.model or served.name, timeline=o.timeline, metrics=o.metrics,
            prompt_tokens_estimate=len(o.prompt), tokens=table, tools=o.tools,
            cache_salt=o.cache_salt, queues=o.queues,
        ) for o in openings], table)

    def takes_copy(self, shadow: Served, primary: Served, messages: object,
                   texts: Sequence[str | None] | None) -> bool:
        """An upstream takes the messages, or every prompt's text."""
        return messages is not None or (texts is not None and None not in texts)


class Embeddings(Kind):
    """An embeddings model's replicas (`tokenyard embed`): it tokenizes its own input."""

    name = "embeddings"
    generates = False

    def client(self, spec: DeploymentSpec, url: str, token: str | None) -> MemberClient:
        return EmbeddingsClient(url, token=token)

    def replica_command(self, spec: DeploymentSpec, engine_args: Sequence[str]) -> list[str]:
        return ["embed", *spec.engine_args]

    def open(self, served: Served, openings: Sequence[Opening]) -> Opened:
        raise AssertionError("an embeddings deployment opens no generations")

    def takes_copy(self, shadow: Served, primary: Served, messages: object,
                   texts: Sequence[str | None] | None) -> bool:
        return False

    async def listed_window(self, served: Served) -> int | None:
        """The most tokens one input may have (its replica's), not the unbounded window of
        a deployment that declares none (None while no replica has answered)."""
        if served.spec.max_context is not None:
            return served.spec.max_context
        try:
            model = await served.pool.embeddings_model()
        except ReplicaError:
            return None
        return model.max_tokens


class Engine(Kind):
    """Our own engine's replicas (`tokenyard engine`): token ids in, deltas out."""

    name = "engine"
    model_facts = True

    async def listed_window(self, served: Served) -> int | None:
        """Its replicas' window; None before an on-demand model's first load (unless its
        entry declares `max_context`)."""
        return served.window if served.info is not None or served.spec.max_context else None


#: Kind name (a deployment's `kind`) -> its kind.
KINDS: dict[str, Kind] = {kind.name: kind for kind in (Engine(), Upstream(), Embeddings())}


def replica_client(url: str, *, token: str | None = None) -> ReplicaClient:
    """A client of one engine replica at `url` (`token`: its shared secret)."""
    return ReplicaClient(url, token=token)


def kind_of(spec: DeploymentSpec) -> Kind:
    """The kind of deployment `spec`; ValueError naming the known ones if there is none
    (the fleet file's parser refuses it before)."""
    found = KINDS.get(spec.kind)
    if found is None:
        raise ValueError(f"unknown deployment kind {spec.kind!r}; known: {sorted(KINDS)}")
    return found


async def build_served(
    spec: DeploymentSpec,
    clients: Sequence[tuple[str, MemberClient]],
    cache_dir: Path,
    *,
    balancer: BalancerSpec | None = None,
    affinity: AffinityTable | None = None,
    tokenizers: dict[str | None, Tokenizer] | None = None,
    demand: OnDemand | None = None,
) -> Served:
    """One deployment over its replicas' `clients` (id, client), with what its kind needs:
    an engine's model facts are asked of its first replica that answers, and its
    tokenizer is loaded (in a thread: a GGUF read takes seconds); an upstream gets the
    embedded tokenizer for its admission estimates. `tokenizers` shares loaded
    tokenizers between deployments. `demand`: it is loaded on demand, so its model's
    facts are learnt at its first load (until then its declared `max_context`, if any,
    is its window)."""
    kind = kind_of(spec)
    tokenizers = {} if tokenizers is None else tokenizers
    pool = Pool(spec.name, clients, balancer, affinity=affinity)
    info = None
    if kind.model_facts and demand is None:
        info = await pool.info()
        pool.block_size = info.block_size
    tokenizer = None
    if kind.generates:
        key = kind.tokenizer_model(spec)
        if key not in tokenizers:
            tokenizers[key] = await asyncio.to_thread(load_tokenizer, key, cache_dir)
        tokenizer = tokenizers[key]
    check_vocabulary(spec, tokenizer, info)
    sampling = spec.defaults
    if kind.model_facts:
        sampling = sampling.over(await asyncio.to_thread(recommended_sampling, spec.model))
    served = Served(spec, pool, now(), tokenizer, info, sampling)
    if demand is not None:
        pool.load_on_demand(demand)
        if kind.model_facts:
            demand.after_load = served.learn_model_facts
    if tokenizer is not None:  # the byte bound's table, built now rather than per request
        await asyncio.to_thread(lambda: served.max_token_bytes)
    return served
