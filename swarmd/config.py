"""One frozen, nested configuration, built once from defaults, a TOML file, `SWARMD_*` variables and flags.

Every setting is declared exactly once, as a dataclass field whose metadata carries its kind, its
reason and (optionally) its command-line flag; the TOML keys, the environment names
(`SWARMD_<SECTION>_<KEY>`), the flags, `--check-config` output and the example file's coverage test
are all derived from that one declaration, so an option cannot drift between its four spellings.

Precedence is flag > environment > file > default. A bad value anywhere raises `ConfigError`, which
names where it came from and which key, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from swarmd import swarmkey
from swarmd.dht.config import DHTConfig
from swarmd.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("/etc/swarmd/swarmd.toml")
CONFIG_ENV = "SWARMD_CONFIG"
ENV_PREFIX = "SWARMD_"
SOCKET_NAME = "swarmd.sock"


@dataclass(frozen=True, order=True)
class Address:
    """A `host:port` pair; IPv6 hosts are written in brackets (`[::1]:7420`)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>[0-9]{1,5})$")


def parse_address(text: str, *, allow_port_zero: bool = False) -> Address:
    """Parse `host:port`; port 0 (let the OS choose) only makes sense for addresses we listen on."""
    match = _ADDRESS.match(text.strip())
    if not match:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(match["port"])
    if port > 65535 or (port == 0 and not allow_port_zero):
        raise ValueError(f"port must be in 1..65535, got {port} in {text!r}")
    return Address(match["v6"] or match["host"], port)


# ---------------------------------------------------------------------------------------------------
# Kinds: how one setting is read from TOML (typed) and from a flag or variable (text).


@dataclass(frozen=True)
class Kind:
    """Parses a value of one setting; `from_toml` receives a TOML value, `from_text` a string."""

    name: str
    from_text: Callable[[str], Any]
    from_toml: Callable[[Any], Any]
    to_toml: Callable[[Any], Any] = lambda v: v


