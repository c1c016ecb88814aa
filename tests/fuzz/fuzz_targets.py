"""Every decoder and parser that reads bytes we did not write, as a fuzz target fed raw bytes.

Each target states its entry point, the only errors it may raise, its allocation bound (derived from
the limits it runs under) and a seed corpus made by the project's own encoders. Inputs that only the
harness cannot unpack (a codec envelope that is not `[meta, [buffers], aligned]`) are skipped (the
runner returns False, so tests can tell a seed that never reached the module), never counted as
failures; everything the module itself sees is judged by `fuzz_oracle.check`.
The definitions are in docs/fuzzing.md.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import os
import struct
import tempfile
import tomllib
from pathlib import Path

import msgpack
import torch

from fuzz_oracle import InvariantBroken, Target

from swarmd import config as daemon_config
from swarmd.control import register as register_control
from swarmd.dht import protocol as dht_protocol
from swarmd.dht.config import DHTConfig
from swarmd.dht.errors import DHTError
from swarmd.dht.records import dht_key, namespace_of, sign_record, check_record
from swarmd.dht.routing import Contact
from swarmd.dht.storage import Storage
from swarmd.job.errors import SpecError
from swarmd.job.budget import stage_memory
from swarmd.job.spec import LIMITS, JobSpec, parse_toml
from swarmd.jobs.registry import JobRegistry
from swarmd.rebalance.view import GossipView, LoadEntry, RebalanceError, ViewLimits, decode_entries, encode_entries
from swarmd.train.trainer import BanRecord
from transport.codecs import CODECS, DTYPES, buffer_count, decode_tensor, encode_tensor
from transport.errors import HandshakeError, MalformedFrame, ProtocolError, RpcError
from transport.handshake import MAX_HELLO_BYTES, Handshake
from transport.identity import Identity
from transport.limits import KiB, Limits
from transport.message import RemoteInfo, Request, Router
from transport.wire import PRELUDE, MAGIC, VERSION, FrameDecoder, Kind, encode_frame, encode_message

REPO = Path(__file__).resolve().parents[2]
MSGPACK_AMPLIFICATION = 128
"""Bytes of Python objects one msgpack byte may become: a 1-byte empty map is a 64-byte dict plus
its 8-byte slot in a list, so 128 bounds it with room for allocator rounding."""
SMALL_SLACK = 1024 * KiB
"""Fixed allowance of the small parsers (interned strings, exception objects, a dataclass or two)."""
NOW = 1_800_000_000.0
"""The wall clock every DHT and gossip check runs at, so seeds stay valid and runs are repeatable."""

# Limits small enough that every bound is reachable by a fuzzer in a few KiB of input, shaped like
# the defaults (a header is a small share of a frame, a message a few chunks).
FUZZ_LIMITS = Limits(
    max_header_bytes=4 * KiB,
    max_buffers_per_frame=16,
    max_buffer_bytes=64 * KiB,
    max_message_bytes=64 * KiB,
    max_chunk_bytes=8 * KiB,
    max_frame_bytes=16 * KiB,
    max_inflight_bytes=128 * KiB,
    max_str_len=1 * KiB,
    max_bin_len=4 * KiB,
    max_array_len=256,
    max_map_len=64,
    max_tensor_elements=4096,
    max_tensor_dims=8,
    max_decompressed_bytes=64 * KiB,
)


def _msgpack_bound(length: int) -> int:
    return MSGPACK_AMPLIFICATION * length + SMALL_SLACK


def _unpack_like_transport(raw: bytes, limits: Limits = Limits()) -> object:
    """A header as the transport's FrameDecoder would hand it to a handler (same msgpack limits)."""
    decoder = FrameDecoder(limits)
    decoder.feed(PRELUDE.pack(MAGIC, VERSION, Kind.REQUEST, 0, len(raw), 0) + raw)
    frame = decoder.next_frame()
    return None if frame is None else frame.header


def _header_or_none(raw: bytes, limits: Limits = Limits()) -> dict | None:
    if not raw or len(raw) > limits.max_header_bytes:
        return None
    try:
        return _unpack_like_transport(raw, limits)  # type: ignore[return-value]
    except ProtocolError:
        return None  # refused by the transport before the module under test could see it


def _join(frames: list[list]) -> bytes:
    return b"".join(bytes(piece) for frame in frames for piece in frame)


