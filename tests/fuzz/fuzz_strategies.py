"""Hypothesis strategies that produce fuzz inputs (bytes) for each target.

Two kinds per target: `mutated` takes a seed from the project's own encoders and damages it (flips,
interesting values, cuts, splices: what a buggy or hostile peer sends), and a structured strategy
builds near-valid inputs field by field (a meta dict with one wrong type, a TOML line with an
out-of-range number), which reach the checks deep inside a parser that random bytes never pass.
"""

from __future__ import annotations

import struct

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import fuzz_targets as T
from transport.codecs import CODECS, DTYPES
from transport.wire import MAGIC, PRELUDE, VERSION, Kind

INTERESTING_INTS = (0, 1, -1, 2, 7, 8, 16, 63, 64, 127, 128, 255, 256, 4095, 4096, 4097, 65535, 65536,
                    2**28, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1)
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC4, 0xD4, 0xDC, 0xDD, 0xDE, 0xDF)

# Every value msgpack can carry (ints within 64 bits), nested a little.
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(INTERESTING_INTS), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=80),
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=20,
)


def _mutate(seed: bytes, ops: list[tuple[int, int, int, bytes]], other: bytes) -> bytes:
    data = bytearray(seed)
    for op, at, size, blob in ops:
        pos = at % (len(data) + 1)
        if op == 0 and data:  # flip one bit
            data[pos % len(data)] ^= 1 << (size % 8)
        elif op == 1 and data:  # an interesting byte
            data[pos % len(data)] = INTERESTING_BYTES[size % len(INTERESTING_BYTES)]
        elif op == 2:  # cut a range
            del data[pos : pos + size % 64 + 1]
        elif op == 3:  # insert bytes
            data[pos:pos] = blob
        elif op == 4 and data:  # duplicate a range
            data[pos:pos] = data[pos : pos + size % 256 + 1]
        elif op == 5 and len(data) >= pos + 8:  # an interesting big-endian u64 / u32 in place
            value = INTERESTING_INTS[size % len(INTERESTING_INTS)] % 2**64
            fmt = "!Q" if size & 1 else "!I"
            data[pos : pos + struct.calcsize(fmt)] = struct.pack(fmt, value % 2 ** (8 * struct.calcsize(fmt)))
        elif op == 6:  # splice in the tail of another seed
            data[pos:] = other[size % (len(other) + 1) :]
    return bytes(data)


def mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    ops = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2**20), st.integers(0, 2**16),
                             st.binary(max_size=16)), min_size=1, max_size=6)
    return st.builds(_mutate, st.sampled_from(seeds), ops, st.sampled_from(seeds))


# ------------------------------------------------------------------------------ structured inputs


