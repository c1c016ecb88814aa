"""Every DHT setting, named, with a default and the reason for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.errors import ConfigError


@dataclass(frozen=True)
class DHTConfig:
    # --- Kademlia shape ---
    #: Bucket size and the number of nodes a lookup converges on (the paper's k; 20 makes it very
    #: unlikely that all replicas of a record leave within one refresh period).
    k: int = 20
    #: Concurrent queries per lookup (the paper's alpha): enough to hide one slow peer, few enough
    #: not to flood the network.
    alpha: int = 3
    #: Relaxed split rule: a bucket not containing our own id still splits while its depth is not a
    #: multiple of b (the paper's "b" from section 4.2), which keeps lookups O(log n) on skewed tables.
    split_every_bits: int = 5
    #: Recently seen contacts kept per full bucket to replace contacts that stop answering.
    replacement_cache: int = 20
    #: Misses before a contact is dropped for a replacement; one miss is often a transient blip,
    #: and kademlia's evict-on-first-miss churns good contacts out on a busy link.
    max_failures: int = 3
    #: Contacts allowed per IP prefix in one bucket / in the whole table: stops one subnet (one
    #: attacker with many keys) from filling our view of a region of the key space.
    max_per_prefix_bucket: int = 2
    max_per_prefix_table: int = 10
    #: Prefix lengths that define "the same network" for the limits above.
    ipv4_prefix_bits: int = 24
    ipv6_prefix_bits: int = 64
    #: Loopback addresses are exempt, so many nodes on 127.0.0.1 (tests, benchmarks) work.
    prefix_limit_exempt_loopback: bool = True

    # --- RPC and lookups ---
    #: Per-call timeout: a live peer on a slow WAN answers in well under a second; a frozen one must
    #: cost little. 1.5 s is the middle of the 1-2 s the design asks for.
    rpc_timeout: float = 1.5
    #: A lookup worker waits this long for a query before it asks the next candidate too (the
    #: slow query keeps running and its answer still counts). Live peers on a WAN answer in well
    #: under 0.5 s; frozen ones would otherwise stall all alpha workers for a full timeout.
    lookup_patience: float = 0.5
    #: After a failed call a peer is skipped by lookups for this long (doubling per further failure,
    #: capped), so a dead contact costs one timeout once rather than once per lookup.
    backoff_initial: float = 15.0
    backoff_max: float = 300.0
    #: Peers remembered as backed off (bounded: the set is fed by third parties' contact lists).
    max_backoff_entries: int = 4096
    #: A get stops once at least this many replicas returned records for the key (merged, newest
    #: wins) and the last `get_confirmations` of them added nothing new. With consistent replicas
    #: that is 3 answers; a replica that missed a store (a writer whose lookup met timeouts stored
    #: on a slightly different set) makes the get keep asking instead of returning short.
    get_quorum: int = 3
    get_confirmations: int = 2
    #: A get that has found no record at all ends once this many of the closest contacts have
    #: answered empty, none of them failed (else it walks on to get_width): a key's records live on its k closest nodes, so when the 5
    #: closest hold nothing the key is (almost surely) absent, and walking on to all k would make
    #: every miss (a job index nobody wrote yet, a stage nobody serves) cost k queries, a number
    #: that grows with the swarm up to k. A get that found records still walks to its quorum.
    get_miss_settle: int = 5
    #: Width of a get's lookup, and the contacts it asks each node for (`n`): the quorum, its
    #: confirmations and a few replicas that missed a store. Records live on the `replication`
    #: closest nodes, so the closest 8 hold them; asking for k = 20 contacts per reply made every
    #: get's replies grow with the swarm until it passed 20 nodes. A k below it is the width.
    get_width: int = 8
    #: Results are cached until the earliest record expires, but never longer than this: readers
    #: want new announcers within seconds.
    get_cache_max_s: float = 2.0
    #: Nodes that receive each store. The issue asks for the k closest live nodes: with k = 20 a
    #: record survives the loss of most of its replicas between two refreshes.
    replication: int = 20

    # --- records and storage limits ---
    #: Raw key bytes (e.g. msgpack of ("job", id, "stage", 3)); keys are names, not payloads.
    max_key_bytes: int = 256
    #: Subkey bytes: a peer id is 32; open namespaces may use short names.
    max_subkey_bytes: int = 64
    #: A stage announcement is ~100 bytes and a job spec a few KiB.
    max_value_bytes: int = 8192
    #: Writers kept per key (a stage rarely has more than a few hundred peers); over it a newcomer
    #: evicts only from the network holding the most subkeys there (see storage.py).
    max_subkeys_per_key: int = 512
    #: Subkeys of one key stored from one source network: identities are free, addresses are not,
    #: so one /24 (or one host, or loopback) cannot take more than an eighth of a key. A hand-off
    #: (a node relaying a key's records) counts against the relayer; the writers' own refreshes
    #: move each record back to their networks.
    max_subkeys_per_source: int = 64
    #: What "one source network" is for the two limits above: the prefix of the address a store's
    #: connection came from (never a claimed address). An IPv6 /64 is one host's, and a site's
    #: /48 holds 65536 of them, so IPv6 sources are /48s.
    #: Share of the node-wide limits (`max_keys` records, `max_total_bytes`) one source network may
    #: hold, over every key together: the per-key quota alone let one address fill all 65,536 key
    #: slots with unsigned open records under fresh keys in 1,024 RPCs, and the node then refused every
    #: new job's announcements. An eighth makes filling a node take eight networks. The node's own
    #: records (`LOCAL_SOURCE`) are not held to it.
    max_source_share: float = 0.125
    source_ipv4_prefix_bits: int = 24
    source_ipv6_prefix_bits: int = 48
    #: Distinct keys one node holds (records for ~1000 jobs x stages, with room to spare).
    max_keys: int = 65536
    #: Total value+subkey bytes held, so a node's memory use is bounded whatever peers send.
    max_total_bytes: int = 64 * 1024 * 1024
    #: Records in one store RPC: bounds the work per request.
    max_records_per_store: int = 64
    #: Encoded record bytes in one store request or find_value reply. The transport refuses a
    #: header over 64 KiB (Limits.max_header_bytes), and a reply over it used to fail the whole
    #: find_value with "internal"; 48 KiB leaves room for the contacts and the map around them.
    #: A key holding more answers a fair sample (storage.Storage.sample); readers merge replicas.
    max_message_record_bytes: int = 48 * 1024
    #: Records held on behalf of one origin (signer, or sender of unsigned records), so one peer
    #: flooding us cannot push out everyone else.
    max_records_per_origin: int = 1024
    #: Stores may not set an expiration further than this into the future (wall clock): the cap
    #: for open namespaces.
    max_ttl: float = 24 * 3600.0
    #: The cap for every namespace with the peer rule (stage announcements, job specs, job ends,
    #: the jobs index): all are announcements re-stored every refresh_interval, so five periods
    #: survive four lost refreshes, and a slot taken by a writer that stored once and left frees
    #: within minutes instead of a day. Keep it above announce_ttl.
    max_announce_ttl: float = 150.0
    #: Contacts returned by find_node/find_value (we read at most this many from a reply).
    max_contacts_per_reply: int = 20
    #: Address string bytes in a contact.
    max_address_bytes: int = 256
    #: Namespaces (first element of a key) whose records may be unsigned and under any subkey.
    open_namespaces: frozenset[str] = field(default_factory=lambda: frozenset({"open"}))

    # --- maintenance ---
    #: Announcements are re-stored this often; 30 s makes a preempted peer vanish within ~2 minutes.
    refresh_interval: float = 30.0
    #: TTL given to announcements: 3x refresh survives two lost refreshes.
    announce_ttl: float = 90.0
    #: Expired records are dropped from reads at once and from memory at this interval.
    prune_interval: float = 5.0
    #: Buckets not looked up for this long get a lookup of a random id inside them (the paper
    #: says an hour; preemptible swarms churn faster, so ten minutes).
    bucket_refresh_interval: float = 600.0
    #: While no contact in the routing table answers, retry the bootstrap peers this often (also
    #: the tick of the bucket-refresh check).
    rebootstrap_interval: float = 5.0
    #: Pending record hand-offs to newly seen closer nodes (bounded queue; extras wait for the
    #: announcers' next refresh).
    max_pending_handoffs: int = 256

    def __post_init__(self) -> None:
        """Raises `ConfigError` keyed by the field (the daemon's config places it under `dht.`), so
        a refused combination reaches the operator as a setting to fix, like any other."""
        if not self.max_announce_ttl > self.refresh_interval:
            raise ConfigError("max_announce_ttl", f"{self.max_announce_ttl:g} s must exceed refresh_interval "
                              f"({self.refresh_interval:g} s), or storers drop announcements between refreshes")
        if not 0.0 < self.max_source_share <= 1.0:
            raise ConfigError("max_source_share", "must be in (0, 1]: the share of a node one network may hold")
        if not 1 <= self.get_miss_settle <= self.get_width:
            raise ConfigError("get_miss_settle", f"need 1 <= get_miss_settle ({self.get_miss_settle}) "
                              f"<= get_width ({self.get_width})")
        if self.max_subkeys_per_source < 1:
            raise ConfigError("max_subkeys_per_source", "must be at least 1, or no network could store anything")