# ------------------------------------------------------------------------------------------ frames


def _drain(decoder: FrameDecoder, data: bytes, step: int) -> tuple[list, BaseException | None]:
    frames = []
    try:
        for pos in range(0, len(data), step):
            decoder.feed(data[pos : pos + step])
            while (frame := decoder.next_frame()) is not None:
                frames.append((frame.kind, frame.header, [bytes(b) for b in frame.buffers]))
    except ProtocolError as exc:
        return frames, exc
    return frames, None


def run_frames(data: bytes) -> bool | None:
    """The same bytes fed whole and in small pieces must decode alike and fail with the same error.

    Frames completed in the same `feed` call as a later error are never handed out (the decoder is
    dead after a ProtocolError and the connection closes), so on error a whole feed may see fewer of
    the frames that small feeds saw first; those it does see must be the same ones."""
    whole, whole_error = _drain(FrameDecoder(FUZZ_LIMITS), data, max(1, len(data)))
    step = max(1 + (data[-1] % 7 if data else 0), len(data) // 256)  # at most ~256 feeds: fast
    pieces, pieces_error = _drain(FrameDecoder(FUZZ_LIMITS), data, step)
    same = whole == pieces if whole_error is None else whole == pieces[: len(whole)]
    if not same or type(whole_error) is not type(pieces_error):
        raise InvariantBroken(f"whole feed gave {len(whole)} frames/{whole_error!r}, "
                              f"{step}-byte feeds gave {len(pieces)} frames/{pieces_error!r}")
    if whole_error is not None:
        raise whole_error


def _frame_seeds() -> list[bytes]:
    small = torch.arange(12, dtype=torch.float32)
    meta, buffers = encode_tensor(small, "none")
    big = bytes(range(256)) * 80  # 20 KiB: chunked under FUZZ_LIMITS
    return [
        _join([encode_frame(Kind.PING, {}, limits=FUZZ_LIMITS)]),
        _join([encode_frame(Kind.REQUEST, {"id": 1, "m": "dht.ping", "meta": {}, "x": [meta]}, buffers,
                            FUZZ_LIMITS)]),
        _join(encode_message(Kind.RESPONSE, {"id": 7, "meta": {}, "x": []}, [big, b"tail"], FUZZ_LIMITS)),
        _join([encode_frame(Kind.ERROR, {"id": 3, "code": "bad_request", "msg": "no"}, limits=FUZZ_LIMITS),
               encode_frame(Kind.CANCEL, {"id": 4}, limits=FUZZ_LIMITS),
               encode_frame(Kind.GOAWAY, {}, limits=FUZZ_LIMITS)]),
    ]


FRAMES = Target(
    name="frames",
    run=run_frames,
    expected=(ProtocolError,),
    # Chunked messages are preallocated once their announced sizes pass the limits (by design, up to
    # max_inflight_bytes); one frame in progress and its header's Python objects come on top.
    alloc_bound=lambda n: FUZZ_LIMITS.max_inflight_bytes + 4 * FUZZ_LIMITS.max_frame_bytes
    + MSGPACK_AMPLIFICATION * FUZZ_LIMITS.max_header_bytes + 4 * n + SMALL_SLACK,
    seeds=_frame_seeds,
    description="transport.wire.FrameDecoder.feed/next_frame: prelude, length table, header, chunks",
)

# ------------------------------------------------------------------------------------------ codecs


def run_codec(data: bytes) -> bool | None:
    """`[meta, [buffer, ...], aligned]` as a peer's header and payloads would deliver them."""
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)  # map keys as the transport allows
    except (ValueError, TypeError, msgpack.UnpackException):  # the harness's envelope, not the module
        return False
    if not (isinstance(envelope, list) and len(envelope) == 3 and isinstance(envelope[1], list)
            and all(isinstance(b, bytes) for b in envelope[1])):
        return False
    meta, raw_buffers, aligned = envelope
    if aligned:  # writable, as FrameDecoder delivers them
        buffers = [memoryview(bytearray(b)) for b in raw_buffers]
    else:  # read-only and at an odd address, as a slice of a larger read would be
        buffers = [memoryview(b"\0" + b)[1:] for b in raw_buffers]
    if isinstance(meta, dict):
        buffer_count(meta)
    tensor = decode_tensor(meta, buffers, FUZZ_LIMITS)
    if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != meta["shape"] \
            or tensor.dtype is not DTYPES[meta["dtype"]] or tensor.device.type != "cpu":
        raise InvariantBroken(f"decoded {tensor!r} does not match its metadata {meta!r}")


