"""Who a visitor is: one notion, owned here, that every per-visitor limit counts by (the queue,
unused uploads, re-read tokens a minute, blind battles and votes).

A visitor is a network address, never something a client can mint: a fresh cookie or a forged
``X-Forwarded-For`` entry must not make a script a thousand visitors.

- Behind ``KV_ARENA_TRUSTED_PROXY_HOPS`` trusted proxies (default 1 where ``SPACE_ID`` is set, as
  on a Hugging Face Space, whose proxy appends the address it saw; 0 elsewhere), the visitor is the
  entry that many places from the right of ``X-Forwarded-For``: the address the outermost trusted
  proxy saw connect to it. Entries to its left were written by the client and are never read.
  A request carrying fewer entries than that did not come through the proxies: its peer counts.
  Every ``X-Forwarded-For`` line counts, joined in order (a proxy appends to the last one).
- With 0 hops the visitor is the peer address; ``X-Forwarded-For`` is ignored, by the server too
  (``components.clients.server_proxies``: uvicorn trusts no proxy then).
- An entry that is not an IP address (a client past the proxy can write anything, 70 kB included)
  is not a visitor: the peer counts.
- An IPv6 address counts as its /56 network (:data:`IPV6_PREFIX`): what one customer is commonly
  given, so a host cannot become 256 visitors by moving between the /64s of its allocation.
- An MCP call is its caller's visitor: the bridge re-sends it from 127.0.0.1 with the caller's
  headers, among them :func:`vouch`'s line, which only this process can write (:func:`vouched`).

A cookie (``components.clients.COOKIE``) is a sub-key under its address (it owns uploads and
sessions), never a new visitor. Limits keep room in every total cap: one visitor may hold at
most :func:`share` of it (a quarter), so the others always have the rest.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

HOPS_ENV = "KV_ARENA_TRUSTED_PROXY_HOPS"
SHARE = 4  # one visitor may hold at most 1/SHARE of any total cap
IPV6_PREFIX = 56  # an IPv6 visitor: one customer's allocation (commonly a /56; a /64 is one host's)
VOUCH_HEADER = "x-kv-arena-visitor"  # the caller's address, on a request this process re-sends (MCP)
_VOUCH_SECRET = secrets.token_hex(16)  # made per process, never sent to a client


def trusted_hops() -> int:
    """Proxies in front of the app whose ``X-Forwarded-For`` entries are believed."""
    default = 1 if os.environ.get("SPACE_ID") else 0
    try:
        return max(0, int(os.environ.get(HOPS_ENV, default)))
    except ValueError:
        return default


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``text`` names (brackets and a port dropped); None if it names none."""
    text = text.strip().strip('"')
    if len(text) > 64:  # longer than any IP address with a port: not one, and never parsed
        return None
    if text.startswith("[") and "]" in text:  # "[v6]:port"
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # "v4:port"
        text = text.split(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _grouped(parsed: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """An address as limits count it: an IPv4 address as it is, an IPv6 one as its /56."""
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_PREFIX}", strict=False))
    return str(parsed)


def _peer(peer: str | None) -> str:
    """The peer as limits count it (one that is not an IP address, e.g. a test client, as written, cut short)."""
    parsed = _ip(peer or "")
    return _grouped(parsed) if parsed is not None else (peer or "unknown")[:64]


def address(forwarded_for: Iterable[str], peer: str | None, hops: int | None = None) -> str:
    """The visitor's address from every ``X-Forwarded-For`` header value a request carries (in
    order, joined) and its peer, behind ``hops`` trusted proxies (default :func:`trusted_hops`)."""
    hops = trusted_hops() if hops is None else hops
    if hops:
        entries = [e.strip() for value in forwarded_for for e in value.split(",") if e.strip()]
        parsed = _ip(entries[-hops]) if len(entries) >= hops else None
        if parsed is not None:
            return _grouped(parsed)
    return _peer(peer)


def vouch(visitor_address: str) -> str:
    """The :data:`VOUCH_HEADER` value that makes a request this process re-sends count as ``visitor_address``."""
    return f"{visitor_address} {_VOUCH_SECRET}"


def vouched(values: Iterable[str]) -> str | None:
    """The address a :data:`VOUCH_HEADER` value written by :func:`vouch` names (None: none was, or
    a client wrote it: it cannot know the secret)."""
    for value in values:
        named, _, secret = value.rpartition(" ")
        if named and hmac.compare_digest(secret.encode("latin-1", "replace"), _VOUCH_SECRET.encode()):
            return named
    return None


@dataclass(frozen=True)
class Visitor:
    """One visitor (``key``: what limits count by) and the cookie its request carried, if any."""

    address: str
    cookie: str | None = None

    @property
    def key(self) -> str:
        return "visitor:" + self.address


def _values(headers, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in headers if k.lower() == name]


def from_scope(scope: Mapping, cookie: str | None = None) -> Visitor:
    """The visitor of an ASGI request."""
    headers = scope.get("headers", [])
    said = vouched(_values(headers, VOUCH_HEADER.encode()))
    if said is not None:
        return Visitor(said, cookie)
    peer = scope.get("client")
    return Visitor(address(_values(headers, b"x-forwarded-for"), peer[0] if peer else None), cookie)


def from_request(headers: Mapping[str, str] | None, peer: str | None, cookie: str | None = None) -> Visitor:
    """The visitor of an event's request given as its headers (one value a name, or Starlette's,
    every value) and its peer's host; one with its ASGI scope at hand goes to :func:`from_scope`."""
    def every(name: str) -> list[str]:
        if headers is None:
            return []
        if hasattr(headers, "getlist"):  # Starlette's headers: every value of a repeated header
            return headers.getlist(name)
        return [headers[name]] if headers.get(name) else []

    said = vouched(every(VOUCH_HEADER))
    if said is not None:
        return Visitor(said, cookie)
    return Visitor(address(every("x-forwarded-for"), peer), cookie)


def share(total: int | float) -> int:
    """The most one visitor may hold of a total cap (at least 1)."""
    return max(1, int(total // SHARE))
