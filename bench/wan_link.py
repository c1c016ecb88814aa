"""Peers behind long, slow links: network namespaces joined through a hub that delays every frame.

Each peer gets its own namespace and a veth pair to the hub namespace; `tbf` on the peer's end
shapes its uplink and `tbf` on the hub's end its downlink, both at `rate_mbit`. In the hub,
bench/delay_line.py switches frames between the veth ends and holds each one for the path's
one-way delay, so TCP between any two peers sees a real long fat pipe: its own slow start,
windows, buffer limits and queueing. Every pair of peers has the same round trip, `rtt_ms`
(each hub port adds a quarter of it each way). Needs root and iproute2, like bench/netns.py.

    with wan_star(peers=2, rtt_ms=100, rate_mbit=200) as star:
        server = star.popen(0, [sys.executable, "server.py", star.addr(0)])
        ...  # connect from star.popen(1, ...)

The peers' namespaces get the TCP settings docs/transport-tuning.md asks of a host (per namespace:
the host's own are untouched). The script is also its own probes, run inside a peer's namespace:
`--ping ADDR COUNT` (ICMP echo round trips) and `--tcp-sink`/`--tcp-send` (one TCP stream and the
receiver's byte count over time), each printing one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SUBNET_PREFIX = "10.204.0"
# A bucket of at least one GSO burst (64 KiB) and about rate/HZ; 256 KiB covers both up to 1 Gb/s.
TBF_BURST = "256kb"
# How long a frame may wait in tbf before it is dropped: the bottleneck's buffer. 50 ms is a
# typical home/cloud edge and keeps TCP's own queueing visible without bufferbloat.
TBF_LATENCY = "50ms"
# A swarm of dozens of peers still fits in one /24 and leaves room for the hub's delay line.
MAX_PEERS = 200
# docs/transport-tuning.md, applied inside each peer namespace.
TUNED_SYSCTLS = {
    "net.ipv4.tcp_rmem": "4096 131072 16777216",
    "net.ipv4.tcp_wmem": "4096 16384 16777216",
    "net.ipv4.tcp_notsent_lowat": "131072",
    "net.ipv4.tcp_slow_start_after_idle": "0",
    "net.ipv4.tcp_congestion_control": "bbr",
}
# How long the delay line gets to open its ports before set-up fails.
READY_TIMEOUT_S = 10.0


def unavailable_reason() -> str | None:
    """Why a delayed link cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@dataclass
class WanStar:
    """One built star: the names its owner needs to run things inside it and to change it."""

    hub: str
    namespaces: list[str]
    devices: list[str]
    hub_devices: list[str]
    rtt_ms: float
    rate_mbit: float | None
    delay_line: subprocess.Popen | None = None
    #: The delay line's counters, filled in when the star is torn down.
    delay_stats: dict = field(default_factory=dict)

    def addr(self, peer: int) -> str:
        return f"{SUBNET_PREFIX}.{peer + 1}"

    def exec_prefix(self, peer: int) -> list[str]:
        """Prepend to an argv to run it inside peer `peer`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[peer]]

    def popen(self, peer: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(peer), *argv], **kwargs)

    def run(self, peer: int, argv: Sequence[str], timeout: float) -> str:
        """Run a command in the peer's namespace to the end; its stdout, or an error with stderr."""
        done = subprocess.run([*self.exec_prefix(peer), *argv], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} in {self.namespaces[peer]} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def probe(self, peer: int, args: Sequence[str], timeout: float) -> dict:
        """One of this script's probes in a peer's namespace; its JSON line."""
        return json.loads(self.run(peer, [sys.executable, __file__, *args], timeout))

    def set_rtt(self, rtt_ms: float) -> None:
        """Change every path's round trip in place, for frames sent from now on."""
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        for dev in self.hub_devices:
            self.delay_line.stdin.write(f"{dev}={rtt_ms / 4}\n")
            self.delay_line.stdin.flush()
            answer = self.delay_line.stdout.readline().strip()
            if answer != "ok":
                raise RuntimeError(f"the delay line refused {dev}={rtt_ms / 4}: {answer!r}")
        self.rtt_ms = rtt_ms

    def ping(self, src: int, dst: int, count: int) -> list[float]:
        """Round trips (ms) of `count` ICMP echoes after one that warms ARP up."""
        return self.probe(src, ["--ping", self.addr(dst), str(count + 1)], timeout=30 + count * 2)["rtt_ms"][1:]

    def stream(self, sender: int, receiver: int, seconds: float, buffer: int | None = None,
               port: int = 5001) -> list[tuple[float, int]]:
        """One TCP stream for `seconds`: the receiver's (seconds, bytes so far) every 100 ms.
        `buffer` pins SO_SNDBUF and SO_RCVBUF on both ends (no autotuning)."""
        extra = ["--buffer", str(buffer)] if buffer is not None else []
        sink = self.popen(receiver, [sys.executable, __file__, "--tcp-sink", str(port), str(seconds), *extra],
                          stdout=subprocess.PIPE, text=True)
        try:
            if not sink.stdout.readline():
                raise RuntimeError(f"tcp sink exited with {sink.wait()}")
            self.run(sender, [sys.executable, __file__, "--tcp-send", self.addr(receiver), str(port),
                              str(seconds + 1), *extra], timeout=seconds + 30)
            out, _ = sink.communicate(timeout=30)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.communicate()
        return [tuple(point) for point in json.loads(out)["timeline"]]


