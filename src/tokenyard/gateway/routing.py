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
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from tokenyard.deployments import AliasSpec, DeploymentSpec, FleetSpec
from tokenyard.errors import APIError, model_not_found

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


def conversation_key(first_user_text: str | None) -> float:
    """A number in [0, 1) fixed by the conversation's first user message (random when
    there is none: a request without a conversation has nothing to stick to)."""
    if not first_user_text:
        return secrets.randbits(53) / (1 << 53)
    digest = hashlib.blake2b(first_user_text.encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / (1 << 53)


def _pick(alias: AliasSpec, point: float) -> str:
    total = sum(weight for _, weight in alias.routes)
    edge = 0.0
    for target, weight in alias.routes:
        edge += weight / total
        if point < edge:
            return target
    return alias.routes[-1][0]


class Router:
    """Names → deployments, over one fleet spec (replaced whole on reload)."""

    def __init__(self, fleet: FleetSpec) -> None:
        self.fleet = fleet

    def resolve(self, model: str, key: float) -> Route:
        """The route of a request for `model`; `key` from `conversation_key`. 404 for a
        name that is neither a deployment nor an alias."""
        fleet = self.fleet
        if model in fleet.deployments:
            return Route(model)
        alias = fleet.aliases.get(model)
        if alias is None:
            raise model_not_found(model)
        target = _pick(alias, key)
        shadow = None
        if alias.shadow is not None and alias.shadow.deployment != target:
            # A second, independent point of the same conversation: the shadow share is
            # not correlated with the canary's split.
            point = (key * 7919.0) % 1.0
            if point < alias.shadow.share:
                shadow = alias.shadow.deployment
        return Route(target, model, shadow)

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