def codec_envelope(meta: object, buffers: list[bytes], aligned: bool = True) -> bytes:
    return msgpack.packb([meta, buffers, aligned], use_bin_type=True)


def _codec_seeds() -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.relu(torch.randn(64, 8, generator=gen)),
               torch.arange(10, dtype=torch.int64), torch.tensor([True, False, True]),
               torch.randn(2, 3, generator=gen, dtype=torch.complex64), torch.empty(0, 4)]
    seeds = []
    for tensor in tensors:
        for codec in CODECS:
            meta, buffers = encode_tensor(tensor, codec, lz4_min_gain=-1.0)
            seeds.append(codec_envelope(meta, [bytes(b) for b in buffers], len(seeds) % 2 == 0))
    return seeds


CODEC = Target(
    name="codecs",
    run=run_codec,
    expected=(ProtocolError,),  # CodecError and LimitExceeded are ProtocolErrors
    # The input twice (a read-only buffer is copied), the output at 16 bytes per element (complex128)
    # plus int8's fp32 intermediate, and lz4's output, which never passes max_decompressed_bytes.
    alloc_bound=lambda n: 2 * n + 2 * 16 * FUZZ_LIMITS.max_tensor_elements
    + 2 * FUZZ_LIMITS.max_decompressed_bytes + SMALL_SLACK,
    seeds=_codec_seeds,
    description="transport.codecs.decode_tensor(meta, buffers, limits) for every codec and dtype",
)

# --------------------------------------------------------------------------------------- handshake

_LOCAL = Identity.from_seed(b"fuzz local")
_REMOTE = Identity.from_seed(b"fuzz remote")
_SWARM_KEY = b"k" * 32


def _side(identity: Identity | None, initiator: bool, swarm: bool, nonce: int) -> Handshake:
    return Handshake(initiator=initiator, version=1, identity=identity, swarm_key=_SWARM_KEY if swarm else None,
                     limits=Limits().as_dict(), app={"dht": "127.0.0.1:7420"},
                     random_bytes=lambda n: bytes([nonce]) * n)


def run_handshake(data: bytes) -> bool | None:
    """`[flags][u16 hello length][hello][proof]`: our side's fixed hello meets the fuzzed peer's."""
    if len(data) < 3:
        return False
    flags, (length,) = data[0], struct.unpack("!H", data[1:3])
    hello, proof = data[3 : 3 + length], data[3 + length :]
    ours = _side(_LOCAL, initiator=bool(flags & 1), swarm=bool(flags & 2), nonce=1)
    ours.receive_hello(hello)
    peer = ours.receive_proof(proof)
    try:  # what the connection does with the limits the peer announced
        Limits.from_dict(peer.hello.limits)
    except MalformedFrame:
        return


def handshake_input(flags: int, hello: bytes, proof: bytes) -> bytes:
    return bytes([flags]) + struct.pack("!H", len(hello)) + hello + proof


def _handshake_seeds() -> list[bytes]:
    seeds = []
    for flags in range(4):
        for identity in (_REMOTE, None):
            ours = _side(_LOCAL, initiator=bool(flags & 1), swarm=bool(flags & 2), nonce=1)
            theirs = _side(identity, initiator=not flags & 1, swarm=bool(flags & 2), nonce=2)
            proof = theirs.receive_hello(ours.hello_bytes())
            seeds.append(handshake_input(flags, theirs.hello_bytes(), proof))
    return seeds


HANDSHAKE = Target(
    name="handshake",
    run=run_handshake,
    expected=(HandshakeError,),
    alloc_bound=lambda n: MSGPACK_AMPLIFICATION * 2 * MAX_HELLO_BYTES + SMALL_SLACK,
    seeds=_handshake_seeds,
    description="transport.handshake.Handshake.receive_hello/receive_proof, then Limits.from_dict",
)

# --------------------------------------------------------------------------------------------- dht

