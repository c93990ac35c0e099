"""Stage 9: which deployment serves a request.

- An alias resolves to a deployment; with several weighted targets (a canary) the choice
  is sticky per conversation: the hash of its first user message picks the same target
  every turn, so one conversation never flips between model versions mid-way.
- A shadow share copies that fraction of the alias's traffic (again by conversation hash,
  independent of the canary's draw) to another deployment in the background.
- Capabilities: a request that needs tools, images or embeddings that a deployment does
  not declare is refused (400 naming the parameter) rather than sent where it cannot be
  served; an upstream's declared `max_context` is its prepare stage's window, so a longer
  request gets the usual context_length_exceeded.
- A LoRA adapter is a deployment of its own, `base:adapter` (`lora_spec.py`); an alias of
  the base reaches it as `alias:adapter` (the adapter of the deployment the alias draws).
- Regions (`gateway/regions.py`): a key bound to regions reaches only deployments in them;
  an alias draws among its targets there, and copies to a shadow only there.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from tokenyard.deployments import AliasSpec, DeploymentSpec, FleetSpec
from tokenyard.errors import APIError, model_not_found
from tokenyard.gateway.regions import outside_regions
from tokenyard.lora_spec import split_adapter

_CAPABILITY_WORDS = {
    "chat": "chat completions",
    "completions": "text completions",
    "embeddings": "embeddings",
    "vision": "image input",
    "tools": "tools",
}


@dataclass(frozen=True)
class Route:
    """The deployment that serves a request, and the one its shadow copy goes to."""

    deployment: str
    #: The alias the client named (None: it named the deployment itself).
    alias: str | None = None
    shadow: str | None = None
    #: The region of the deployment (None: it declares none).
    region: str | None = None


def conversation_key(first_user_text: str | None) -> float:
    """A number in [0, 1) fixed by the conversation's first user message (random when
    there is none: a request without a conversation has nothing to stick to)."""
    if not first_user_text:
        return secrets.randbits(53) / (1 << 53)
    digest = hashlib.blake2b(first_user_text.encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / (1 << 53)


def _pick(routes: Sequence[tuple[str, float]], point: float) -> str:
    total = sum(weight for _, weight in routes)
    edge = 0.0
    for target, weight in routes:
        edge += weight / total
        if point < edge:
            return target
    return routes[-1][0]


class Router:
    """Names → deployments, over one fleet spec (replaced whole on reload)."""

    def __init__(self, fleet: FleetSpec) -> None:
        self.fleet = fleet
        #: (alias, allowed regions) → the alias's targets in them and whether its shadow
        #: is there too: computed once per pair (the router is replaced on reload).
        self._within: dict[tuple[str, frozenset[str]],
                           tuple[tuple[tuple[str, float], ...], bool]] = {}

    def resolve(self, model: str, key: float,
                allowed: frozenset[str] | None = None) -> Route:
        """The route of a request for `model`; `key` from `conversation_key`; `allowed`:
        the regions the key may be served in (None: any). 404 for a name that is neither
        a deployment nor an alias; 403 naming the region when none of its deployments is
        in an allowed region."""
        fleet = self.fleet
        spec = fleet.deployments.get(model)
        if spec is not None:
            if allowed is not None and spec.region not in allowed:
                raise outside_regions(model, {spec.region}, allowed)
            return Route(model, region=spec.region)
        alias = fleet.aliases.get(model)
        if alias is None:
            return self._alias_adapter(model, key, allowed)
        routes, shadowed = (alias.routes, True) if allowed is None else self._allowed(
            alias, allowed)
        target = _pick(routes, key)
        shadow = None
        if shadowed and alias.shadow is not None and alias.shadow.deployment != target:
            # A second, independent point of the same conversation: the shadow share is
            # not correlated with the canary's split.
            point = (key * 7919.0) % 1.0
            if point < alias.shadow.share:
                shadow = alias.shadow.deployment
        return Route(target, model, shadow, fleet.deployments[target].region)

    def _alias_adapter(self, model: str, key: float,
                       allowed: frozenset[str] | None) -> Route:
        """`alias:adapter`: the adapter of the deployment the alias routes to (404 when
        that deployment has no such adapter, or `model` is no such name)."""
        base, adapter = split_adapter(model)
        if adapter is None or base not in self.fleet.aliases:
            raise model_not_found(model)
        target = f"{self.resolve(base, key, allowed).deployment}:{adapter}"
        spec = self.fleet.deployments.get(target)
        if spec is None or spec.lora is None:
            raise model_not_found(model)
        return Route(target, model, region=spec.region)

    def _allowed(self, alias: AliasSpec, allowed: frozenset[str]
                 ) -> tuple[tuple[tuple[str, float], ...], bool]:
        """The alias's weighted targets in `allowed` (403 if none) and whether its shadow
        deployment is there too."""
        found = self._within.get((alias.name, allowed))
        if found is None:
            specs = self.fleet.deployments
            routes = tuple((t, w) for t, w in alias.routes
                           if w > 0 and specs[t].region in allowed)
            shadow = alias.shadow
            found = (routes, shadow is not None and specs[shadow.deployment].region in allowed)
            if len(self._within) < 4096:
                self._within[alias.name, allowed] = found
        if not found[0]:
            raise outside_regions(alias.name, {self.fleet.deployments[t].region
                                               for t, _ in alias.routes}, allowed)
        return found

    def spec(self, name: str) -> DeploymentSpec:
        return self.fleet.deployments[name]


def require(spec: DeploymentSpec, capability: str, param: str | None = None) -> None:
    """400 unless the deployment declares `capability`."""
    if capability not in spec.capabilities:
        raise APIError(
            400, f"The model `{spec.name}` does not support "
                 f"{_CAPABILITY_WORDS.get(capability, capability)}.",
            param=param, code="model_not_supported" if param is None else
            "unsupported_parameter",
        )

