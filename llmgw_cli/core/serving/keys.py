"""API keys as values, and the checks made on each request (pure; the clock is passed in).

A key is a random token shown once; only its SHA-256 is stored. A fast unsalted hash is
right here because the token is 32 random bytes, not a password: nobody can guess it, so
a slow hash would only cost the gateway CPU on every request, and a plain digest lets the
gateway look the key up in a dict.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from llmgw_cli.core.serving.limits import NO_LIMITS, Limits

TOKEN_PREFIX = "llmgw-"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One client key. ``models`` empty means every model; ``expires`` is a UTC time or None;
    ``limits`` what it may use (``core/serving/limits.py``)."""

    name: str
    digest: str
    models: tuple[str, ...] = ()
    expires: datetime | None = None
    created: datetime | None = None
    revoked: bool = False
    admin: bool = False
    limits: Limits = NO_LIMITS

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def valid(self, now: datetime) -> bool:
        return not self.revoked and (self.expires is None or now < self.expires)


def parse_expiry(text: str) -> datetime:
    """``2027-01-31`` (end of that day is not implied: the key stops at 00:00 UTC) or an
    ISO time; a time without a zone is UTC."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header, or None.

    The header is client bytes: a token that is not printable ASCII (bytes the HTTP parser
    kept as surrogates, a control character, an inner space) is no key anyone was given,
    and is None here rather than an error wherever it is hashed or compared."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not plausible_token(token):
        return None
    return token


def plausible_token(token: str) -> bool:
    """Printable ASCII without spaces, as every key is (and nothing a hash rejects)."""
    return bool(token) and token.isascii() and token.isprintable() and " " not in token