_DHT = DHTConfig()
_DHT_PARSERS = (
    lambda meta: dht_protocol.parse_addr(meta, _DHT),
    lambda meta: dht_protocol.parse_find_node(meta, _DHT),
    lambda meta: dht_protocol.parse_find_value(meta, _DHT),
    lambda meta: _store(*dht_protocol.parse_store(meta, _DHT)),
    lambda meta: dht_protocol.parse_contacts(meta, _DHT),
    lambda meta: _check_all(dht_protocol.parse_find_value_reply(dht_key("job", "j", "stage", 0), meta, _DHT)[0]),
    lambda meta: dht_protocol.parse_store_reply(meta, 3),
    lambda meta: _wanted_in_range(dht_protocol.parse_wanted(meta, _DHT)),
)


def _wanted_in_range(n: int) -> None:
    """A reply is sized by `n`: whatever a caller sends, it is 1..max_contacts_per_reply."""
    if not 1 <= n <= _DHT.max_contacts_per_reply:
        raise InvariantBroken(f"parse_wanted gave {n}, outside 1..{_DHT.max_contacts_per_reply}")


def _check_all(records) -> None:
    for record in records:
        try:
            check_record(record, _DHT, NOW)
        except DHTError:
            continue


def _store(key: bytes, records) -> None:
    """What a storer does with a store RPC: each record checked and kept, or refused with a reason."""
    storage = Storage(_DHT)
    for record in records:
        try:
            storage.put(record, b"s" * 32, NOW)
        except DHTError:
            continue
    if storage.total_bytes > _DHT.max_total_bytes:
        raise InvariantBroken(f"storage holds {storage.total_bytes} bytes, over max_total_bytes")


def run_dht(data: bytes) -> bool | None:
    """`[selector][msgpack meta]`; selector 0xff runs `namespace_of` on the raw bytes instead."""
    if not data:
        return False
    if data[0] == 0xFF:
        namespace_of(data[1:])
        return
    meta = _header_or_none(data[1:])
    if meta is None:
        return False
    _DHT_PARSERS[data[0] % len(_DHT_PARSERS)](meta)


def dht_input(selector: int, meta: dict) -> bytes:
    return bytes([selector]) + msgpack.packb(meta, use_bin_type=True)


def _dht_seeds() -> list[bytes]:
    key = dht_key("job", "j", "stage", 0)
    open_key = dht_key("open", "scratch")
    records = [sign_record(_REMOTE, key, _REMOTE.peer_id, b"announce", NOW + 60),
               sign_record(_LOCAL, key, _LOCAL.peer_id, b"", NOW + 30)]
    contact = Contact(_REMOTE.peer_id, "127.0.0.1:7420")
    return [
        dht_input(0, {"addr": "127.0.0.1:7420"}),
        dht_input(1, dht_protocol.find_node_request(_REMOTE.peer_id)),
        dht_input(2, dht_protocol.find_value_request(key)),
        dht_input(3, dht_protocol.store_request(key, records)),
        dht_input(3, {"key": open_key, "records": [[b"any", b"v", NOW + 10, b"", b""]]}),
        dht_input(4, dht_protocol.contacts_reply([contact])),
        dht_input(5, dht_protocol.find_value_reply(records, [contact])),
        dht_input(6, dht_protocol.store_reply(["ok", "expired", "bad_signature"])),
        dht_input(7, dht_protocol.find_node_request(_REMOTE.peer_id, 3)),
        dht_input(7, {"key": key, "n": 10 ** 6}),
        b"\xff" + key,
    ]


DHT = Target(
    name="dht",
    run=run_dht,
    expected=(DHTError,),
    alloc_bound=_msgpack_bound,
    seeds=_dht_seeds,
    description="swarmd.dht.protocol parse_* validators (parse_wanted included), records.check_record/namespace_of, "
                "Storage.put",
)

# ------------------------------------------------------------------------------------------ gossip

GOSSIP_JOB = "fuzz-job"
GOSSIP_LIMITS = ViewLimits(max_peers=8, max_batch=64, max_encoded_bytes=64 * KiB)


def run_gossip(data: bytes) -> bool | None:
    """A received batch: decoded, merged into a view (open and members-only), then tabled."""
    entries = decode_entries(data, GOSSIP_LIMITS)
    for members in (None, {_REMOTE.peer_id}):
        view = GossipView(GOSSIP_JOB, GOSSIP_LIMITS)
        view.merge(entries, NOW, members)
        if len(view) > GOSSIP_LIMITS.max_peers:
            raise InvariantBroken(f"view holds {len(view)} entries, over max_peers")
        view.table(4, NOW)


