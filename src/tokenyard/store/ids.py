"""Short prefixed ids: `org_…`, `proj_…`, `user_…`, `key_…`, `cap_…`."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits
ID_CHARS = 16  # 36**16 ≈ 2**82: collisions are not a concern at any realistic count


def new_id(prefix: str) -> str:
    """A fresh random id such as 'org_k3v9…' (prefix, underscore, 16 of [a-z0-9])."""
    return f"{prefix}_" + "".join(secrets.choice(_ALPHABET) for _ in range(ID_CHARS))
