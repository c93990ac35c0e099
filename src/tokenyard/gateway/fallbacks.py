"""Fallbacks: a request that fails where it was routed, before the first byte of its
answer, is tried on the next candidate.

The candidates are the name the client asked for, then the request's own list
(OpenRouter's `models`, Anthropic's `fallbacks`) or, without one, the fleet file's
`fallbacks` of that name: an alias's own, else those of the deployment it routed to
(`fallback_spec.py`). The chain is that one list: a candidate's own fallbacks are not
followed.

Each candidate is a whole attempt through the pipeline (`Pipeline.route`, then
`Pipeline.serve`): routed, with the key's model scope and regions checked; prepared for
that deployment (its window, its template); admitted with its own hold at its own price
(the key's RPM counts the request once, at its first admitted attempt: `Call.counted`;
its TPM keeps only what served, a failed attempt's reservation given back); moderated;
started. An attempt ends the chain unless it failed on a condition of the
failed candidate's `fallback_on` (rate_limit, server_error, timeout, context_length,
content_policy): then its hold is released unbilled and the next candidate is tried. A
candidate the key may not use (its scope, its regions, its context cap), or one that
cannot serve the request (a capability it lacks), is skipped. The first byte ends the
choice: once an attempt's generations started, the request is that deployment's, and a
stream that breaks after it is that stream's error, never a switch.

Every attempt is kept on the call (`Attempt`: the name, the deployment, how it ended,
its error code) for the request record, when the request had a chain. What the client
gets when every candidate failed is the last attempted candidate's error (the first
one's when all were skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tokenyard.errors import APIError, model_not_found
from tokenyard.fallback_spec import FallbackSpec
from tokenyard.gateway.moderation import CONTENT_POLICY_VIOLATION
from tokenyard.gateway.regions import REGION_NOT_ALLOWED
from tokenyard.gateway.served import Fleet, Served

#: Error codes of a candidate the request may not use or that cannot serve it: skipped.
SKIPPED = frozenset({"model_not_in_scope", REGION_NOT_ALLOWED, "context_over_scope",
                     "model_not_supported", "model_not_found"})
#: Error codes of a content-policy refusal (input moderation's; an upstream's).
CONTENT_POLICY = frozenset({CONTENT_POLICY_VIOLATION, "content_filter"})
_DEFAULT = FallbackSpec()
_Run = TypeVar("_Run", covariant=True)


@dataclass(frozen=True)
class Fallback:
    """A candidate the request names: a deployment or an alias, where the request names
    it (`param`: its place, for a 404), and the dialect's prompt work for it when it is
    not the request's own (an Anthropic entry's `max_tokens`)."""

    model: str
    param: str = "models"
    #: The pipeline's `Build` (None: the request's own).
    build: Callable[..., Any] | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One candidate tried: the name, the deployment it routed to (None: not that far),
    how it ended ("served": it started answering; "failed"; "skipped"), and the code of
    the error that ended or skipped it."""

    model: str
    deployment: str | None
    outcome: str
    error_code: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "deployment": self.deployment,
                "outcome": self.outcome, "error_code": self.error_code}


class Call(Protocol):
    """What the loop reads and sets of the pipeline's `Call`."""

    model: str
    fallbacks: Sequence[Fallback]
    attempts: list[Attempt] | None
    #: The deployment routing chose (set before the key's scope is checked on it).
    served: Served | None

    @property
    def build(self) -> Callable[..., Any]: ...

    def retarget(self, model: str, build: Callable[..., Any]) -> None: ...


class Stages(Protocol[_Run]):
    """What the loop runs of the `Pipeline`: routing, then the rest of an attempt."""

    @property
    def fleet(self) -> Fleet: ...

    def route(self, call: Any) -> Served: ...

    async def serve(self, call: Any, served: Served, *,
                    first_byte_timeout_s: float | None = None,
                    moves_on: Callable[[BaseException], bool] | None = None,
                    queues: bool = True) -> _Run: ...


def condition(err: BaseException) -> str | None:
    """The fallback condition (`fallback_spec.CONDITIONS`) an attempt's failure meets;
    None: a failure of the request itself, which no other deployment would answer."""
    if isinstance(err, TimeoutError):
        return "timeout"
    if not isinstance(err, APIError):
        return None
    if err.cause is not None:
        return err.cause
    if err.code == "context_length_exceeded":
        return "context_length"
    if err.code in CONTENT_POLICY:
        return "content_policy"
    return None


