"""API key secrets: generated once, shown once, stored only as a SHA-256 hash."""

from __future__ import annotations

import hashlib
import secrets

SECRET_PREFIX = "sk-ty-"
VISIBLE_CHARS = 4  # random characters kept in the displayed prefix, e.g. "sk-ty-AbCd"


def new_secret() -> str:
    """'sk-ty-' followed by 43 url-safe random characters (256 bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """SHA-256 hex of the whole secret: what `api_keys.secret_hash` holds.

    A plain hash (no salt, no slow KDF) is enough: the secret has 256 random bits, and it
    lets the gateway find a key with one indexed lookup.
    """
    return hashlib.sha256(secret.encode()).hexdigest()


def visible_prefix(secret: str) -> str:
    """The part of a secret that is safe to show in listings, e.g. 'sk-ty-AbCd'."""
    return secret[: len(SECRET_PREFIX) + VISIBLE_CHARS]
