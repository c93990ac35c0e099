"""LoRA adapters by name: the `--lora-modules` flag and the `base:adapter` model name, read
into plain values (a leaf, like `placement_spec.py`): the engine, the fleet file and the
gateway read adapter names alike.

A request picks an adapter with the model name `base:adapter` (the deployment or alias,
then the adapter's name after the last colon), or with an alias the fleet file gives the
pair. Adapter names are letters, digits, '.', '_' and '-'.
"""

from __future__ import annotations

import re

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