def _gossip_seeds() -> list[bytes]:
    entries = [LoadEntry.create(identity, GOSSIP_JOB, stage, 12.5, 3, state, NOW - 1)
               for identity, stage, state in ((_REMOTE, 0, "serving"), (_LOCAL, 3, "joining"))]
    other = LoadEntry.create(_REMOTE, "other-job", 1, 1.0, 0, "draining", NOW)
    return [encode_entries(entries), encode_entries([other, *entries]), encode_entries([])]


GOSSIP = Target(
    name="gossip",
    run=run_gossip,
    expected=(RebalanceError,),
    alloc_bound=_msgpack_bound,
    seeds=_gossip_seeds,
    description="swarmd.rebalance.view.decode_entries, GossipView.merge and .table",
)

# ---------------------------------------------------------------------------------------- job spec

TINY_LM = (REPO / "examples" / "tiny-lm.toml").read_text()


def run_jobspec(data: bytes) -> bool | None:
    """`T` + TOML text, or `M` + msgpack; whatever parses must survive its canonical round trip,
    and its stages' memory estimate (what a daemon computes before joining) must come out."""
    if not data:
        return False
    body = data[1:]
    if data[:1] == b"M":
        spec = JobSpec.from_msgpack(body)
    else:
        spec = parse_toml(body.decode("utf-8", errors="replace"))
    again = JobSpec.from_msgpack(spec.to_msgpack())
    if again != spec or again.to_msgpack() != spec.to_msgpack():
        raise InvariantBroken("the canonical msgpack form does not load back to the same spec")
    for stage in {0, spec.pipeline.stages - 1}:
        need = stage_memory(spec, stage)
        if need is not None and need.total <= 0:
            raise InvariantBroken(f"stage {stage}'s memory estimate is {need.total} bytes")


#: The smallest valid job spec, its TOML written by hand (not by tests/_support/jobspec.py): the
#: fuzzer's seeds are text it mutates, and this one names token-file data (`tokens`), not files.
MINIMAL_SPEC = ('name = "m"\nsteps = 1\n[model]\narch = "transformer-lm"\nd_model = 8\nn_heads = 2\n'
                '[data]\ntokens = "t.bin"\nseq_len = 4\n[batch]\nglobal_samples = 2\nmicrobatch_samples = 1\n')


def _jobspec_seeds() -> list[bytes]:
    spec = parse_toml(TINY_LM)
    minimal = MINIMAL_SPEC
    at_limits = minimal.replace("steps = 1", f"steps = {LIMITS['steps'].value}").replace(
        "d_model = 8", f"d_model = {LIMITS['model.d_model'].value}").replace(
        "seq_len = 4", f"seq_len = {LIMITS['data.seq_len'].value}") + f"[pipeline]\nstages = {LIMITS['pipeline.stages'].value}\n"
    return [b"T" + TINY_LM.encode(), b"M" + spec.to_msgpack(), b"T" + minimal.encode(),
            b"M" + parse_toml(minimal).to_msgpack(), b"T" + at_limits.encode(),
            b"T" + at_limits.replace(f"stages = {LIMITS['pipeline.stages'].value}", "stages = 1000000000").encode()]


JOBSPEC = Target(
    name="jobspec",
    run=run_jobspec,
    expected=(SpecError,),
    alloc_bound=_msgpack_bound,
    seeds=_jobspec_seeds,
    description="swarmd.job.spec.parse_toml (TOML text) and JobSpec.from_msgpack (DHT bytes)",
)

# ----------------------------------------------------------------------------------------- control


#: Where job.submit seeds find their data: a token file the fuzzer's specs name relative to it.
_JOB_DIR = Path(tempfile.mkdtemp(prefix="swarmd-fuzz-jobs-"))
(_JOB_DIR / "t.bin").write_bytes(bytes(range(256)) * 8)
_SUBMITTABLE = tomllib.loads(MINIMAL_SPEC)


class _InstantDHT:
    """What JobRegistry needs of a DHT node, answering at once: nothing published elsewhere."""

    async def get(self, key: bytes, latest: bool = False) -> dict:
        namespace_of(key)  # the registry promised the DHT a schema key
        return {}

    def announce(self, key: bytes, value_fn, **kwargs) -> object:
        namespace_of(key)
        value_fn()
        return object()

    async def withdraw(self, announcement: object) -> int:
        return 0