def _typed(expected: type | tuple[type, ...], label: str, then: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
            raise ValueError(f"expected {label}, got a boolean")
        if not isinstance(value, expected):
            raise ValueError(f"expected {label}, got {type(value).__name__} {value!r}")
        return then(value)

    return check


def _number(low: float, cast: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        try:
            value = cast(value)
        except OverflowError:  # an integer past a float's range (~1.8e308)
            raise ValueError(f"{str(value)[:20]}... is too large") from None
        if value != value:
            raise ValueError("must be a number, got nan")
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value

    return check


def _int_text(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        return _number(low, int)(value)

    return parse


def _float_text(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return _number(low, float)(value)

    return parse


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _bool_text(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError(f"expected true or false, got {text!r}")


def _choice(choices: Sequence[str]) -> Kind:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return Kind("|".join(choices), parse, _typed(str, "a string", parse))


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]{1,3}", text):
        return text
    raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def _optional_address(text: str) -> Address | None:
    return parse_address(text) if text.strip() else None


def _optional_listen(text: str) -> Address | None:
    return parse_address(text, allow_port_zero=True) if text.strip() else None


def _address_list(text: str) -> tuple[Address, ...]:
    return tuple(parse_address(part) for part in text.split(",") if part.strip())


def _address_list_toml(value: Any) -> tuple[Address, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of \"HOST:PORT\" strings, got {value!r}")
    return tuple(parse_address(v) for v in value)


def _path(text: str) -> Path:
    if not text:
        raise ValueError("expected a path, got an empty string")
    return Path(text)


def _int_kind(low: int) -> Kind:
    return Kind("N", _int_text(low), _typed(int, "an integer", _number(low, int)))


def _float_kind(low: float) -> Kind:
    return Kind("N", _float_text(low), _typed((int, float), "a number", _number(low, float)))


BOOL = Kind("boolean", _bool_text, _typed(bool, "true or false", bool))
PATH = Kind("PATH", _path, _typed(str, "a path string", _path), str)
LISTEN = Kind(
    "HOST:PORT",
    lambda t: parse_address(t, allow_port_zero=True),
    _typed(str, "a \"HOST:PORT\" string", lambda t: parse_address(t, allow_port_zero=True)),
    str,
)
OPTIONAL_ADDRESS = Kind(
    "HOST:PORT or empty", _optional_address, _typed(str, "a \"HOST:PORT\" string", _optional_address),
    lambda v: "" if v is None else str(v),
)
OPTIONAL_LISTEN = Kind(
    "HOST:PORT or empty", _optional_listen, _typed(str, "a \"HOST:PORT\" string", _optional_listen),
    lambda v: "" if v is None else str(v),
)
ADDRESSES = Kind("list of HOST:PORT", _address_list, _address_list_toml, lambda v: [str(a) for a in v])
def _string_set_toml(value: Any) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return frozenset(value)


STRING_SET = Kind(
    "list of names", lambda t: frozenset(p.strip() for p in t.split(",") if p.strip()), _string_set_toml, sorted,
)
def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


OPTIONAL_PATH = Kind(
    "PATH or empty", _optional_path, _typed(str, "a path string", _optional_path), lambda v: "" if v is None else str(v),
)
#: Bytes of a public key and of a peer id (SHA-256 of the key): an allow-list entry is either.
KEY_BYTES = 32


def _hex_key(text: str) -> bytes:
    cleaned = text.strip()
    try:
        key = bytes.fromhex(cleaned)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"expected {2 * KEY_BYTES} hex digits (a public key or peer id), got {cleaned!r}")
    return key


def _hex_keys_toml(value: Any) -> frozenset[bytes]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of hex strings, got {value!r}")
    return frozenset(_hex_key(v) for v in value)


HEX_KEYS = Kind(
    "list of hex keys", lambda t: frozenset(_hex_key(p) for p in t.split(",") if p.strip()), _hex_keys_toml,
    lambda v: sorted(k.hex() for k in v),
)
DEVICE = Kind("auto|cpu|cuda|cuda:N", _device, _typed(str, "a string", _device))
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def setting(default: Any, kind: Kind, why: str, *, flag: str | None = None, derived: bool = False) -> Any:
    """Declare one setting: its default, its kind, the reason for the default, its flag if any.

    `derived` marks defaults computed from the environment at load time (paths that depend on
    systemd's directory variables); the declared default is then only a placeholder.
    """
    return field(default=default, metadata={"kind": kind, "why": why, "flag": flag, "derived": derived})


# ---------------------------------------------------------------------------------------------------
# The configuration itself.


@dataclass(frozen=True)
class DaemonSection:
    state_dir: Path = setting(
        Path("/var/lib/swarmd"), PATH,
        "identity key and checkpoints; $STATE_DIRECTORY under systemd, else /var/lib/swarmd when "
        "writable, else ~/.local/state/swarmd", flag="--state-dir", derived=True,
    )
    device: str = setting("auto", DEVICE, "auto picks cuda when a GPU is visible, else cpu", flag="--device")
    drain_timeout_s: float = setting(
        20.0, _float_kind(0.0),
        "a spot VM gets about 30 s notice; 20 s leaves room to withdraw announcements and flush state",
        flag="--drain-timeout",
    )


@dataclass(frozen=True)
class NetworkSection:
    listen: Address = setting(
        Address("0.0.0.0", 7420), LISTEN, "where peers reach this daemon; port 0 lets the OS choose",
        flag="--listen",
    )
    announce: Address | None = setting(
        None, OPTIONAL_ADDRESS,
        "the address other peers should dial when it differs from listen (NAT, 0.0.0.0); empty = listen",
        flag="--announce",
    )
    bootstrap: tuple[Address, ...] = setting(
        (), ADDRESSES, "known peers to join through; none makes this the first node of a new swarm",
        flag="--bootstrap",
    )
    require_bootstrap: bool = setting(
        False, BOOL, "exit instead of running alone when no bootstrap peer answers", flag="--require-bootstrap",
    )
    bootstrap_retry_initial_s: float = setting(
        1.0, _float_kind(0.01), "first retry soon: the bootstrap peer is often just starting too",
    )
    bootstrap_retry_max_s: float = setting(
        60.0, _float_kind(0.01), "cap the backoff so a swarm that comes back is rejoined within a minute",
    )
    require_bootstrap_timeout_s: float = setting(
        30.0, _float_kind(0.1), "with require_bootstrap, how long to keep retrying before giving up",
    )
    swarm_key_file: Path | None = setting(
        None, OPTIONAL_PATH,
        "a private swarm's shared key (make one with `swarmctl keygen`); peers without it are dropped in "
        "the hello; mode 0600 or the daemon refuses to start; empty = an open swarm", flag="--swarm-key-file",
    )
    encrypt: bool = setting(
        False, BOOL,
        "seal all peer traffic (ChaCha20-Poly1305); every peer of the swarm must agree; off on trusted networks",
        flag="--encrypt",
    )
    rpc_rate_limit_per_s: float = setting(
        1000.0, _float_kind(0.0),
        "calls per second one peer may start here (past it: rate_limited); a trainer's steady rate is "
        "tens to hundreds; 0 turns the limit off",
    )
    rpc_rate_limit_burst: int = setting(
        256, _int_kind(1), "calls a peer may start at once after a quiet spell (a pipeline step's microbatches)",
    )
    rpc_rate_limit_peers: int = setting(
        4096, _int_kind(1), "peers whose rate buckets are remembered; the least recently seen is forgotten",
    )
    max_unproven_per_source: int = setting(
        16, _int_kind(1), "connections one host may hold in their hello (a slow-loris cap; NAT'd neighbours fit)",
    )
    max_unproven_connections: int = setting(
        256, _int_kind(1), "connections in their hello from all hosts together (~10 MiB and 256 fds at most)",
    )
    handshake_timeout_s: float = setting(
        10.0, _float_kind(0.1),
        "seconds a connection may take to prove itself (hello, key proof) before it is dropped; covers a "
        "100 ms-RTT link several times over while bounding how long a slow-loris holds a slot",
    )


@dataclass(frozen=True)
class ControlSection:
    socket: Path = setting(
        Path("/run/swarmd/swarmd.sock"), PATH,
        "$RUNTIME_DIRECTORY/swarmd.sock under systemd, else /run/swarmd/swarmd.sock when writable, "
        "else $XDG_RUNTIME_DIR/swarmd/swarmd.sock", flag="--socket", derived=True,
    )
    max_connections: int = setting(
        64, _int_kind(1), "local clients are few; a cap stops a runaway script from exhausting fds",
    )


@dataclass(frozen=True)
class PeersSection:
    ping_interval_s: float = setting(
        2.0, _float_kind(0.05), "how often every known peer is pinged to refresh its last-seen time",
    )
    liveness_window_s: float = setting(
        10.0, _float_kind(0.1),
        "a peer unheard of for this long is reported dead; several ping intervals so one lost ping "
        "on a slow link does not flap it",
    )
    ping_timeout_s: float = setting(3.0, _float_kind(0.05), "a ping slower than this counts as lost")
    ping_sample: int = setting(
        8, _int_kind(1),
        "contacts pinged per interval, those pinged longest ago first: a daemon's ping traffic then stays "
        "the same however large the swarm; each contact is pinged every ceil(contacts / ping_sample) intervals, "
        "which liveness_window_s should cover",
    )
    discovery_interval_s: float = setting(
        30.0, _float_kind(0.1),
        "a lookup of our own id this often: Kademlia learns of peers only through traffic, so a quiet "
        "swarm would otherwise not hear of a newcomer until a bucket refresh (minutes)",
    )
    discovery_nearest: int = setting(
        3, _int_kind(1),
        "how many nearest peers that lookup looks for: it only has to meet our neighbours (who then know "
        "of us) and hear of theirs; a full k = 20 lookup costs each daemon traffic that grows with the swarm",
    )
    max_peers_reported: int = setting(
        1024, _int_kind(1), "bounds the peers reply; the routing table may know more",
    )


@dataclass(frozen=True)
class LogSection:
    level: str = setting("info", _choice(LOG_LEVELS), "info shows joins, leaves and retries", flag="--log-level")
    format: str = setting(
        "text", _choice(LOG_FORMATS), "text for people and journald; json for log shippers", flag="--log-format",
    )
    warnings_per_source: int = setting(
        5, _int_kind(1), "warnings about one remote source per window: a peer sending junk on purpose "
        "must not write our disk at its pace",
    )
    warning_window_s: float = setting(
        60.0, _float_kind(0.01), "the window of warnings_per_source; the next line after it counts those dropped",
    )


@dataclass(frozen=True)
class MetricsSection:
    listen: Address | None = setting(
        None, OPTIONAL_LISTEN, "Prometheus endpoint; off by default so nothing extra listens", flag="--metrics",
    )


def _serve_rule(value: Any) -> str | frozenset[str]:
    """`jobs.serve`: "all", "none", or job names and submitter keys (hex), from TOML or from text."""
    if isinstance(value, str):
        if value in ("all", "none"):
            return value
        value = [part for part in value.split(",") if part.strip()]
        if not value:
            raise ValueError('expected "all", "none" or job names / submitter keys, got an empty string')
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f'expected "all", "none" or a list of job names / submitter keys (hex), got {value!r}')
    if not value:
        raise ValueError('an empty list serves nothing: write "none"')
    return frozenset(v.strip() for v in value)


SERVE_RULE = Kind('all|none|list of job names or submitter keys', _serve_rule, _serve_rule,
                  lambda v: v if isinstance(v, str) else sorted(v))


@dataclass(frozen=True)
class JobsSection:
    max_stages: int = setting(
        4, _int_kind(0), "stages of all jobs this daemon hosts at once (job.serve beyond it is refused); 0 serves none",
    )
    max_stage_memory: int = setting(
        0, _int_kind(0),
        "bytes one served stage may need by its job spec's estimate (weights, gradients, optimizer state, "
        "activations at the spec's batch); a larger stage is refused with the estimate in the reason; 0: half "
        "of this machine's RAM (of the GPU's memory when serving on CUDA) divided among max_stages",
    )
    directory_ttl_s: float = setting(
        1.0, _float_kind(0.0),
        "how long a DHT read of a stage's peers is reused; announcements change only at their refresh",
    )
    torch_threads: int = setting(
        1, _int_kind(1), "torch threads per served stage's compute workers; raise on a big CPU host",
    )
    serve: str | frozenset[str] = setting(
        "none", SERVE_RULE,
        "which jobs' stages this daemon joins on its own (within max_stages and max_stage_memory): none by "
        "default, since any identity in the swarm may publish a job; \"all\" lends this machine to every "
        "accepted job (pair it with accept_jobs_from or a swarm key), or name the jobs (by name or submitter key)",
    )
    join_interval_s: float = setting(
        5.0, _float_kind(0.1),
        "how often the jobs index is read for jobs to join (jittered); a new job waits at most about this long",
    )
    min_stage_peers: int = setting(
        2, _int_kind(1),
        "automatic joining fills every stage of a job to this many peers before it weighs capacity: a stage "
        "with one peer stops the whole job when that peer fails",
    )
    join_settle_s: float = setting(
        2.0, _float_kind(0.0),
        "between announcing the stage a daemon means to join and deciding again with the daemons that "
        "announced meanwhile (they spread instead of piling onto one stage); a DHT store and read, under load",
    )
    rejoin_wait_s: float = setting(
        300.0, _float_kind(0.0),
        "how long a restarted daemon looks for a job it served before forgetting it (gone or cancelled)",
    )
    data_max_files: int = setting(
        4096, _int_kind(1),
        "files one submission's data.files patterns may match; a larger corpus belongs in a data.tokens file",
    )
    data_max_entries: int = setting(
        50_000, _int_kind(1),
        "directory entries the daemon looks at expanding one submission's data.files patterns (a `/**` "
        "walks the whole filesystem otherwise)",
    )
    accept_jobs_from: frozenset[bytes] = setting(
        frozenset(), HEX_KEYS,
        "submitters (public keys or peer ids, hex) whose jobs this daemon learns, serves and trains; "
        "empty accepts every submitter of the swarm; jobs submitted here are always accepted",
    )
    max_jobs_per_submitter: int = setting(
        64, _int_kind(1),
        "job ids read from one submitter's entry in the jobs index (its newest), and jobs this daemon may "
        "submit; bounds what one identity makes every daemon look up",
    )
    index_lookups_per_refresh: int = setting(
        16, _int_kind(1),
        "spec lookups (and as many end-record lookups) one read of the jobs index may run; the rest wait "
        "for the next read, so made-up ids cannot make a daemon look up without end",
    )
    index_miss_ttl_s: float = setting(
        300.0, _float_kind(0.0),
        "how long a listed job id whose spec was not found (or not valid) is not looked up again",
    )
    index_forget_after_s: float = setting(
        600.0, _float_kind(0.0),
        "how long a job learned from the jobs index may be missing from it before this daemon forgets it "
        "(learned again if listed again), so fresh ids listed at every read cannot grow the known jobs for ever",
    )


@dataclass(frozen=True)
class RebalanceSection:
    """Adaptive rebalancing (docs/rebalancing.md): the load gossip and the periodic move check that
    every daemon runs for each job it serves a stage of. Defaults are the ones `bench/rebalance.py`
    chose; short periods are for tests and demos."""

    enabled: bool = setting(
        True, BOOL, "gossip load and move to the bottleneck stage; off pins served stages where job.serve put them",
    )
    period_s: float = setting(
        300.0, _float_kind(0.1),
        "seconds between a peer's move checks (the paper's T); a gap must outlive part of a period "
        "before a state download is spent on it",
    )
    jitter: float = setting(
        0.5, _float_kind(0.0), "each period is scaled by a factor in [1 - jitter, 1 + jitter] so checks do not align",
    )
    confirm_after_s: float = setting(
        10.0, _float_kind(0.01),
        "a move is taken only when a second check this much later confirms it: time for fresh gossip",
    )
    margin: float = setting(
        0.01, _float_kind(0.0), "a move must raise the predicted pipeline throughput by more than this fraction",
    )
    max_moves: int = setting(256, _int_kind(1), "moves one swarm-wide plan may hold; bounds a plan's cost")
    speed_tolerance: float = setting(
        0.3, _float_kind(0.0),
        "relative error assumed of one measured peer speed: peers and stages alike within it are told apart "
        "by noise-free keys, so every peer's plan names the same mover (below 1)",
    )
    gossip_interval_s: float = setting(
        5.0, _float_kind(0.05), "seconds between gossip rounds: load entries reach hundreds of peers in a few rounds",
    )
    gossip_fanout: int = setting(3, _int_kind(1), "peers exchanged with per gossip round (push-pull)")
    gossip_max_entries: int = setting(
        16, _int_kind(0),
        "load entries besides a peer's own in one gossip exchange, a random sample of its view: an exchange "
        "stays ~3 KB however large the job, and entries still spread in a few rounds",
    )
    gossip_timeout_s: float = setting(
        3.0, _float_kind(0.05), "one gossip exchange; a slower partner is skipped for the round and backed off",
    )
    membership_ttl_s: float = setting(
        15.0, _float_kind(0.05),
        "how long the gossip reuses the DHT's list of a job's peers (one lookup per stage); entries of "
        "peers not on it are refused",
    )
    drain_timeout_s: float = setting(
        30.0, _float_kind(0.0),
        "a moving peer waits this long for its queued work to finish before leaving its stage anyway "
        "(what is still queued is refused and re-routed by the trainers)",
    )


@dataclass(frozen=True)
class TrainerSection:
    """How this daemon's trainers time their calls and take over a dead trainer's share
    (docs/trainer.md). A call's timeout follows the peer's measured rate between a floor and the
    ceilings below, so a slow link or a big stage can be given room without slowing failover."""

    forward_timeout_s: float = setting(
        30.0, _float_kind(0.1), "ceiling of a forward call's timeout (a peer not measured yet, or one that just timed out)",
    )
    backward_timeout_s: float = setting(
        75.0, _float_kind(0.1), "ceiling of a backward (and forward_backward) call's timeout: ~2.5 forwards of work",
    )
    timeout_floor_s: float = setting(
        5.0, _float_kind(0.01), "no call times out sooner, however fast the peer measured: queues and links vary",
    )
    timeout_factor: float = setting(
        4.0, _float_kind(1.0), "a call's timeout is this many times its expected time at the peer's measured rate",
    )
    takeover_min_s: float = setting(
        20.0, _float_kind(0.0),
        "another trainer's microbatch is taken over only after it looked undone this long (trainers of one "
        "job start seconds apart; taking a live trainer's share is wasted work)",
    )
    eval_workers: int = setting(
        4, _int_kind(1), "held-out batches ([eval]) one evaluation keeps in flight: bounded so it never floods the "
                         "stages' queues",
    )
    eval_max_attempts: int = setting(
        8, _int_kind(1), "peers one stage.evaluate call may try before the evaluation is given up (never fatal)",
    )

    stage_info_straggler_s: float = setting(
        0.5, _float_kind(0.0),
        "once one peer of a stage answered stage.info, how much longer the others get (the spread of round "
        "trips to a stage's peers); then they count as not answering",
    )
    stage_info_skip_s: float = setting(
        5.0, _float_kind(0.0),
        "a peer that did not answer stage.info in time is not asked again for this long, doubling per miss "
        "(a hung peer must not cost every commit poll)",
    )
    stage_info_skip_max_s: float = setting(
        60.0, _float_kind(0.0), "the longest a peer that keeps missing stage.info is left out of the polls",
    )

    def trainer_config(self) -> Any:
        """The `swarmd.train.TrainerConfig` these settings make (imported here: torch loads with it)."""
        from swarmd.train.assignment import TakeoverPolicy
        from swarmd.train.evaluation import EvaluationConfig
        from swarmd.train.trainer import TrainerConfig
        from swarmd.train.wiring import WiringConfig

        return TrainerConfig(forward_timeout_s=self.forward_timeout_s, backward_timeout_s=self.backward_timeout_s,
                             stage_info_straggler_s=self.stage_info_straggler_s,
                             stage_info_skip_s=self.stage_info_skip_s, stage_info_skip_max_s=self.stage_info_skip_max_s,
                             takeover=TakeoverPolicy(min_s=self.takeover_min_s),
                             evaluation=EvaluationConfig(workers=self.eval_workers,
                                                         max_attempts=self.eval_max_attempts),
                             wiring=WiringConfig(timeout_floor_s=self.timeout_floor_s,
                                                 timeout_factor=self.timeout_factor))


@dataclass(frozen=True)
class Config:
    """Everything a daemon needs, passed down as one object."""

    daemon: DaemonSection = field(default_factory=DaemonSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    control: ControlSection = field(default_factory=ControlSection)
    peers: PeersSection = field(default_factory=PeersSection)
    log: LogSection = field(default_factory=LogSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    jobs: JobsSection = field(default_factory=JobsSection)
    rebalance: RebalanceSection = field(default_factory=RebalanceSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    #: The DHT's own settings (swarmd.dht.config.DHTConfig, explained in docs/dht.md): its fields
    #: are taken as they are, their kinds read off their defaults, so a new DHT limit is
    #: configurable here without being declared twice.
    dht: DHTConfig = field(default_factory=DHTConfig)
    config_file: Path | None = None


def sections() -> list[tuple[str, type]]:
    """(section name, section class) in declaration order."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(Config) if f.name != "config_file"]


def _inferred_kind(value: Any) -> Kind | None:
    """The kind of a foreign section's field (DHTConfig), read off its default value."""
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return _int_kind(0)
    if isinstance(value, float):
        return _float_kind(0.0)
    if isinstance(value, frozenset) and all(isinstance(v, str) for v in value):
        return STRING_SET
    return None


def kind_of(section: str, f: dataclasses.Field) -> Kind:
    return f.metadata.get("kind") or _FOREIGN_KINDS[(section, f.name)]


def why_of(f: dataclasses.Field) -> str:
    return f.metadata.get("why", "see docs/dht.md")


def _fields(section: str, cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "kind" in f.metadata or (section, f.name) in _FOREIGN_KINDS]


def settings() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every setting, in declaration order."""
    return [(name, f) for name, cls in sections() for f in _fields(name, cls)]


_FOREIGN_KINDS: dict[tuple[str, str], Kind] = {
    ("dht", f.name): kind
    for f in dataclasses.fields(DHTConfig)
    if (kind := _inferred_kind(getattr(DHTConfig(), f.name))) is not None
}


def env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


# ---------------------------------------------------------------------------------------------------
# Derived defaults: where systemd or the user's session says files go.


def _writable_dir(path: Path) -> bool:
    """True when we may create files in `path` (or create `path` itself in a writable parent)."""
    probe = path if path.exists() else path.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


SYSTEM_SOCKET = Path("/run/swarmd") / SOCKET_NAME


def _user_socket(env: Mapping[str, str]) -> Path:
    runtime = env.get("XDG_RUNTIME_DIR") or f"/tmp/swarmd-{os.getuid()}"
    return Path(runtime) / "swarmd" / SOCKET_NAME


def default_socket(env: Mapping[str, str], *, client: bool = False) -> Path:
    """The control socket path a daemon binds and `swarmctl` dials when nothing says otherwise.

    The daemon takes /run/swarmd only when it may write there, else a per-user path. A client
    dials whichever of the two has a socket (the service's daemon runs as another user), and
    otherwise names the path its own daemon would use, so "no daemon at ..." points somewhere real.
    """
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    if client:
        for candidate in (SYSTEM_SOCKET, _user_socket(env)):
            if candidate.exists():
                return candidate
    return SYSTEM_SOCKET if _writable_dir(SYSTEM_SOCKET.parent) else _user_socket(env)


def default_state_dir(env: Mapping[str, str]) -> Path:
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    system = Path("/var/lib/swarmd")
    if _writable_dir(system):
        return system
    home = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "/tmp")) / ".local" / "state")
    return Path(home) / "swarmd"


_DERIVED: dict[tuple[str, str], Callable[[Mapping[str, str]], Path]] = {
    ("daemon", "state_dir"): default_state_dir,
    ("control", "socket"): default_socket,
}


def default_config_file(env: Mapping[str, str]) -> Path | None:
    """`$CONFIGURATION_DIRECTORY/swarmd.toml` under systemd, else /etc/swarmd/swarmd.toml, when present."""
    candidates = []
    if env.get("CONFIGURATION_DIRECTORY"):
        candidates.append(Path(env["CONFIGURATION_DIRECTORY"].split(":")[0]) / "swarmd.toml")
    candidates.append(DEFAULT_CONFIG_FILE)
    return next((p for p in candidates if p.is_file()), None)


# ---------------------------------------------------------------------------------------------------
# Layers: each returns {(section, key): value} for the settings it sets.

Layer = dict[tuple[str, str], Any]


def _index() -> dict[tuple[str, str], Kind]:
    return {(s, f.name): kind_of(s, f) for s, f in settings()}


def read_file(path: Path) -> Layer:
    """Parse a TOML config file strictly: unknown sections or keys and wrong types are errors."""
    source = str(path)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError("", f"cannot read: {exc.strerror or exc}", source=source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text (byte {exc.start}): TOML files are UTF-8", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"not valid TOML: {exc}", source=source) from None
    except ValueError as exc:  # tomllib's own limits, e.g. an integer of more than 4300 digits
        raise ConfigError("", f"not valid TOML: {exc}", source=source) from None
    kinds, known_sections = _index(), {name for name, _ in sections()}
    layer: Layer = {}
    for section, table in data.items():
        if section not in known_sections:
            raise ConfigError(section, "unknown section", source=source)
        if not isinstance(table, dict):
            raise ConfigError(section, "expected a [table]", source=source)
        for key, value in table.items():
            kind = kinds.get((section, key))
            if kind is None:
                raise ConfigError(f"{section}.{key}", "unknown key", source=source)
            try:
                layer[(section, key)] = kind.from_toml(value)
            except ValueError as exc:
                raise ConfigError(f"{section}.{key}", str(exc), source=source) from None
    return layer


def read_env(env: Mapping[str, str]) -> Layer:
    """Read `SWARMD_<SECTION>_<KEY>` variables; an unknown `SWARMD_*` name is a typo, so an error."""
    kinds = _index()
    by_name = {env_name(s, k): (s, k) for s, k in kinds}
    layer: Layer = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        if name not in by_name:
            raise ConfigError(name, "unknown variable", source="environment")
        key = by_name[name]
        try:
            layer[key] = kinds[key].from_text(text)
        except ValueError as exc:
            raise ConfigError(name, str(exc), source="environment") from None
    return layer


def flag_dest(section: str, key: str) -> str:
    return f"{section}__{key}"


def add_flags(parser: Any) -> None:
    """Add one argparse option per setting that declares a flag; values stay text until `read_flags`."""
    for section, f in settings():
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        kind = kind_of(section, f)
        dest = flag_dest(section, f.name)
        why = f"{f.metadata['why']} [{section}.{f.name}, {env_name(section, f.name)}]"
        if kind is BOOL:
            parser.add_argument(flag, dest=dest, action="store_const", const="true", default=None, help=why)
        elif kind is ADDRESSES:
            parser.add_argument(flag, dest=dest, action="append", metavar="HOST:PORT", default=None, help=why)
        else:
            parser.add_argument(flag, dest=dest, metavar=kind.name.removesuffix(" or empty"), help=why)


def read_flags(namespace: Any) -> Layer:
    layer: Layer = {}
    for section, f in settings():
        flag = f.metadata.get("flag")
        raw = getattr(namespace, flag_dest(section, f.name), None) if flag else None
        if raw is None:
            continue
        kind = kind_of(section, f)
        try:
            layer[(section, f.name)] = (
                tuple(a for item in raw for a in kind.from_text(item)) if kind is ADDRESSES else kind.from_text(raw)
            )
        except ValueError as exc:
            raise ConfigError("", str(exc), source=flag) from None
    return layer


def build(layers: Sequence[Layer], env: Mapping[str, str], config_file: Path | None = None) -> Config:
    """Merge layers (later wins) over the defaults, filling derived defaults from `env`."""
    merged: Layer = {}
    for layer in layers:
        merged.update(layer)
    built = {}
    for section, cls in sections():
        values = {}
        for f in _fields(section, cls):
            key = (section, f.name)
            if key in merged:
                values[f.name] = merged[key]
            elif f.metadata.get("derived"):
                values[f.name] = _DERIVED[key](env)
        try:
            built[section] = cls(**values)
        except ConfigError as exc:  # a section that checks its own fields together (DHTConfig does)
            raise ConfigError(f"{section}.{exc.key}", exc.message, source="configuration") from None
    return Config(**built, config_file=config_file)


def load(namespace: Any, env: Mapping[str, str]) -> Config:
    """The daemon's configuration: flags in `namespace` (with `.config`), over env, file, defaults."""
    explicit = getattr(namespace, "config", None) or env.get(CONFIG_ENV)
    path = Path(explicit) if explicit else default_config_file(env)
    file_layer = read_file(path) if path is not None else {}
    return build([file_layer, read_env(env), read_flags(namespace)], env, path)


def load_swarm_key(network: "NetworkSection") -> bytes | None:
    """The swarm key that `network.swarm_key_file` names (None for an open swarm). Shared by the
    daemon's start and `swarmd --check-config`, so both refuse a bad key file with the same line."""
    if network.swarm_key_file is None:
        return None
    try:
        return swarmkey.load(network.swarm_key_file)
    except swarmkey.SwarmKeyError as exc:
        raise ConfigError("", str(exc), source="network.swarm_key_file") from None


def to_toml(config: Config) -> str:
    """The effective configuration as TOML (what `--check-config` prints); it loads back unchanged."""
    lines = []
    if config.config_file is not None:
        lines.append(f"# read from {config.config_file}")
    for section, cls in sections():
        lines.append(f"[{section}]")
        for f in _fields(section, cls):
            value = kind_of(section, f).to_toml(getattr(getattr(config, section), f.name))
            lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + "".join(_TOML_ESCAPES.get(c) or _escaped_control(c) for c in str(value)) + '"'


#: TOML basic strings need these escaped; every other control character (and DEL) as \uXXXX.
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _escaped_control(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
