"""Per-peer token buckets for incoming calls, shared by every connection of one server.

A proven peer is limited by its peer id (reconnecting does not refill its bucket); an anonymous
one by its source host. Calls past the rate are answered with code "rate_limited" before their
handler runs, so a flooding peer gets errors while the others' calls go through untouched.

A flooder must also be named, not only slowed: each bucket counts the calls it let through and
refused, and the first refusal of a flood is logged with the peer's id (once per flood: the line
comes again only after the bucket has refilled to its burst, i.e. after a quiet spell). Each
bucket also keeps its lowest level, which is how far an honest peer's bursts come from the limit
(what docs/security.md's measured headroom is read from).

The table is bounded (`max_buckets`): when full, the least recently used bucket is forgotten.
A peer that cycles through more identities than that can get fresh buckets, but each identity
costs it a full handshake, and the per-connection `max_concurrent_handlers` still caps the work
each connection can start.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerCalls:
    """What one peer's bucket saw: calls let through, calls refused, and the fewest tokens it
    held right after a call (the burst means it never came near the limit; below 1, refused)."""

    allowed: int
    refused: int
    lowest_tokens: float


class _Bucket:
    __slots__ = ("tokens", "stamp", "allowed", "refused", "lowest", "flooding")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens, self.stamp = tokens, stamp
        self.allowed = self.refused = 0
        self.lowest = tokens
        self.flooding = False


def describe(key: Hashable) -> str:
    """A bucket key as an operator reads it: the peer id in hex, or the anonymous source host."""
    if isinstance(key, bytes):
        return f"peer {key.hex()}"
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "source":
        return f"anonymous peer at {key[1]}"
    return repr(key)


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: float, max_buckets: int, clock: Callable[[], float]) -> None:
        if not rate_per_s > 0 or not burst >= 1 or max_buckets < 1:
            raise ValueError("a rate limiter needs rate_per_s > 0, burst >= 1 and max_buckets >= 1")
        self._rate, self._burst, self._max = rate_per_s, burst, max_buckets
        self._clock = clock
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: Hashable) -> bool:
        """Spend one token of `key`'s bucket; False when it is empty."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._max:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = _Bucket(self._burst, now)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.stamp) * self._rate)
            bucket.stamp = now
        if bucket.tokens < 1:
            bucket.refused += 1
            bucket.lowest = min(bucket.lowest, bucket.tokens)
            if not bucket.flooding:
                bucket.flooding = True
                log.warning("rate limiting %s: over %s calls/s (burst %s); its calls are refused until it "
                            "slows down", describe(key), self._rate, self._burst)
            return False
        if bucket.tokens >= self._burst:
            bucket.flooding = False
        bucket.tokens -= 1
        bucket.allowed += 1
        bucket.lowest = min(bucket.lowest, bucket.tokens)
        return True

    def calls(self) -> dict[Hashable, PeerCalls]:
        """Per remembered peer: its counts since its bucket was made (for metrics and tests)."""
        return {key: PeerCalls(b.allowed, b.refused, b.lowest) for key, b in self._buckets.items()}
