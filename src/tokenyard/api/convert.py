"""Conversions both dialects share: response ids, the `created` clock, and building the
engine's `SamplingParams` with its range errors named the way the client spelled them.

The dialects' own conversions live in `api/openai/convert.py` and
`api/anthropic/convert.py`. No I/O, no torch: the HTTP process calls these on its loop.
"""

from __future__ import annotations

import os
import random
import secrets
import string
import time
from collections.abc import Mapping
from typing import Any

from tokenyard.errors import INVALID_VALUE, APIError
from tokenyard.wire.sampling_params import SamplingParams, SamplingParamsError

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_RANDOM = random.Random(secrets.randbits(128))
# A forked worker must not draw the same ids as its parent.
os.register_at_fork(after_in_child=lambda: _ID_RANDOM.seed(secrets.randbits(128)))


def random_id(prefix: str, length: int = 24) -> str:
    """`prefix` + `length` random base-62 characters."""
    # Response ids name a response, they guard nothing: a seeded PRNG draws all characters
    # in one call, where secrets.choice read the OS once per character.
    return prefix + "".join(_ID_RANDOM.choices(_ID_ALPHABET, k=length))


def now() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())


def sampling_params(renames: Mapping[str, str], **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), its range errors as 400s under the client's parameter names."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        param = renames.get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param:
            message = message.replace(exc.param, param)
        raise APIError(400, message, param=param, code=INVALID_VALUE) from None


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The request's stop strings as a list, without empty ones (they can never match)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    return [s for s in stops if s]