def goodput_mbps(timeline: list[tuple[float, int]], after_s: float) -> float:
    """The receiver's rate from `after_s` (past the ramp) to the end of a stream's timeline."""
    tail = [point for point in timeline if point[0] >= after_s]
    if len(tail) < 2:
        raise ValueError(f"the stream ended before {after_s} s plus two samples: {timeline[-3:]}")
    (t0, b0), (t1, b1) = tail[0], tail[-1]
    return 8 * (b1 - b0) / (t1 - t0) / 1e6


@contextmanager
def wan_star(
    peers: int = 2,
    rtt_ms: float = 100.0,
    rate_mbit: float | None = 200.0,
    tuned: bool = True,
    limit_bytes: int | None = None,
) -> Iterator[WanStar]:
    """Build the namespaces, links and delay line, yield them, and delete them all on exit."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot build a delayed link: {reason}")
    if not 2 <= peers <= MAX_PEERS:
        raise ValueError(f"peers must be in 2..{MAX_PEERS}, got {peers}")
    if rtt_ms < 0:
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
    tag = secrets.token_hex(3)
    star = WanStar(
        hub=f"swd-wan-{tag}-hub",
        namespaces=[f"swd-wan-{tag}-{i}" for i in range(peers)],
        devices=[f"wp{tag}{i}" for i in range(peers)],
        hub_devices=[f"wh{tag}{i}" for i in range(peers)],
        rtt_ms=rtt_ms,
        rate_mbit=rate_mbit,
    )
    created: list[str] = []
    try:
        for ns in (star.hub, *star.namespaces):
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _sysctl(ns, {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"})
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for i in range(peers):
            _plug_peer(star, i, tuned)
        star.delay_line = _start_delay_line(star, limit_bytes)
        yield star
    finally:
        if star.delay_line is not None:
            star.delay_stats = _stop_delay_line(star.delay_line)
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _plug_peer(star: WanStar, i: int, tuned: bool) -> None:
    ns, dev, hub_dev = star.namespaces[i], star.devices[i], star.hub_devices[i]
    _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", hub_dev, "netns", star.hub)
    _run("ip", "-n", ns, "addr", "add", f"{star.addr(i)}/24", "dev", dev)
    _run("ip", "-n", ns, "link", "set", dev, "up")
    _run("ip", "-n", star.hub, "link", "set", hub_dev, "up")
    if star.rate_mbit is not None:
        _tbf(ns, dev, star.rate_mbit)
        _tbf(star.hub, hub_dev, star.rate_mbit)
    if tuned:
        _sysctl(ns, TUNED_SYSCTLS)


def _start_delay_line(star: WanStar, limit_bytes: int | None) -> subprocess.Popen:
    one_way = star.rtt_ms / 4
    argv = ["ip", "netns", "exec", star.hub, sys.executable, str(BENCH / "delay_line.py")]
    for dev in star.hub_devices:
        argv += ["--port", f"{dev}={one_way}"]
    if limit_bytes is not None:
        argv += ["--limit-bytes", str(limit_bytes)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readable, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    ready = proc.stdout.readline().strip() if readable else ""
    if ready != "ready":
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"delay line did not start: {ready!r} {err[-2000:]}")
    return proc


def _stop_delay_line(proc: subprocess.Popen) -> dict:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _tbf(ns: str, dev: str, rate_mbit: float) -> None:
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
         "rate", f"{rate_mbit}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY)


def _sysctl(ns: str, values: dict[str, str]) -> None:
    _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items()))


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# ------------------------------------------------------------------------------------ probes

ICMP_ECHO = struct.Struct("!BBHHH")


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(addr: str, count: int, interval_s: float = 0.05, timeout_s: float = 5.0) -> list[float]:
    """Round trips of ICMP echoes in ms; raises when any is lost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    rtts = []
    try:
        for seq in range(count):
            payload = b"swarmd-wan" * 5
            header = ICMP_ECHO.pack(8, 0, 0, ident, seq)
            packet = ICMP_ECHO.pack(8, 0, _checksum(header + payload), ident, seq) + payload
            start = time.perf_counter()
            sock.sendto(packet, (addr, 0))
            rtts.append(_await_echo(sock, ident, seq, start, timeout_s))
            time.sleep(interval_s)
    finally:
        sock.close()
    return rtts


