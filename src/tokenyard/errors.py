"""Errors as plain values: what went wrong (HTTP status, message, the parameter at fault,
a machine-readable code, headers such as `retry-after`), with no dialect and no rendering.

Any layer may raise an `APIError`; `api/` renders it in the OpenAI or the Anthropic shape
(`api/errors.py`). The two APIs disagree on a few statuses: an overloaded server answers 503
on OpenAI routes and 529 on Anthropic routes, whatever status the error was built with.
"""

from __future__ import annotations

from collections.abc import Mapping

# ---------------------------------------------------------------------------- error codes

#: Codes of errors about a parameter's presence or value (the request schemas raise them too).
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"
INVALID_VALUE = "invalid_value"

#: The `error.type` the OpenAI API uses for each status.
OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}


def openai_error_type(status: int) -> str:
    """The OpenAI `error.type` for an HTTP status (4xx default: invalid_request_error)."""
    found = OPENAI_ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "server_error" if status >= 500 else "invalid_request_error"


# ---------------------------------------------------------------------------- the value


class APIError(Exception):
    """One failed request, independent of the API flavour that will render it.

    `type` is the OpenAI-style error type; it defaults from `status`. The Anthropic renderer
    derives its own type from the status. `headers` travel with the response (`retry-after`).
    `cause` is never rendered: what failed on the serving side, for a fallback
    (`gateway/fallbacks.py`) — "rate_limit" (a replica or its upstream is full or rate
    limited), "server_error" (it failed or cannot be reached); None: not the deployment's.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else openai_error_type(status)
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})
        self.cause = cause

    def __repr__(self) -> str:
        return (
            f"APIError(status={self.status}, message={self.message!r}, type={self.type!r}, "
            f"param={self.param!r}, code={self.code!r}, headers={self.headers!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, APIError):
            return NotImplemented
        return (
            self.status, self.message, self.type, self.param, self.code, self.headers
        ) == (other.status, other.message, other.type, other.param, other.code, other.headers)

    def __hash__(self) -> int:
        return hash((self.status, self.message, self.type, self.param, self.code))


# ---------------------------------------------------------------------------- constructors


def invalid_request(
    message: str, param: str | None = None, code: str | None = None
) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str | None = None) -> APIError:
    """400 for a parameter the server understands but does not implement yet."""
    text = message or f"'{param}' is not supported by this server yet."
    return APIError(400, text, param=param, code=UNSUPPORTED_PARAMETER)


def malformed_json(detail: str | None = None) -> APIError:
    """400 for a body that is not JSON (or nests deeper than the parser allows)."""
    text = "The request body could not be parsed as JSON"
    text += f" ({detail})." if detail else "."
    return APIError(400, text, code="invalid_json")


def body_too_large(limit_bytes: int, size: int | None = None) -> APIError:
    """413 for a body over the configured cap."""
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"The request body{got} exceeds the maximum of {limit_bytes} bytes.",
        code="request_too_large",
    )


def model_not_found(model: str) -> APIError:
    """404 model_not_found (OpenAI types it invalid_request_error; Anthropic not_found_error)."""
    return APIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def not_found(message: str) -> APIError:
    """404 for a route or resource that does not exist."""
    return APIError(404, message, code="not_found")


def context_length_exceeded(
    context_window: int,
    prompt_tokens: int,
    max_tokens: int | None = None,
    param: str = "messages",
) -> APIError:
    """400 context_length_exceeded, naming the window and both token counts."""
    if max_tokens:
        total = prompt_tokens + max_tokens
        text = (
            f"This model's context window is {context_window} tokens, but {total} tokens were "
            f"requested: {prompt_tokens} in the prompt and {max_tokens} for the completion. "
            "Shorten the prompt or lower the completion's maximum length."
        )
    else:
        text = (
            f"This model's context window is {context_window} tokens, but the prompt alone is "
            f"{prompt_tokens} tokens ({prompt_tokens} in the prompt, 0 left for the "
            "completion). Shorten the prompt."
        )
    return APIError(400, text, param=param, code="context_length_exceeded")


def _retry_headers(retry_after_s: float | None) -> dict[str, str]:
    if retry_after_s is None:
        return {}
    return {"retry-after": str(max(1, round(retry_after_s + 0.499)))}


def overloaded(retry_after_s: float | None = 1.0, message: str | None = None) -> APIError:
    """503 on OpenAI routes / 529 on Anthropic routes, with `retry-after` (whole seconds)."""
    return APIError(
        503,
        message or "The server is overloaded; retry after a short wait.",
        type="service_unavailable_error",
        code="server_is_overloaded",
        headers=_retry_headers(retry_after_s),
    )


#: The code of a request whose replica (or upstream) failed after its stream began.
REPLICA_FAILED = "replica_failed"


def replica_failed(message: str = "The replica serving this request failed after its "
                                  "response began; retry the request.") -> APIError:
    """502 server_error / api_error: the replica died or its stream broke off mid-response
    (a failure, not overload: nothing says a retry must wait)."""
    return APIError(502, message, code=REPLICA_FAILED)


def authentication_failed(message: str = "Invalid API key.") -> APIError:
    """401 authentication_error."""
    return APIError(401, message, code="invalid_api_key")


def rate_limited(message: str, retry_after_s: float | None = None, *,
                 code: str = "rate_limit_exceeded") -> APIError:
    """429 rate_limit_error with `retry-after`."""
    return APIError(429, message, code=code, headers=_retry_headers(retry_after_s))


def insufficient_quota(message: str) -> APIError:
    """429 insufficient_quota (credit or spend cap exhausted: retrying does not help)."""
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota")


def internal_error(message: str = "The server had an error processing the request.") -> APIError:
    """500 server_error / api_error."""
    return APIError(500, message)
