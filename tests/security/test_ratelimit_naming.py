"""The rate limiter names a flooder once per flood and counts every peer's calls (what the
flood test and docs/security.md read), on a controlled clock."""

import logging

from transport.ratelimit import RateLimiter


def test_a_flood_is_logged_once_and_again_only_after_a_quiet_spell(caplog):
    """Steps: rate 10/s, burst 5; peer A makes 20 calls at one instant, 20 more 0.1 s later,
    then waits 1 s (its bucket refills past the burst) and floods again; peer B calls 3 times.
    Expected: A's first 5 calls pass and the rest are refused; one warning names A for the first
    flood and one more for the second; B is never refused nor named; the counts and lowest
    levels say so."""
    caplog.set_level(logging.WARNING, logger="transport.ratelimit")
    now = [0.0]
    limiter = RateLimiter(rate_per_s=10.0, burst=5, max_buckets=8, clock=lambda: now[0])
    a, b = b"\xaa" * 32, b"\xbb" * 32
    first = [limiter.allow(a) for _ in range(20)]
    assert first == [True] * 5 + [False] * 15
    now[0] = 0.1
    assert sum(limiter.allow(a) for _ in range(20)) == 1  # one token refilled
    assert [limiter.allow(b) for _ in range(3)] == [True] * 3
    assert len([r for r in caplog.records if a.hex() in r.getMessage()]) == 1

    now[0] = 1.1
    assert sum(limiter.allow(a) for _ in range(20)) == 5
    named = [r.getMessage() for r in caplog.records if a.hex() in r.getMessage()]
    assert len(named) == 2 and all(m.startswith(f"rate limiting peer {a.hex()}") for m in named)
    assert not [r for r in caplog.records if b.hex() in r.getMessage()]

    calls = limiter.calls()
    assert (calls[a].allowed, calls[a].refused) == (11, 49) and calls[a].lowest_tokens < 1
    assert (calls[b].allowed, calls[b].refused) == (3, 0) and calls[b].lowest_tokens >= 1


def test_an_anonymous_source_is_named_by_its_host(caplog):
    caplog.set_level(logging.WARNING, logger="transport.ratelimit")
    limiter = RateLimiter(rate_per_s=1.0, burst=1, max_buckets=2, clock=lambda: 0.0)
    key = ("source", "192.0.2.7")
    assert limiter.allow(key) and not limiter.allow(key)
    assert "rate limiting anonymous peer at 192.0.2.7" in caplog.text
