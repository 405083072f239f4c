"""Client API keys (``--api-key``): a request must carry ``Authorization: Bearer <key>`` for one of
them (the scheme in any case, as HTTP has it), compared in constant time. No keys configured: every
request passes.

A key may be named, ``NAME:KEY`` (NAME of letters, digits, ``_`` and ``-``; an unnamed key is
``key-<i>``, its place in the list): the name, never the key, appears in metrics and logs, and
``api_key_limits`` (YAML ``{NAME: {requests_per_minute: N}}``) caps a key's generation requests.
A limit is a token bucket holding a minute's requests (at least one), refilled continuously; a
request that finds it empty is a 429 with ``Retry-After``. Each router replica counts its own requests.
"""

from __future__ import annotations

import hmac
import math
import re
import time
from collections.abc import Callable
from typing import Any

from router.errors import RouterError

_NAMED = re.compile(r"^([A-Za-z0-9_-]+):(.+)$")


def header_token_ok(value: str) -> bool:
    """Can a client send ``value`` as written in a header (printable ASCII, no spaces)?"""
    return all(" " < c <= "~" for c in value)


def key_names(keys: list[str]) -> list[tuple[str, str]]:
    """(name, secret) of each configured key, spaces around it dropped (a header's token has none);
    ValueError for an empty one (no client could send it: keys on, every request refused), and for
    a name given to one key that an unnamed key has by its place (keys that share a name share its
    counts and limit: on purpose only), and for one secret under two names (a request would count
    under one of them only: the other's limit would not hold)."""
    out, named, unnamed, owner = [], set(), set(), {}
    for i, key in enumerate(keys):
        m = _NAMED.match(key.strip())
        name, secret = (m.group(1), m.group(2).strip()) if m else (f"key-{i}", key.strip())
        if not secret:
            raise ValueError(f"API key {i} is empty")
        if not header_token_ok(secret):  # NOTE: no client could send it as written
            raise ValueError(f"API key {i} must be printable ASCII without spaces (a header carries it)")
        (named if m else unnamed).add(name)
        if owner.setdefault(secret, (i, name))[1] != name:
            raise ValueError(f"API key {i} has the secret of key {owner[secret][0]} under another name")
        out.append((name, secret))
    if clash := sorted(named & unnamed):
        raise ValueError(
            f"API key name {clash[0]!r} is given to a key and is an unnamed key's too: name that one"
        )
    return out


def bearer_token(authorization: str | None) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header, the scheme matched in any case (RFC
    9110 11.1); b"" when the header is missing or names another scheme."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def token_matches(given: bytes, secret: str) -> bool:
    """``given`` (a header's token) is ``secret``, compared in constant time; never for an empty one."""
    return bool(given) and hmac.compare_digest(given, secret.encode())


def check_limits(keys: list[str], limits: dict[str, Any]) -> None:
    """ValueError naming the first limit that is not for a configured key or not a positive rate."""
    names = {name for name, _ in key_names(keys)}
    for name, spec in limits.items():
        if name not in names:
            raise ValueError(f"api_key_limits: no API key is named {name!r} (name a key as NAME:KEY)")
        rate = spec.get("requests_per_minute") if isinstance(spec, dict) and len(spec) == 1 else None
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"api_key_limits.{name}: expected {{requests_per_minute: <number > 0>}}")


class _Bucket:
    def __init__(self, per_minute: float, clock: Callable[[], float]) -> None:
        # NOTE: at least one whole request: under 1 a minute the bucket would never hold one
        self.capacity = max(1.0, float(per_minute))
        self.rate = per_minute / 60.0  # tokens per second
        self.tokens = self.capacity
        self.clock = clock
        self.at = clock()

    def take(self) -> float:
        """0 when a request may go now (one token taken), else the seconds until one is there."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class APIKeys:
    def __init__(
        self,
        keys: list[str],
        limits: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._expected = [(secret, name) for name, secret in key_names(keys)]
        limits = limits or {}
        check_limits(keys, limits)
        self.limits = {name: spec["requests_per_minute"] for name, spec in limits.items()}
        self._buckets = {name: _Bucket(rate, clock) for name, rate in self.limits.items()}

    def __bool__(self) -> bool:
        return bool(self._expected)

    def check(self, authorization: str | None) -> str | None:
        """The name of the key ``authorization`` carries (None when keys are off); RouterError 401
        when it carries none of them."""
        if not self._expected:
            return None
        given = bearer_token(authorization)
        name = None
        for secret, key_name in self._expected:  # NOTE: every key compared, so timing says nothing
            if token_matches(given, secret):
                name = key_name
        if name is None:
            raise RouterError(
                401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key"
            )
        return name

    def admit(self, name: str | None) -> None:
        """Count one generation request against key ``name``'s limit; RouterError 429 (with the
        seconds to wait) when it is used up."""
        bucket = self._buckets.get(name) if name is not None else None
        if bucket is None:
            return
        wait = bucket.take()
        if wait > 0:
            raise RouterError(
                429,
                f"API key {name!r} is over its limit of {self.limits[name]:g} requests per minute; "
                f"retry in {wait:.1f} s",
                "rate_limit_exceeded",
                retry_after=math.ceil(wait),
            )