async def run_with_fallbacks(pipeline: Stages[_Run], call: Call) -> _Run:
    """`call` through the pipeline on its first candidate that serves it; see the
    module's docstring. Refusals surface here, before any byte of the answer."""
    fleet = pipeline.fleet.router.fleet
    names = fleet.deployments.keys() | fleet.aliases.keys()
    named = [Fallback(call.model, "model"), *call.fallbacks] if call.fallbacks else []
    for entry in named:  # the request's own names: a typo is a 404, not a skip
        if entry.model not in names:
            err = model_not_found(entry.model)
            err.param = entry.param
            raise err
    build = call.build
    chain: list[Fallback] | None = None
    attempts: list[Attempt] = []
    first: BaseException | None = None
    last: BaseException | None = None
    index = 0
    while True:
        name = call.model
        served: Served | None = None
        moves_on: Callable[[BaseException], bool] = _never
        try:
            served = pipeline.route(call)
            if chain is None:
                chain = _chain(pipeline, call, served)
                if chain:
                    call.attempts = attempts
            policy = _policy(pipeline, name, served)
            ahead = index < len(chain)
            moves_on = _moving_on(policy, ahead)
            started = await pipeline.serve(
                call, served, moves_on=moves_on, first_byte_timeout_s=(
                    policy.first_byte_timeout_s if ahead and "timeout" in policy.on
                    else None),
                # A rate limit that sends the request on does so at once: no queueing.
                queues=not (ahead and "rate_limit" in policy.on))
        except (APIError, TimeoutError) as exc:
            if chain is None:  # routing failed for the name the client asked for
                chain = _chain(pipeline, call, None)
                if chain:
                    call.attempts = attempts
            deployment = call.served.name if call.served is not None else None
            code = "timeout" if isinstance(exc, TimeoutError) else exc.code
            skip = isinstance(exc, APIError) and (exc.status == 403 or exc.code in SKIPPED)
            attempts.append(Attempt(name, deployment, "skipped" if skip else "failed", code))
            first = first or exc
            if not skip:
                last = exc
            if not ((skip and index < len(chain)) or moves_on(exc)):
                raise _answer(last or first) from None
            entry = chain[index]
            index += 1
            call.retarget(entry.model, entry.build or build)
            continue
        attempts.append(Attempt(name, served.name, "served"))
        return started


def _never(exc: BaseException) -> bool:
    return False


def _moving_on(policy: FallbackSpec, ahead: bool) -> Callable[[BaseException], bool]:
    """Whether a failure sends the request on: a candidate is `ahead` and the failure
    meets a condition of the failed one's `policy`."""
    return lambda exc: ahead and condition(exc) in policy.on


def _answer(err: BaseException) -> BaseException:
    """What the client gets of the last failure: a timed-out attempt (only one with a
    candidate after it has a bound) followed by skipped ones only is a 504."""
    if isinstance(err, TimeoutError):
        return APIError(504, "No deployment answered in time.", code="timeout")
    return err


def _chain(pipeline: Stages[Any], call: Call, served: Served | None) -> list[Fallback]:
    """The candidates after the first: the request's own, else the fleet file's."""
    if call.fallbacks:
        return list(call.fallbacks)
    spec = _own(pipeline, call.model, served)
    return [Fallback(name) for name in spec.to] if spec is not None else []


def _policy(pipeline: Stages[Any], name: str, served: Served | None) -> FallbackSpec:
    """What sends a request for `name` on, and how long its first byte may take."""
    return _own(pipeline, name, served) or _DEFAULT


def _own(pipeline: Stages[Any], name: str, served: Served | None) -> FallbackSpec | None:
    """The fleet file's fallbacks of `name`: an alias's own, else those of the
    deployment it routed to (`served`), else those of the deployment so named."""
    fleet = pipeline.fleet.router.fleet
    alias = fleet.aliases.get(name)
    if alias is not None and alias.fallbacks is not None:
        return alias.fallbacks
    if served is not None:
        return served.spec.fallbacks
    spec = fleet.deployments.get(name)
    return spec.fallbacks if spec is not None else None