class _InstantServing:
    async def serve(self, spec, job_id: bytes, stage: int, *, submitter: bytes) -> None:
        if not 0 <= stage < spec.pipeline.stages:
            raise InvariantBroken(f"job.serve passed stage {stage} of a {spec.pipeline.stages}-stage job")

    def outliers(self, job_id: bytes) -> list[tuple[int, int, tuple[str, ...]]]:
        return [(0, 1, ("ab" * 32,))]  # one, so job.get builds its reply from a real entry


class _InstantTraining:
    def __init__(self) -> None:
        self.started: set[bytes] = set()

    async def start(self, job, shards, of: int) -> None:
        if not all(0 <= k < of for k in shards):
            raise InvariantBroken(f"trainer shards {list(shards)} of {of}")
        self.started.add(job.job_id)

    def cancel(self, job) -> None:
        self.started.discard(job.job_id)

    def bans(self, job_id: bytes) -> list[BanRecord]:
        return [BanRecord(0, "ab" * 32, "10.0.0.2:7420", "timeout", 1.0)]  # as outliers above


#: The loop a control handler runs in: a handler may ask for the running loop without suspending
#: (`asyncio.gather()` of nothing does), and outside one that depends on what earlier tests left set.
_LOOP = asyncio.new_event_loop()
atexit.register(_LOOP.close)


def _step(awaitable) -> object:
    """Run a handler for one coroutine step inside `_LOOP`; it must finish in that step."""
    return _LOOP.run_until_complete(_one_step(awaitable))


async def _one_step(awaitable) -> object:
    try:
        awaitable.send(None)
    except StopIteration as done:
        return done.value
    awaitable.close()
    raise InvariantBroken("a control handler suspended although the daemon answered at once")


class _InlineRegistry(JobRegistry):
    """The daemon's registry checks data in a worker thread; here the driver steps each handler
    in one coroutine step, so the same check runs inline (it is the check that is fuzzed)."""

    async def _off_loop(self, fn, *args):
        return fn(*args)


class _FakeDaemon:
    """Answers at once (no suspension), so a handler runs to completion in one coroutine step. The
    job methods run against a real JobRegistry (fresh for every input, holding one submitted job
    named "m") over an instant DHT."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.jobs = _InlineRegistry(_InstantDHT(), Identity.from_seed(b"fuzz-control-job-registry-seed-!"))
        self.serving, self.training = _InstantServing(), _InstantTraining()
        _step(self.jobs.submit(_SUBMITTABLE, [], str(_JOB_DIR), (1, 0, 0)))  # job "m", so job.* reach past find

    def status(self) -> dict:
        return {"peer_id": b"p" * 32}

    def peers(self) -> list:
        return []

    async def dht_get(self, key: bytes) -> dict:
        namespace_of(key)  # the handler promised the DHT a schema key
        return {}

    def request_drain(self, reason: str) -> dict:
        return {"draining": True}


_DAEMON = _FakeDaemon()
_CONTROL = Router()
register_control(_CONTROL, _DAEMON)
_CONTROL_METHODS = ("status", "peers", "dht.get", "drain", "job.submit", "job.list", "job.get", "job.cancel",
                    "job.logs", "job.serve", "job.train")
_CALLER = RemoteInfo(peer_id=None, public_key=None, app={}, address="fuzz", peercred=(1, 0, 0))


def run_control(data: bytes) -> bool | None:
    """A request header `{m: method, meta: {...}}` as the control socket's RPC hands it over."""
    header = _header_or_none(data)
    if header is None:
        return False
    method, meta = header.get("m"), header.get("meta")
    if not isinstance(method, str) or not isinstance(meta, dict):
        return False  # the connection answers these itself (MalformedFrame / "data frame lacks its meta")
    entry = _CONTROL.lookup(method)
    if entry is None:
        return False  # unknown_method is answered by the connection
    kind, handler = entry
    _DAEMON.reset()
    request = Request(method, meta, [], None, _CALLER)
    if kind == "unary":
        _step(handler(request))
    else:
        items = handler(request)
        try:
            _step(items.__anext__())
        except StopAsyncIteration:
            pass


def control_input(method: str, meta: object) -> bytes:
    return msgpack.packb({"id": 1, "m": method, "meta": meta, "x": []}, use_bin_type=True)


