"""A deployment's sampling defaults: what a request that leaves a sampling parameter out
gets, and where that value came from. A leaf module.

Per parameter, the first that has a value wins:

1. the request's own value;
2. the fleet file's `defaults` table of the deployment (the operator's explicit choice,
   as vLLM's `--override-generation-config` overrides the model's);
3. the model's own recommendation: its files (GGUF `general.sampling.*` keys, a Hugging
   Face folder's `generation_config.json`, as vLLM reads it by default), else what its
   publisher's model card recommends for a model tokenyard ships (`text/model_files.py`);
4. the API's default (temperature 1, top_p 1, no top-k, no min-p, no penalties).

`/v1/models` reports, per deployment, every default that is not the API's and its source
("fleet", "model" or "model card"), so a client can see why the same request samples
differently on two deployments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenyard.fleet_values import FleetConfigError


@dataclass(frozen=True)
class Bound:
    """The values a sampling parameter may take, and the API's default."""

    low: float
    high: float
    api_default: float
    #: A count (top_k), not a real number.
    integer: bool = False
    #: Whether `low` itself is allowed.
    low_open: bool = False

    def check(self, value: Any) -> float | None:
        """The value as a number when it is within bounds, else None."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if self.integer and not float(value).is_integer():
            return None
        if not math.isfinite(value) or value > self.high or value < self.low or (
                self.low_open and value == self.low):
            return None
        return int(value) if self.integer else float(value)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        left = "(" if self.low_open else "["
        return f"{kind} in {left}{self.low:g}, {self.high:g}]"


#: The parameters a deployment may default, under their OpenAI/vLLM request names.
PARAMETERS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0, 1.0),
    "top_p": Bound(0.0, 1.0, 1.0, low_open=True),
    "top_k": Bound(0, 1 << 20, 0, integer=True),
    "min_p": Bound(0.0, 1.0, 0.0),
    "repetition_penalty": Bound(0.0, 2.0, 1.0, low_open=True),
    "presence_penalty": Bound(-2.0, 2.0, 0.0),
    "frequency_penalty": Bound(-2.0, 2.0, 0.0),
}

#: GGUF metadata keys (llama.cpp's `general.sampling.*`) -> parameter.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_present": "presence_penalty",
    "general.sampling.penalty_freq": "frequency_penalty",
}

#: generation_config.json keys (Hugging Face) -> parameter: those vLLM takes from it.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults by parameter name, each with its source."""

    values: Mapping[str, float] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)

    def value(self, name: str, requested: float | None) -> float:
        """What a request gets for `name`: its own value, else this default, else the
        API's."""
        if requested is not None:
            return requested
        if name in self.values:
            return self.values[name]
        return PARAMETERS[name].api_default

    def over(self, under: SamplingDefaults) -> SamplingDefaults:
        """These defaults, with `under`'s for the parameters these leave out."""
        return SamplingDefaults({**under.values, **self.values},
                                {**under.sources, **self.sources})


NONE = SamplingDefaults()


def read_defaults(values: Mapping[str, Any], keys: Mapping[str, str],
                  source: str) -> SamplingDefaults:
    """Defaults from a model file's metadata (`keys`: its key -> parameter); values out of
    bounds or of the wrong type are skipped, as a model file is not ours to refuse."""
    found: dict[str, float] = {}
    for key, name in keys.items():
        if key in values and (value := PARAMETERS[name].check(values[key])) is not None:
            found[name] = value
    return SamplingDefaults(found, dict.fromkeys(found, source))


def fleet_defaults(table: Any, where: str) -> SamplingDefaults:
    """A deployment's `defaults` table of the fleet file; FleetConfigError names a
    parameter that is unknown or out of bounds."""
    if not isinstance(table, dict):
        raise FleetConfigError(f"{where}: a table")
    found: dict[str, float] = {}
    for name, raw in table.items():
        bound = PARAMETERS.get(name)
        if bound is None:
            raise FleetConfigError(f"{where}: unknown parameter {name!r}; known: "
                                   f"{', '.join(PARAMETERS)}")
        value = bound.check(raw)
        if value is None:
            raise FleetConfigError(f"{where}.{name}: {bound.describe()}")
        found[name] = value
    return SamplingDefaults(found, dict.fromkeys(found, "fleet"))
