"""One visitor is one visitor (issue 56): the address behind the trusted proxies, never an entry a
client wrote, never its cookie; an IPv6 host counts as its /56 (issue 68), an MCP call as its caller."""

from __future__ import annotations

import pytest

from kv_arena.service import visitors


def scope(forwarded: list[str], peer: str = "10.0.0.1", cookie: str | None = None) -> dict:
    headers = [(b"x-forwarded-for", f.encode()) for f in forwarded]
    if cookie:
        headers.append((b"cookie", f"kv_arena_client={cookie}".encode()))
    return {"type": "http", "headers": headers, "client": (peer, 5000)}


def test_without_proxies_the_peer_is_the_visitor_and_forwarded_entries_are_ignored():
    assert visitors.address(["198.51.100.1"], "10.0.0.1", hops=0) == "10.0.0.1"


def test_behind_one_proxy_only_its_own_entry_counts():
    assert visitors.address(["198.51.100.1, 203.0.113.5"], "10.0.0.1", hops=1) == "203.0.113.5"
    assert visitors.address(["203.0.113.5"], "10.0.0.1", hops=1) == "203.0.113.5"
    # two headers: the proxy appended to the last one
    assert visitors.address(["198.51.100.1", "203.0.113.5"], "10.0.0.1", hops=1) == "203.0.113.5"


def test_behind_two_proxies_the_outer_ones_entry_counts():
    assert visitors.address(["1.2.3.4, 203.0.113.5, 10.1.1.1"], "10.0.0.1", hops=2) == "203.0.113.5"


def test_a_request_that_did_not_come_through_the_proxies_is_its_peer():
    assert visitors.address([], "192.0.2.7", hops=1) == "192.0.2.7"
    assert visitors.address(["203.0.113.5"], "192.0.2.7", hops=2) == "192.0.2.7"


def test_a_fresh_cookie_is_the_same_visitor():
    one = visitors.from_scope(scope(["9.9.9.9, 203.0.113.5"]), cookie="a")
    two = visitors.from_scope(scope(["8.8.8.8, 203.0.113.5"]), cookie="b")
    assert one.cookie != two.cookie and one.key == two.key


def test_the_default_hops_are_one_on_a_space_and_zero_elsewhere(monkeypatch):
    monkeypatch.delenv(visitors.HOPS_ENV, raising=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert visitors.trusted_hops() == 0
    monkeypatch.setenv("SPACE_ID", "someone/kv-arena")
    assert visitors.trusted_hops() == 1
    monkeypatch.setenv(visitors.HOPS_ENV, "2")
    assert visitors.trusted_hops() == 2
    monkeypatch.setenv(visitors.HOPS_ENV, "many")
    assert visitors.trusted_hops() == 1


def test_an_ipv6_customer_is_its_slash_56_and_ports_are_dropped():
    """One customer's allocation (a /56): moving between its 256 /64s is still one visitor."""
    spread = {visitors.address([], f"2001:db8:1:{i:x}::1", hops=0) for i in range(0x00, 0x100, 0x15)}
    assert spread == {"2001:db8:1::/56"}
    assert visitors.address([], "2001:db8:1:100::1", hops=0) != visitors.address([], "2001:db8:1:ff::1", hops=0)
    assert visitors.IPV6_PREFIX == 56
    assert visitors.address(["203.0.113.5:4711"], None, hops=1) == "203.0.113.5"
    assert visitors.address(["[2001:db8::1]:443"], None, hops=1) == "2001:db8::/56"
    assert visitors.address([], "::ffff:192.0.2.1", hops=0) == "192.0.2.1"


def test_every_forwarded_line_counts_joined_in_order():
    """A proxy appends to the last line: a client's first line never wins, however many it sends."""
    assert visitors.address(["198.51.100.1", "198.51.100.2, 203.0.113.5"], "10.0.0.1", hops=1) == "203.0.113.5"
    assert visitors.address(["198.51.100.1, 203.0.113.9", "203.0.113.5"], "10.0.0.1", hops=2) == "203.0.113.9"


def test_an_entry_that_is_no_ip_address_is_not_a_visitor():
    """A client past the proxy may write 70 kB or a name there: its peer counts, never the text."""
    for junk in ("a" * 70_000, "unknown", "2001:db8::1" + "1" * 100, "203.0.113.5" * 10):
        assert visitors.address([f"198.51.100.1, {junk}"], "10.0.0.1", hops=1) == "10.0.0.1"
    assert len(visitors.address([], "x" * 10_000, hops=0)) <= 64


def test_only_this_process_can_vouch_for_a_visitor():
    """The MCP bridge passes the caller's headers on: a vouched address counts; one a client wrote does not."""
    vouched = scope([], peer="127.0.0.1")
    vouched["headers"].append((visitors.VOUCH_HEADER.encode(), visitors.vouch("203.0.113.5").encode()))
    assert visitors.from_scope(vouched).key == "visitor:203.0.113.5"
    forged = scope([], peer="127.0.0.1")
    forged["headers"].append((visitors.VOUCH_HEADER.encode(), b"203.0.113.5 0123456789abcdef"))
    assert visitors.from_scope(forged).key == "visitor:127.0.0.1"
    headers = {visitors.VOUCH_HEADER: visitors.vouch("198.51.100.3")}
    assert visitors.from_request(headers, "127.0.0.1").key == "visitor:198.51.100.3"


def test_a_cap_keeps_room_for_the_others():
    assert visitors.share(32) == 8 and visitors.share(2) == 1


def test_a_re_read_is_charged_to_its_visitor_when_allowed_and_a_dry_check_charges_nothing():
    from kv_arena.errors import UserError
    from kv_arena.service.rereads import RereadBook

    book = RereadBook()

    def check(recent):
        if sum(n for _, n in recent) + 10 > 15:
            raise UserError("over")
        return 10

    assert book.charge("visitor:a", check, now=0.0, dry=True).tokens == 10
    long = book.charge("visitor:a", check, now=1.0)
    assert long.tokens == 10
    try:
        book.charge("visitor:a", check, now=2.0)
        raise AssertionError("a second re-read within the minute passed")
    except UserError:
        pass
    assert book.charge("visitor:b", check, now=2.0).tokens == 10  # another visitor has its own minute
    book.ended(long, now=100.0)  # a re-read that took 99 s: its minute runs from its end
    with pytest.raises(UserError):
        book.charge("visitor:a", check, now=150.0)
    assert book.charge("visitor:a", check, now=160.5).tokens == 10  # the minute has passed


def test_re_reads_are_a_persons_inside_an_address_that_holds_twice_that():
    """Issue 68: a classmate behind the same address has a minute of their own; fresh cookies meet the
    address's budget (PER_ADDRESS persons' tokens) and its one line."""
    from kv_arena.errors import UserError
    from kv_arena.service.rereads import PER_ADDRESS, RereadBook, person_of

    book, address, limit = RereadBook(), "visitor:203.0.113.5", 10

    def check(recent):
        if sum(n for _, n in recent) + 8 > limit:
            raise UserError("You re-read")
        return 8

    def charge(cookie, now):
        return book.charge(address, check, now=now, person=person_of(address, cookie), address_limit=PER_ADDRESS * limit)

    assert charge("alice", 0.0).tokens == 8
    with pytest.raises(UserError, match="You re-read"):
        charge("alice", 1.0)
    assert charge("bob", 2.0).tokens == 8  # not told about alice's tokens
    with pytest.raises(UserError, match="people behind your address re-read 16 tokens"):
        charge("carol", 3.0)
    assert charge("carol", 61.0).tokens == 8  # the minute has passed
