"""The fleet's shape, read from one TOML file (`tokenyard serve --config tokenyard.toml`).

A *deployment* is one served model name (dated, e.g. `smollm2-135m-instruct-2026-11-22`)
with its replicas, its capabilities, its context window and its prices. An *alias* maps a
name clients use (`smollm2`) to one deployment, or splits it between several by weight
(canary), optionally copying a share of its traffic to a *shadow* deployment whose answers
are compared and thrown away. A leaf module: plain values, no I/O beyond reading the file.

    [balancer]
    policy = "affinity"            # or "least" (least outstanding work), "round_robin"
    queue_timeout_s = 10

    [[deployments]]
    name = "smollm2-135m-instruct-2026-11-22"
    kind = "engine"                # engine | upstream | embeddings
    replicas = 2                   # local `tokenyard engine` children started by serve
    urls = ["http://10.0.0.7:8001"]  # and/or replicas already running elsewhere
    engine_args = ["--threads", "1"]
    capabilities = ["chat", "completions"]
    prices = { input = "0.10", cached_input = "0.05", output = "0.40" }  # per 1M tokens
    batch_prices = { input = "0.04", cached_input = "0.02", output = "0.16" }  # default: half
    defaults = { temperature = 0.3 }  # sampling a request leaves out (over the model's)

    [[deployments]]
    name = "qwen-2026-11-01"
    kind = "upstream"              # an OpenAI-compatible server we do not run
    urls = ["http://10.0.0.9:8000/v1"]
    region = "eu"                  # where it runs (default: none declared)
    model = "Qwen/Qwen2.5-7B-Instruct"
    server = "vllm"                # vllm | sglang | openai (any other; the default)
    token_env = "QWEN_API_KEY"     # its own key; none sent without it

    [aliases]
    smollm2 = "smollm2-135m-instruct-2026-11-22"
    [aliases.smollm2-next]
    route = { "smollm2-135m-instruct-2026-11-22" = 90, "other-2026-12-01" = 10 }
    shadow = { deployment = "candidate-2026-12-05", share = 0.05 }
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from tokenyard.fallback_spec import FallbackSpec, check_fallbacks, fallback_spec
from tokenyard.fleet_values import (  # PriceSpec: the fleet's prices, read here
    FleetConfigError,
    PriceSpec,
    a_string,
    a_table,
    a_weight,
    an_array,
    only_fields,
    opt_region,
    opt_string,
    price_spec,
)
from tokenyard.load_spec import ModelsSpec, OnDemandSpec, models_spec, on_demand_spec
from tokenyard.lora_spec import AdapterSpec, fleet_adapters, with_adapters
from tokenyard.moderation_spec import ModerationSpec, moderation_spec
from tokenyard.placement_spec import RayPlacement, ray_placement
from tokenyard.sampling_defaults import NONE, SamplingDefaults, fleet_defaults

KINDS = ("engine", "upstream", "embeddings")
#: Capabilities a deployment may declare; a request needing one goes only where declared.
CAPABILITIES = frozenset({"chat", "completions", "embeddings", "vision", "tools"})
_DEFAULT_CAPABILITIES = {
    "engine": frozenset({"chat", "completions", "tools"}),
    "upstream": frozenset({"chat", "completions"}),
    "embeddings": frozenset({"embeddings"}),
}
#: The output cap of a generating deployment whose fleet entry names none: the
#: `max_tokens` a request that sets none gets (unless less of the window is left), and
#: the most one may ask for. The embedded SmolLM2-135M decodes about 100 tokens/s for
#: one stream alone on 2 cores (half that or less when busy), so 1024 tokens end in
#: 10–20 s there; its 8k window as the default let one request at temperature 1 run
#: for minutes.
DEFAULT_MAX_OUTPUT_TOKENS = 1024
#: The most tool calls one response of a deployment may make unless its entry says:
#: a small model forced to call a tool otherwise opens call after call until the
#: output cap ends it.
DEFAULT_MAX_TOOL_CALLS = 8
#: Balancer policy names the fleet file accepts: the keys of the balancer's registry
#: (`balancer/policy.py`), which adds each policy registered there (a leaf cannot import
#: it); the built-in ones are named here too, so a file parses before the balancer loads.
POLICIES = {"affinity", "least", "precise", "round_robin"}
#: What an upstream deployment's server is (its `server` field). The ones in
#: `SALTED_SERVERS` take a per-request `cache_salt` in the OpenAI body (vLLM from 0.9,
#: SGLang from the release that added it to its OpenAI protocol), so each tenant gets its
#: own prefix cache there; any other ("openai": OpenAI itself, llama.cpp's llama-server,
#: another tokenyard, an older vLLM) shares one cache between our tenants, so the cached
#: tokens it reports are never shown to or billed as cached for a tenant.
UPSTREAM_SERVERS = ("vllm", "sglang", "openai")
SALTED_SERVERS = frozenset({"vllm", "sglang"})


@dataclass(frozen=True)
class DeploymentSpec:
    """One served model name and where it runs."""

    name: str
    kind: str = "engine"
    #: Local replica processes `tokenyard serve` starts (engine and embeddings kinds).
    replicas: int = 0
    #: Replicas already running (engine/embeddings), or the upstream's base URLs.
    urls: tuple[str, ...] = ()
    #: engine: `--model` of the local replicas; upstream: the model name it is asked for.
    model: str | None = None
    #: Extra `tokenyard engine` flags of the local replicas.
    engine_args: tuple[str, ...] = ()
    #: The environment variable holding the replicas' token or the upstream's API key
    #: (an upstream without it is sent no key: never the replicas' token).
    token_env: str | None = None
    capabilities: frozenset[str] = frozenset()
    #: The context window to enforce for upstreams (engines report their own).
    max_context: int | None = None
    prices: PriceSpec | None = None
    batch_prices: PriceSpec | None = None  # the Batch API's (None: half the live ones)
    moderation: ModerationSpec | None = None
    #: The default and the most output tokens of one request (None: the embeddings kind,
    #: which generates nothing).
    max_output_tokens: int | None = None
    #: The most tool calls one response may make (None: the embeddings kind).
    max_tool_calls: int | None = None
    #: upstream: which server it is (one of UPSTREAM_SERVERS); None for other kinds.
    server: str | None = None
    #: The fleet file's `defaults`: sampling a request that sets none gets (over the
    #: model's own recommendation; `sampling_defaults.py`).
    defaults: SamplingDefaults = NONE
    #: Where it runs (an upstream: the region of the endpoint it calls): only orgs allowed
    #: that region reach it, and `serve --region R` serves only R's. None: declared
    #: nowhere, so it serves only orgs that are not bound to regions.
    region: str | None = None
    #: Replicas placed as Ray actors (`placement_spec.py`); None: local or listed.
    ray: RayPlacement | None = None
    #: engine: its tool-call and reasoning parsers (config.TOOL_CALL_PARSERS /
    #: REASONING_PARSERS, "none": no reasoning); "auto": from the model's chat template.
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    #: Where its requests go when it fails before their first byte (`fallback_spec.py`).
    fallbacks: FallbackSpec | None = None
    #: engine: its LoRA adapters (`lora_spec.py`); an adapter's own deployment
    #: (`base:adapter`) names its base (`parent`) and the adapter (`lora`).
    adapters: tuple[AdapterSpec, ...] = ()
    parent: str | None = None
    lora: str | None = None
    #: Its local replicas start on its first request and stop when idle
    #: (`load_spec.py`); None: they run from the start.
    on_demand: OnDemandSpec | None = None

    @property
    def salts_cache(self) -> bool:
        """Whether the upstream keeps a prefix cache per `cache_salt` we send."""
        return self.server in SALTED_SERVERS

    def token(self) -> str | None:
        """The secret named by `token_env`, read now (reloads see a changed value)."""
        return os.environ.get(self.token_env) if self.token_env else None


@dataclass(frozen=True)
class ShadowSpec:
    deployment: str
    share: float


@dataclass(frozen=True)
class AliasSpec:
    """A client-facing name: weighted targets (one target is a plain alias)."""

    name: str
    routes: tuple[tuple[str, float], ...]
    shadow: ShadowSpec | None = None
    fallbacks: FallbackSpec | None = None


@dataclass(frozen=True)
class BalancerSpec:
    policy: str = "affinity"
    #: How long a request waits at the balancer when every replica is full.
    queue_timeout_s: float = 5.0
    #: Requests that may wait at once per deployment; beyond it, 503 at once.
    queue_max: int = 256
    health_interval_s: float = 1.0
    #: Consecutive failures (connection errors, 5xx) before a replica is ejected.
    eject_after: int = 3
    #: First ejection's length; doubled for each ejection in a row, capped at 60 s.
    eject_base_s: float = 2.0
    #: Entries of the in-process prefix-affinity table.
    affinity_entries: int = 200_000
    #: How often `dns+` URLs (and Ray's replicas) are looked up again; the DNS server
    #: asked (`host[:port]`; None: the system resolver).
    discovery_interval_s: float = 5.0
    dns_server: str | None = None


@dataclass(frozen=True)
class FleetSpec:
    deployments: Mapping[str, DeploymentSpec]
    aliases: Mapping[str, AliasSpec] = field(default_factory=dict)
    balancer: BalancerSpec = BalancerSpec()
    #: The host's budget of resident on-demand models (`load_spec.py`).
    models: ModelsSpec = field(default_factory=ModelsSpec)
    #: The file it came from (None: built from flags).
    path: Path | None = None

    def names(self) -> list[str]:
        return [*self.deployments, *self.aliases]


# ---------------------------------------------------------------------------- reading


def load_fleet(path: Path) -> FleetSpec:
    """Read and check a fleet file; FleetConfigError names what is wrong."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FleetConfigError(f"{path}: {exc}") from None
    return parse_fleet(raw, Path(path))


