"""Who a visitor is: one notion, owned here, that every per-visitor limit counts by (the queue,
unused uploads, re-read tokens a minute, blind battles and votes).

A visitor is a network address, never something a client can mint: a fresh cookie or a forged
``X-Forwarded-For`` entry must not make a script a thousand visitors.

- Behind ``KV_ARENA_TRUSTED_PROXY_HOPS`` trusted proxies (default 1 where ``SPACE_ID`` is set, as
  on a Hugging Face Space, whose proxy appends the address it saw; 0 elsewhere), the visitor is the
  entry that many places from the right of ``X-Forwarded-For``: the address the outermost trusted
  proxy saw connect to it. Entries to its left were written by the client and are never read.
  A request carrying fewer entries than that did not come through the proxies: its peer counts.
- With 0 hops the visitor is the peer address; ``X-Forwarded-For`` is ignored.
- An IPv6 address counts as its /64 network: one host is given a whole /64.

A cookie (``components.clients.COOKIE``) is a sub-key under its address (it owns uploads and
sessions), never a new visitor. Limits keep room in every total cap: one visitor may hold at
most :func:`share` of it (a quarter), so the others always have the rest.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

HOPS_ENV = "KV_ARENA_TRUSTED_PROXY_HOPS"
SHARE = 4  # one visitor may hold at most 1/SHARE of any total cap


def trusted_hops() -> int:
    """Proxies in front of the app whose ``X-Forwarded-For`` entries are believed."""
    default = 1 if os.environ.get("SPACE_ID") else 0
    try:
        return max(0, int(os.environ.get(HOPS_ENV, default)))
    except ValueError:
        return default


def _grouped(address: str) -> str:
    """``address`` as limits count it: an IPv4 address as it is, an IPv6 one as its /64."""
    text = address.strip().strip('"')
    if text.startswith("[") and "]" in text:  # "[v6]:port"
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # "v4:port"
        text = text.split(":")[0]
    try:
        parsed = ipaddress.ip_address(text)
    except ValueError:
        return text or "unknown"
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def address(forwarded_for: Iterable[str], peer: str | None, hops: int | None = None) -> str:
    """The visitor's address from every ``X-Forwarded-For`` header value a request carries (in
    order) and its peer, behind ``hops`` trusted proxies (default :func:`trusted_hops`)."""
    hops = trusted_hops() if hops is None else hops
    entries = [e.strip() for value in forwarded_for for e in value.split(",") if e.strip()]
    if hops and len(entries) >= hops:
        return _grouped(entries[-hops])
    return _grouped(peer or "unknown")


@dataclass(frozen=True)
class Visitor:
    """One visitor (``key``: what limits count by) and the cookie its request carried, if any."""

    address: str
    cookie: str | None = None

    @property
    def key(self) -> str:
        return "visitor:" + self.address


def from_scope(scope: Mapping, cookie: str | None = None) -> Visitor:
    """The visitor of an ASGI request."""
    forwarded = [v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-forwarded-for"]
    peer = scope.get("client")
    return Visitor(address(forwarded, peer[0] if peer else None), cookie)


def from_request(headers: Mapping[str, str] | None, peer: str | None, cookie: str | None = None) -> Visitor:
    """The visitor of an event's request (its headers, one value a name, and its peer's host)."""
    if headers is None:
        forwarded = []
    elif hasattr(headers, "getlist"):  # Starlette's headers: every value of a repeated header
        forwarded = headers.getlist("x-forwarded-for")
    else:
        forwarded = [headers.get("x-forwarded-for", "")]
    return Visitor(address(forwarded, peer), cookie)


def share(total: int | float) -> int:
    """The most one visitor may hold of a total cap (at least 1)."""
    return max(1, int(total // SHARE))
