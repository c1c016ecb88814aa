"""Counts of the lookups a node ran, kept inside the DHT so every lookup is counted where it runs.

A daemon exports them as metrics; the DHT itself knows nothing of Prometheus. Both label sets are
closed: the kind is the protocol query a lookup repeats, the outcome one of four words, so no peer
and no key can add a series.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lookup import LookupResult

#: FIND_NODE lookups find peers (joins, stores, discovery); FIND_VALUE lookups are gets.
LOOKUP_KINDS = ("find_node", "find_value")
#: answered: at least one peer answered; unanswered: nobody did (an empty table counts here);
#: cancelled: the caller gave up; error: the lookup raised.
LOOKUP_OUTCOMES = ("answered", "unanswered", "cancelled", "error")


@dataclass
class LookupStats:
    """Running totals; everything runs on the node's event loop, so plain integers suffice."""

    lookups: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(k, o): 0 for k in LOOKUP_KINDS for o in LOOKUP_OUTCOMES})
    rpcs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOOKUP_KINDS, 0))
    failed_rpcs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOOKUP_KINDS, 0))

    def finished(self, kind: str, result: LookupResult) -> None:
        self.lookups[(kind, "answered" if result.nearest else "unanswered")] += 1
        self.rpcs[kind] += result.rpcs
        self.failed_rpcs[kind] += result.failures

    def ended(self, kind: str, outcome: str) -> None:
        """A lookup that produced no result (`cancelled` or `error`)."""
        self.lookups[(kind, outcome)] += 1