def parse_fleet(raw: Mapping[str, Any], path: Path | None = None) -> FleetSpec:
    """A FleetSpec from a decoded TOML document."""
    only_fields(raw, {"deployments", "aliases", "balancer", "models"}, "the file")
    items = raw.get("deployments", [])
    if not isinstance(items, list) or not items:
        raise FleetConfigError("'deployments' must be a non-empty array of tables")
    deployments: dict[str, DeploymentSpec] = {}
    for i, item in enumerate(items):
        spec = _deployment(item, f"deployments[{i}]")
        if spec.name in deployments:
            raise FleetConfigError(f"deployments[{i}].name: '{spec.name}' is defined twice")
        deployments[spec.name] = spec
    deployments = with_adapters(deployments)
    aliases = {name: _alias(name, value, deployments)
               for name, value in a_table(raw.get("aliases", {}), "aliases").items()}
    check_fallbacks(deployments, aliases)
    return FleetSpec(deployments, aliases, _balancer(raw.get("balancer", {})),
                     models_spec(raw.get("models", {})), path)


def single_fleet(
    name: str, *, replicas: int = 1, urls: Sequence[str] = (), model: str | None = None,
    engine_args: Sequence[str] = (), embeddings: str | None = None,
    embedding_replicas: int = 1, policy: str = "affinity", queue_timeout_s: float = 5.0,
    max_output_tokens: int | None = None, tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> FleetSpec:
    """The fleet of `tokenyard serve` without a file: one engine deployment (`replicas`
    local children, or the running `urls`; `max_output_tokens` its output cap, by
    default DEFAULT_MAX_OUTPUT_TOKENS), plus the embeddings pool unless None."""
    deployments = {name: DeploymentSpec(
        name, "engine", replicas=0 if urls else replicas, urls=tuple(urls), model=model,
        engine_args=tuple(engine_args), capabilities=_DEFAULT_CAPABILITIES["engine"],
        max_output_tokens=max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
        max_tool_calls=DEFAULT_MAX_TOOL_CALLS, tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )}
    if embeddings is not None:
        deployments[embeddings] = DeploymentSpec(
            embeddings, "embeddings", replicas=embedding_replicas,
            engine_args=("--threads", "1"),
            capabilities=_DEFAULT_CAPABILITIES["embeddings"],
        )
    return FleetSpec(deployments, {}, BalancerSpec(policy=policy,
                                                   queue_timeout_s=queue_timeout_s))


def _deployment(item: Any, where: str) -> DeploymentSpec:
    item = a_table(item, where)
    item, limits = _output_limits(item, where)
    item, ray = ray_placement(item, where)
    item, tool_parser, reasoning_parser = parser_choice(item, where)
    item, fallbacks = fallback_spec(item, where)
    item, adapters = fleet_adapters(item, where)
    item, on_demand = on_demand_spec(item, where)
    only_fields(item, {"name", "kind", "replicas", "urls", "model", "engine_args", "token_env",
                 "capabilities", "max_context", "prices", "batch_prices", "moderation",
                 "server", "defaults", "region"}, where)
    name = a_string(item.get("name"), f"{where}.name")
    kind = item.get("kind", "engine")
    if kind not in KINDS:
        raise FleetConfigError(f"{where}.kind: one of {', '.join(KINDS)}, not {kind!r}")
    replicas = item.get("replicas", 0)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= 64:
        raise FleetConfigError(f"{where}.replicas: an integer from 0 to 64")
    urls = tuple(a_string(u, f"{where}.urls[]")
                 for u in an_array(item.get("urls", []), f"{where}.urls"))
    for url in urls:  # dns+http://NAME:PORT: every address of NAME (balancer/discovery.py)
        if not url.removeprefix("dns+").startswith(("http://", "https://")):
            raise FleetConfigError(f"{where}.urls: {url!r} is not an http(s) URL")
    if kind == "upstream" and replicas:
        raise FleetConfigError(f"{where}.replicas: an upstream has no local replicas; "
                               "list its base URLs in 'urls'")
    if not replicas and not urls and ray is None:
        raise FleetConfigError(f"{where}: needs 'replicas' (local) or 'urls' (running)")
    if on_demand is not None and not replicas:
        raise FleetConfigError(f"{where}.load: \"on_demand\" needs 'replicas' >= 1 (the "
                               "local replicas it starts)")
    if kind == "embeddings" and "defaults" in item:
        raise FleetConfigError(f"{where}.defaults: an embeddings deployment samples nothing")
    if kind == "upstream" and not item.get("model"):
        raise FleetConfigError(f"{where}.model: an upstream needs the model name to ask for")
    server = item.get("server", "openai" if kind == "upstream" else None)
    if server is not None and kind != "upstream":
        raise FleetConfigError(f"{where}.server: only an upstream deployment names its "
                               "server")
    if server is not None and server not in UPSTREAM_SERVERS:
        raise FleetConfigError(f"{where}.server: one of {', '.join(UPSTREAM_SERVERS)} "
                               f"(vllm and sglang keep each tenant's prefix cache apart; "
                               f"openai is any other OpenAI-compatible server), "
                               f"not {server!r}")
    caps = frozenset(a_string(c, f"{where}.capabilities[]")
                     for c in an_array(item.get("capabilities", []), f"{where}.capabilities"))
    unknown = caps - CAPABILITIES
    if unknown:
        raise FleetConfigError(f"{where}.capabilities: unknown {sorted(unknown)}; "
                               f"known: {sorted(CAPABILITIES)}")
    max_context = item.get("max_context")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise FleetConfigError(f"{where}.max_context: a positive integer")
    return DeploymentSpec(
        name=name, kind=kind, replicas=replicas, urls=urls,
        model=opt_string(item.get("model"), f"{where}.model"),
        engine_args=tuple(a_string(a, f"{where}.engine_args[]")
                          for a in an_array(item.get("engine_args", []), f"{where}.engine_args")),
        token_env=opt_string(item.get("token_env"), f"{where}.token_env"),
        capabilities=caps or _DEFAULT_CAPABILITIES[kind], max_context=max_context,
        prices=price_spec(item["prices"], f"{where}.prices") if "prices" in item else None,
        batch_prices=(price_spec(item["batch_prices"], f"{where}.batch_prices")
                      if "batch_prices" in item else None),
        moderation=(moderation_spec(item["moderation"], f"{where} ({name}).moderation")
                    if "moderation" in item else None),
        server=server, region=opt_region(item.get("region"), f"{where}.region"), ray=ray,
        defaults=(fleet_defaults(item["defaults"], f"{where}.defaults")
                  if "defaults" in item else NONE),
        tool_call_parser=tool_parser, reasoning_parser=reasoning_parser,
        fallbacks=fallbacks, adapters=adapters, on_demand=on_demand, **limits,
    )


def parser_choice(item: dict[str, Any], where: str) -> tuple[dict[str, Any], str, str]:
    """`item` without `tool_call_parser` / `reasoning_parser`, and those two checked
    ("auto" where absent)."""
    known = {"tool_call_parser": ("auto", *TOOL_CALL_PARSERS),
             "reasoning_parser": ("auto", "none", *REASONING_PARSERS)}
    chosen = []
    for key, names in known.items():
        value = item.get(key, "auto")
        if value not in names:
            raise FleetConfigError(f"{where}.{key}: one of {', '.join(names)}, not {value!r}")
        chosen.append(str(value))
    return {k: v for k, v in item.items() if k not in known}, chosen[0], chosen[1]


def _output_limits(item: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`item` without its output limits, and the limits (`max_output_tokens`,
    `max_tool_calls`) as DeploymentSpec fields: a generating kind's, defaults filled in;
    the embeddings kind generates nothing and may set neither."""
    names = ("max_output_tokens", "max_tool_calls")
    rest = {k: v for k, v in item.items() if k not in names}
    if item.get("kind", "engine") == "embeddings":
        for key in names:
            if key in item:
                raise FleetConfigError(f"{where}.{key}: an embeddings deployment "
                                       "generates no output")
        return rest, {}
    limits = {}
    for key, default, most in (("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS, 1 << 20),
                               ("max_tool_calls", DEFAULT_MAX_TOOL_CALLS, 1024)):
        value = item.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise FleetConfigError(f"{where}.{key}: an integer from 1 to {most}, "
                                   f"not {value!r}")
        limits[key] = value
    return rest, limits


def _alias(name: str, value: Any, deployments: Mapping[str, DeploymentSpec]) -> AliasSpec:
    where = f"aliases.{name}"
    if name in deployments:
        raise FleetConfigError(f"{where}: an alias may not reuse a deployment's name")
    shadow = fallbacks = None
    if isinstance(value, str):
        routes: tuple[tuple[str, float], ...] = ((value, 1.0),)
    else:
        table, fallbacks = fallback_spec(a_table(value, where), where)
        only_fields(table, {"route", "shadow"}, where)
        weights = a_table(table.get("route"), f"{where}.route")
        routes = tuple((target, a_weight(w, f"{where}.route.{target}"))
                       for target, w in weights.items())
        if not routes or sum(w for _, w in routes) <= 0:
            raise FleetConfigError(f"{where}.route: at least one target with a weight > 0")
        if "shadow" in table:
            s = a_table(table["shadow"], f"{where}.shadow")
            only_fields(s, {"deployment", "share"}, f"{where}.shadow")
            share = a_weight(s.get("share", 1.0), f"{where}.shadow.share")
            if share > 1:
                raise FleetConfigError(f"{where}.shadow.share: a fraction from 0 to 1")
            shadow = ShadowSpec(a_string(s.get("deployment"), f"{where}.shadow.deployment"), share)
    for target in [t for t, _ in routes] + ([shadow.deployment] if shadow else []):
        if target not in deployments:
            raise FleetConfigError(f"{where}: '{target}' is not a deployment")
    return AliasSpec(name, routes, shadow, fallbacks)


def _balancer(value: Any) -> BalancerSpec:
    table = a_table(value, "balancer")
    known = set(BalancerSpec.__dataclass_fields__)
    only_fields(table, known, "balancer")
    spec = BalancerSpec(**table)
    if spec.policy not in POLICIES:
        raise FleetConfigError(f"balancer.policy: one of {', '.join(sorted(POLICIES))}")
    for name in ("queue_timeout_s", "health_interval_s", "eject_base_s",
                 "discovery_interval_s"):
        value = getattr(spec, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise FleetConfigError(f"balancer.{name}: a non-negative number of seconds")
    for name in ("queue_max", "eject_after", "affinity_entries"):
        if not isinstance(getattr(spec, name), int) or getattr(spec, name) < 1:
            raise FleetConfigError(f"balancer.{name}: a positive integer")
    if not isinstance(spec.dns_server, str | None):
        raise FleetConfigError("balancer.dns_server: a DNS server's host[:port]")
    return spec