def _await_echo(sock: socket.socket, ident: int, seq: int, start: float, timeout_s: float) -> float:
    deadline = start + timeout_s
    while True:
        sock.settimeout(max(0.001, deadline - time.perf_counter()))
        data = sock.recv(2048)
        now = time.perf_counter()
        ihl = (data[0] & 0x0F) * 4
        kind, _, _, got_ident, got_seq = ICMP_ECHO.unpack_from(data, ihl)
        if kind == 0 and got_ident == ident and got_seq == seq:
            return (now - start) * 1e3


def tcp_sink(port: int, rcvbuf: int | None, seconds: float) -> dict:
    """Accept one stream and count what arrives; the timeline (s, bytes) every 100 ms."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if rcvbuf is not None:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    print(json.dumps({"listening": port}), flush=True)
    conn, _ = server.accept()
    start = time.perf_counter()
    total, timeline, mark = 0, [], start
    buf = bytearray(1 << 20)
    conn.settimeout(1.0)
    while time.perf_counter() - start < seconds:
        try:
            got = conn.recv_into(buf)
        except TimeoutError:
            continue
        if not got:
            break
        total += got
        now = time.perf_counter()
        if now - mark >= 0.1:
            timeline.append((round(now - start, 3), total))
            mark = now
    conn.close()
    server.close()
    return {"timeline": timeline, "bytes": total}


def tcp_send(addr: str, port: int, sndbuf: int | None, seconds: float) -> dict:
    sock = socket.socket()
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.connect((addr, port))
    chunk = b"\0" * (1 << 20)
    start = time.perf_counter()
    sent = 0
    try:
        while time.perf_counter() - start < seconds:
            sent += sock.send(chunk)
    except OSError:
        pass  # the sink closed first
    sock.close()
    return {"sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ping", nargs=2, metavar=("ADDR", "COUNT"))
    parser.add_argument("--tcp-sink", nargs=2, metavar=("PORT", "SECONDS"))
    parser.add_argument("--tcp-send", nargs=3, metavar=("ADDR", "PORT", "SECONDS"))
    parser.add_argument("--buffer", type=int, help="pin SO_RCVBUF (sink) or SO_SNDBUF (sender) to this")
    args = parser.parse_args()
    if args.ping:
        print(json.dumps({"rtt_ms": ping(args.ping[0], int(args.ping[1]))}))
    elif args.tcp_sink:
        print(json.dumps(tcp_sink(int(args.tcp_sink[0]), args.buffer, float(args.tcp_sink[1]))))
    elif args.tcp_send:
        print(json.dumps(tcp_send(args.tcp_send[0], int(args.tcp_send[1]), args.buffer, float(args.tcp_send[2]))))
    else:
        parser.error("one of --ping, --tcp-sink, --tcp-send")


if __name__ == "__main__":
    main()