def _control_seeds() -> list[bytes]:
    job = {"job": "m"}
    submit = {"spec": _SUBMITTABLE, "data": [], "base": str(_JOB_DIR), "trainers": 1}
    return [control_input(m, {}) for m in ("status", "peers", "dht.get", "drain", "job.list")] + [
        control_input("job.submit", submit), control_input("job.submit", {**submit, "trainers": 0}),
        control_input("job.get", job), control_input("job.serve", {**job, "stage": 0}),
        control_input("job.train", {**job, "data": [str(_JOB_DIR / "t.bin")], "shard": 0, "shards": 1}),
        control_input("job.logs", {**job, "follow": False}), control_input("job.cancel", job),
        control_input("job.get", {"job": "ab" * 32}),
        control_input("dht.get", {"key": ["job", "j1", "stage", 3]}),
        control_input("dht.get", {"key": ["peer", b"\x00" * 32]}),
    ]


CONTROL = Target(
    name="control",
    run=run_control,
    expected=(RpcError,),
    alloc_bound=_msgpack_bound,
    seeds=_control_seeds,
    description="swarmd.control handlers (status, peers, dht.get key checks, drain, every job.* method "
                "against a real JobRegistry) on decoded request headers",
)

# ------------------------------------------------------------------------------------------ config

_CONFIG_DIR = Path(tempfile.mkdtemp(prefix="swarmd-fuzz-config-"))
_CONFIG_ENV = {"STATE_DIRECTORY": str(_CONFIG_DIR / "state"), "RUNTIME_DIRECTORY": str(_CONFIG_DIR / "run")}
SYSTEMD_TOML = (REPO / "systemd" / "swarmd.toml").read_text()



def _same(a: object, b: object) -> bool:
    """Equality that counts NaN equal to NaN (a NaN setting is accepted today and round-trips as nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if hasattr(a, "__dataclass_fields__") and type(a) is type(b):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def run_config(data: bytes) -> bool | None:
    """The bytes as the daemon's config file, then `build` and `--check-config`'s TOML round trip."""
    path = _CONFIG_DIR / f"swarmd-{os.getpid()}.toml"
    path.write_bytes(data)
    built = daemon_config.build([daemon_config.read_file(path)], _CONFIG_ENV)
    path.write_text(daemon_config.to_toml(built))
    try:
        again = daemon_config.build([daemon_config.read_file(path)], _CONFIG_ENV)
    except daemon_config.ConfigError as exc:
        raise InvariantBroken(f"to_toml output does not load back: {exc}") from None
    if not _same(again, built):
        raise InvariantBroken("to_toml output loads back as a different config")


CONFIG = Target(
    name="config",
    run=run_config,
    expected=(daemon_config.ConfigError,),
    alloc_bound=_msgpack_bound,
    seeds=lambda: [SYSTEMD_TOML.encode(), b"", b"[network]\nbootstrap = [\"10.0.0.1:7420\", \"[::1]:1\"]\n"],
    description="swarmd.config.read_file + build + to_toml round trip (the daemon's TOML file)",
)

TARGETS: dict[str, Target] = {t.name: t for t in (FRAMES, CODEC, HANDSHAKE, DHT, GOSSIP, JOBSPEC, CONTROL, CONFIG)}

#: Findings fixed at their root, kept as regression inputs: (name, target, the recorded input).
#: Each must stay clean (test_fuzz_fixed_bugs.py); the general fuzz tests would only find them again by luck.
FIXED_BUGS: tuple[tuple[str, str, bytes], ...] = (
    ("jobspec-float-overflow", "jobspec", b"T" + TINY_LM.replace("lr = 3e-3", "lr = 1" + "0" * 400).encode()),
    ("jobspec-toml-int-digits", "jobspec", b"T" + TINY_LM.replace("steps = 200", "steps = 1" + "0" * 4300).encode()),
    ("config-float-overflow", "config", b"[daemon]\ndrain_timeout_s = 1" + b"0" * 400 + b"\n"),
    ("config-toml-int-digits", "config", b"[dht]\nk = 1" + b"0" * 4300 + b"\n"),
    ("config-not-utf8", "config", b"\xff\n"),
    ("config-to-toml-control-chars", "config", b'[daemon]\nstate_dir = "a\\nb\\u007f\\u0001"\n'),
    ("config-nan-setting", "config", b"[daemon]\ndrain_timeout_s = nan\n"),
)
