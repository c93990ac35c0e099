"""LoRA adapters by name: the `--lora-modules` flag, the fleet file's `adapters` and the
`base:adapter` model name, read into plain values (a leaf, like `placement_spec.py`): the
engine, the fleet file and the gateway read adapter names alike.

    [[deployments]]
    name = "smollm2-135m-instruct-2026-11-22"
    replicas = 1
    engine_args = ["--max-loras", "8"]
    adapters = [
      { name = "pirate", path = "/srv/adapters/pirate" },
      { name = "sql", path = "/srv/adapters/sql", prices = { input = "0.2", output = "0.8" } },
    ]

Each adapter is served as a deployment of its own, `base:adapter`
(`smollm2-135m-instruct-2026-11-22:pirate`), over the base's replicas: aliases may name
it, key scopes allow it by that name, usage is recorded and priced under it (its own
`prices`, else the base's), and `/v1/models` lists it with `parent` the base. The base's
local replicas are started with `--lora-modules` for its adapters; replicas it lists by
URL must be started so by whoever runs them. Adapter names are letters, digits, '.', '_'
and '-'.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenyard.fleet_values import (
    FleetConfigError,
    PriceSpec,
    a_string,
    a_table,
    an_array,
    only_fields,
    price_spec,
)

_Spec = TypeVar("_Spec")

LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def valid_lora_name(name: str) -> bool:
    return LORA_NAME.fullmatch(name) is not None


def parse_lora_modules(value: str | None) -> dict[str, str]:
    """`--lora-modules` ("name=path[,name=path]") as name -> path; ValueError if malformed."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora module {item!r}: expected name=path")
        if not valid_lora_name(name):
            raise ValueError(f"lora module name {name!r}: up to 64 letters, digits, '.', "
                             "'_' and '-'")
        if name in out:
            raise ValueError(f"lora module {name!r} is given twice")
        out[name] = path
    return out


def split_adapter(model: str) -> tuple[str, str | None]:
    """`base:adapter` -> (base, adapter); a name without a colon -> (name, None)."""
    base, sep, adapter = model.rpartition(":")
    if not sep or not base or not adapter:
        return model, None
    return base, adapter


def lora_salt(salt: str | None, adapter: str | None) -> str | None:
    """The prefix-cache salt of a request of `adapter` (None: the base model's, `salt`):
    an adapter's KV differs from the base's for the same tokens, so its blocks hash apart
    and are never shared with the base's or another adapter's."""
    if adapter is None:
        return salt
    return f"{salt or ''}\x00lora\x00{adapter}"


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter of a deployment: its name, its PEFT folder, its prices (None: the
    base's)."""

    name: str
    path: str
    prices: PriceSpec | None = None
    batch_prices: PriceSpec | None = None


def fleet_adapters(item: dict[str, Any],
                   where: str) -> tuple[dict[str, Any], tuple[AdapterSpec, ...]]:
    """A fleet entry without its `adapters`, and them read."""
    rest = {k: v for k, v in item.items() if k != "adapters"}
    if "adapters" not in item:
        return rest, ()
    if item.get("kind", "engine") != "engine":
        raise FleetConfigError(f"{where}.adapters: only an engine deployment serves LoRA "
                               "adapters")
    out: dict[str, AdapterSpec] = {}
    for i, entry in enumerate(an_array(item["adapters"], f"{where}.adapters")):
        at = f"{where}.adapters[{i}]"
        table = a_table(entry, at)
        only_fields(table, {"name", "path", "prices", "batch_prices"}, at)
        name = a_string(table.get("name"), f"{at}.name")
        if not valid_lora_name(name):
            raise FleetConfigError(f"{at}.name: up to 64 letters, digits, '.', '_' and '-'")
        if name in out:
            raise FleetConfigError(f"{at}.name: '{name}' is defined twice")
        out[name] = AdapterSpec(
            name, a_string(table.get("path"), f"{at}.path"),
            price_spec(table["prices"], f"{at}.prices") if "prices" in table else None,
            price_spec(table["batch_prices"], f"{at}.batch_prices")
            if "batch_prices" in table else None)
    return rest, tuple(out.values())


def with_adapters(deployments: Mapping[str, _Spec]) -> dict[str, _Spec]:
    """The deployments and, after them, one per adapter: `base:adapter`, a copy of its
    base's spec that names its `parent` and its `lora`, with no replicas of its own."""
    out = dict(deployments)
    for spec in deployments.values():
        base: Any = spec
        for adapter in base.adapters:
            name = f"{base.name}:{adapter.name}"
            if name in out:
                raise FleetConfigError(f"deployment {name!r} is also {base.name}'s adapter")
            own = adapter.prices is not None
            out[name] = dataclasses.replace(
                base, name=name, adapters=(), parent=base.name, lora=adapter.name,
                replicas=0, urls=(), ray=None,
                prices=adapter.prices if own else base.prices,
                batch_prices=adapter.batch_prices if own else base.batch_prices)
    return out


def lora_modules_arg(adapters: tuple[AdapterSpec, ...]) -> list[str]:
    """The engine flag that loads `adapters` ([] for none)."""
    if not adapters:
        return []
    return ["--lora-modules", ",".join(f"{a.name}={a.path}" for a in adapters)]
