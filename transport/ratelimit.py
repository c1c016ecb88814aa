"""Per-peer token buckets for incoming calls, shared by every connection of one server.

A proven peer is limited by its peer id (reconnecting does not refill its bucket); an anonymous
one by its source host. Calls past the rate are answered with code "rate_limited" before their
handler runs, so a flooding peer gets errors while the others' calls go through untouched.

The table is bounded (`max_buckets`): when full, the least recently used bucket is forgotten.
A peer that cycles through more identities than that can get fresh buckets, but each identity
costs it a full handshake, and the per-connection `max_concurrent_handlers` still caps the work
each connection can start.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class _Bucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens, self.stamp = tokens, stamp


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
            return False
        bucket.tokens -= 1
        return True