@st.composite
def frame_streams(draw) -> bytes:
    """Preludes with every field drawn from the edges, then a header and some payload bytes."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        header = msgpack.packb(draw(st.dictionaries(st.sampled_from(["id", "m", "b", "o", "meta", "x"]),
                                                    msgpack_values, max_size=4)), use_bin_type=True)
        count = draw(st.sampled_from([0, 1, 2, 16, 17, 2**32 - 1]))
        kind = draw(st.one_of(st.sampled_from([k.value for k in Kind]), st.integers(0, 255)))
        flags = draw(st.sampled_from([0, 1, 2, 0x8000, 0xFFFF]))
        header_len = draw(st.sampled_from([len(header), 0, len(header) + 1, 4096, 4097, 2**32 - 1]))
        lengths = [draw(st.sampled_from(INTERESTING_INTS).map(lambda v: v % 2**64)) for _ in range(min(count, 3))]
        magic = draw(st.sampled_from([MAGIC, MAGIC, b"SWRN"]))
        version = draw(st.sampled_from([VERSION, VERSION, 0, 2]))
        parts.append(PRELUDE.pack(magic, version, kind, flags, header_len % 2**32, count)
                     + b"".join(struct.pack("!Q", n) for n in lengths) + header
                     + draw(st.binary(max_size=64)))
    return b"".join(parts)


@st.composite
def codec_inputs(draw) -> bytes:
    """A meta dict that is valid but for a field or two, and buffers of plausible and wrong sizes."""
    meta = {"dtype": draw(st.one_of(st.sampled_from(sorted(DTYPES)), msgpack_values)),
            "shape": draw(st.one_of(st.lists(st.sampled_from([0, 1, 2, 3, 64, 4096, 4097, 2**28, -1]), max_size=9),
                                    msgpack_values)),
            "codec": draw(st.one_of(st.sampled_from(CODECS), msgpack_values))}
    if draw(st.booleans()):
        meta["raw"] = draw(st.one_of(st.sampled_from(INTERESTING_INTS), msgpack_values))
    if draw(st.booleans()):
        meta["block"] = draw(st.one_of(st.sampled_from(INTERESTING_INTS), msgpack_values))
    if draw(st.booleans()):
        meta[draw(st.text(max_size=5))] = draw(msgpack_values)
    buffers = draw(st.lists(st.binary(max_size=300), max_size=3))
    return T.codec_envelope(meta, buffers, draw(st.booleans()))


_SEED = T.HANDSHAKE.seeds()[0]
_HONEST_HELLO = _SEED[3 : 3 + struct.unpack("!H", _SEED[1:3])[0]]


@st.composite
def hello_inputs(draw) -> bytes:
    """The honest peer's hello with fields replaced by wrong ones, with its (now mismatched) proof."""
    body = msgpack.unpackb(_HONEST_HELLO)
    for name in draw(st.lists(st.sampled_from(["v", "nonce", "pk", "swarm", "limits", "app", "extra"]), max_size=3)):
        if draw(st.booleans()):
            body.pop(name, None)
        else:
            body[name] = draw(msgpack_values)
    if draw(st.booleans()):
        body["limits"] = {draw(st.sampled_from(["max_frame_bytes", "max_chunk_bytes", "max_header_bytes", "x"])):
                          draw(st.sampled_from(INTERESTING_INTS)) for _ in range(draw(st.integers(1, 3)))}
    proof = msgpack.packb({"sig": draw(st.one_of(st.none(), st.binary(min_size=64, max_size=64), msgpack_values)),
                           "mac": draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32)))})
    return T.handshake_input(draw(st.integers(0, 3)), msgpack.packb(body, use_bin_type=True), proof)


@st.composite
def dht_inputs(draw) -> bytes:
    record = st.lists(st.one_of(st.binary(max_size=70), st.floats(), st.integers(-(2**63), 2**63 - 1),
                                msgpack_values), min_size=4, max_size=6)
    key = st.one_of(st.binary(max_size=300), st.just(T.dht_key("job", "j", "stage", 0)),
                    st.just(T.dht_key("open", "x")))
    meta = draw(st.fixed_dictionaries({}, optional={
        "addr": st.one_of(st.text(max_size=300), msgpack_values), "target": st.one_of(st.binary(max_size=40), msgpack_values),
        "key": key, "records": st.lists(record, max_size=4), "results": st.lists(st.text(max_size=70), max_size=4),
        "contacts": st.lists(st.lists(st.one_of(st.binary(min_size=32, max_size=32), st.text(max_size=300)),
                                      max_size=3), max_size=4),
    }))
    return T.dht_input(draw(st.integers(0, 6)), meta)


@st.composite
def gossip_inputs(draw) -> bytes:
    row = st.lists(st.one_of(st.binary(min_size=32, max_size=32), st.binary(min_size=64, max_size=64),
                             st.sampled_from(["fuzz-job", "serving", "joining", "draining"]),
                             st.sampled_from([T.NOW, T.NOW - 500, T.NOW + 500, float("nan"), 2**31, 65536]),
                             msgpack_values), min_size=7, max_size=9)
    return msgpack.packb(draw(st.lists(row, max_size=5)), use_bin_type=True)


