"""What can go wrong between the HTTP side and an engine replica, as typed errors; and
the error of a refused request, whichever way its answer came (an HTTP status, or a
refusal on the multiplexed channel)."""

from __future__ import annotations

from typing import Any

#: A failure after the stream began, as its error event tells the tenant.
STREAM_FAILED_MESSAGE = "the request failed on its replica after it began"


class ReplicaError(Exception):
    """Anything that went wrong talking to a replica."""


class ReplicaRequestError(ReplicaError):
    """The replica refused the request (4xx, or a 5xx other than 503)."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(f"replica answered {status}: {message}")
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class ReplicaOverloaded(ReplicaError):
    """503: the replica's waiting queue is full (code "overloaded") or it is draining
    (code "draining"). Try another replica, or this one after `retry_after` seconds."""

    def __init__(self, retry_after: float | None, message: str = "", code: str | None = None):
        super().__init__(f"replica unavailable ({code}): {message}")
        self.retry_after = retry_after
        self.message = message
        self.code = code


class ReplicaRateLimited(ReplicaError):
    """429 from an upstream, for a request that does not queue for it (it has a fallback
    that takes rate limits). Not a `ReplicaOverloaded`, which the pool waits on and
    tries on its other members: this passes through them as the attempt's answer, so
    the fallback is tried at once. `retry_after`: the upstream's, in seconds."""

    def __init__(self, retry_after: float | None, message: str = "", code: str | None = None):
        super().__init__(f"upstream rate limited ({code}): {message}")
        self.retry_after = retry_after
        self.message = message
        self.code = code


class ReplicaStreamError(ReplicaError):
    """The request failed after its stream began (the replica's last line was an error)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ReplicaConnectionError(ReplicaError):
    """The replica could not be reached, or the stream broke off before the request ended."""


class ReplicaUnauthorized(ReplicaError):
    """401: the replica wants a token this client lacks or has wrong (a deployment fault,
    not the API caller's: `TOKENYARD_REPLICA_TOKEN` differs between the two ends)."""


def refusal_error(status: int, error: Any, retry_after: float | None,
                  origin: str) -> ReplicaError:
    """The typed error of a refused request: `error` is the answer's ``{"message",
    "param", "code"}`` (or its text, when it was no such object), `origin` the replica's
    URL (for the log)."""
    if isinstance(error, dict):
        message, param, code = str(error.get("message")), error.get("param"), error.get("code")
    else:
        message, param, code = str(error), None, None
    if status == 503:
        return ReplicaOverloaded(retry_after, message, code)
    if status == 401:
        return ReplicaUnauthorized(f"{origin}: the replica refused this client's token "
                                   f"({message})")
    return ReplicaRequestError(status, message, param, code)