_SPEC_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "1e400", "nan", "inf", "-inf", "1" + "0" * 30, '"x"',
                                          "[]", "{}", "true", "1979-05-27", "[0.9, 2]", '"fp16+lz4"', '"adamw"']),
                         st.integers().map(str), st.floats().map(repr))


@st.composite
def jobspec_inputs(draw) -> bytes:
    """tiny-lm.toml with some `key = value` lines replaced, or its canonical dict with fields changed."""
    lines = T.TINY_LM.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(lines) - 1))
        if "=" in lines[index]:
            key = lines[index].split("=")[0].strip()
            lines[index] = f"{key} = {draw(_SPEC_VALUES)}"
        else:
            lines.insert(index, f"{draw(st.text(alphabet='abcdefghijklmnop_', min_size=1, max_size=8))} = "
                                f"{draw(_SPEC_VALUES)}")
    if draw(st.booleans()):
        return b"T" + "\n".join(lines).encode()
    table = T.parse_toml(T.TINY_LM).to_dict()
    section = draw(st.sampled_from(sorted(table)))
    if isinstance(table[section], dict) and table[section] and draw(st.booleans()):
        table[section][draw(st.sampled_from(sorted(table[section])))] = draw(msgpack_values)
    else:
        table[section] = draw(msgpack_values)
    return b"M" + msgpack.packb(table, use_bin_type=True)


@st.composite
def control_inputs(draw) -> bytes:
    part = st.one_of(st.text(max_size=300), st.binary(max_size=300), st.integers(-(2**63), 2**64 - 1), msgpack_values)
    meta = draw(st.one_of(st.fixed_dictionaries({"key": st.one_of(st.lists(part, max_size=10), msgpack_values)}),
                          st.dictionaries(st.text(max_size=8), msgpack_values, max_size=3)))
    return T.control_input(draw(st.sampled_from(T._CONTROL_METHODS)), meta)


_CONFIG_KEYS = [(section, f.name) for section, f in T.daemon_config.settings()]
_CONFIG_VALUES = st.one_of(_SPEC_VALUES, st.sampled_from(['"0.0.0.0:0"', '"[::1]:65536"', '"host:7420"', '""',
                                                         '["a:1", "b"]', '"a\\u0000b"', '"cuda:7"']))


@st.composite
def config_inputs(draw) -> bytes:
    """Config files of known sections and keys (the parser's deep paths) with edge-case values."""
    chosen = draw(st.lists(st.sampled_from(_CONFIG_KEYS), min_size=1, max_size=5, unique=True))
    by_section: dict[str, list[str]] = {}
    for section, key in chosen:
        by_section.setdefault(section, []).append(f"{key} = {draw(_CONFIG_VALUES)}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in by_section.items()).encode()


STRUCTURED = {
    "frames": frame_streams(), "codecs": codec_inputs(), "handshake": hello_inputs(), "dht": dht_inputs(),
    "gossip": gossip_inputs(), "jobspec": jobspec_inputs(), "control": control_inputs(), "config": config_inputs(),
}


def inputs_for(name: str) -> st.SearchStrategy[bytes]:
    """Everything a target is tried with: damaged seeds, structured near-misses and plain random bytes."""
    target = T.TARGETS[name]
    return st.one_of(mutated(target.seeds()), STRUCTURED[name], st.binary(max_size=512))


CI_EXAMPLES = 100
"""Examples per target in CI: the whole folder stays well under a minute on a loaded 2-core box;
bench/fuzz.py runs the long, coverage-guided searches."""
CI_SETTINGS = settings(
    max_examples=CI_EXAMPLES,
    deadline=None,  # fuzz_oracle times each input itself (HANG_S), against a fixed bound
    derandomize=True,  # the same inputs every CI run: a failure here is reproducible as is
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
