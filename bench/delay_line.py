"""A delay line for Ethernet frames: the part of a long-haul link that neither `tc` on this kernel
(no netem, no fq, no etf) nor a veth pair can give, its propagation delay.

It runs inside the hub namespace that bench/wan_link.py builds, holding the hub's end of every
peer's veth pair. Each frame read on port p is held until `arrival + delay[p] + delay[q]` and then
written out on port q, the port its destination MAC was last seen on (flooded to every other port
while unknown, as a switch does, so ARP works). Frames of one pair of ports leave in the order they
came. The rate is not its job: `tbf` on both ends of every veth pair shapes the traffic around it.

Frames are read with PACKET_VNET_HDR, so a TSO/GSO burst of up to 64 KB crosses as one frame with
its segmentation and checksum offsets intact and the peers still talk in MTU-sized TCP segments.
That keeps the work per byte small enough for one Python process to carry a few hundred Mb/s.
Arrival times are the kernel's receive timestamps, so a late wake-up here does not add delay.

    ip netns exec HUB python delay_line.py --port IFNAME=DELAY_MS ... [--limit-bytes N]

Prints `ready` once every port is open. A line `IFNAME=DELAY_MS` on stdin changes that port's
delay for the frames that arrive from then on (held ones keep their release time; a shorter delay
may let new frames overtake them once, as a route change does) and is answered `ok`. On SIGTERM, or
when stdin closes (its owner is gone), prints one JSON line of counters and exits.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_TIMESTAMPNS = 35
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
VNET_HDR_BYTES = 10
TIMESPEC = struct.Struct("qq")
# A GSO frame is at most 64 KiB plus its headers; room for the vnet header and the Ethernet header.
FRAME_MAX = 65536 + 256
# Frames read from one port before the others and the release queue get their turn: bounds how
# long one busy direction can delay another's releases.
READ_BATCH = 64
# Held bytes beyond this are dropped, as a router drops past its buffer. The default holds the
# bandwidth-delay product of a 1 Gb/s link with 200 ms one way several times over.
DEFAULT_LIMIT_BYTES = 64 * 1024 * 1024
# Socket buffers: the receive side must absorb a burst while the loop sleeps to a release time;
# the send side holds what tbf has queued on the way out (tbf's own limit is far smaller).
SOCKET_BUFFER_BYTES = 32 * 1024 * 1024
# Releases within this much of their time go out in the same pass instead of after another sleep:
# select's wake-up costs about as much.
RELEASE_SLACK_NS = 50_000
# SCHED_RR priority 1 of 99: above every ordinary process, below the kernel's own threads.
REALTIME_PRIORITY = 1
# Ten seconds one way is beyond any real path; a larger figure is a typo.
MAX_DELAY_MS = 10_000


class Stopped(Exception):
    """SIGTERM: leave the loop wherever it is and report."""


class DelayLine:
    """The ports, the learned MAC table and the queue of held frames, ordered by release time."""

    def __init__(self, ports: dict[str, float], limit_bytes: int) -> None:
        self.names = list(ports)
        self.delay_ns = [int(ms * 1e6) for ms in ports.values()]
        self.socks = [_open_port(name) for name in self.names]
        self.index = {sock.fileno(): i for i, sock in enumerate(self.socks)}
        self.limit_bytes = limit_bytes
        self.macs: dict[bytes, int] = {}
        self.heap: list[tuple[int, int, int, bytes]] = []
        self.seq = 0
        self.held_bytes = 0
        self.stats = {"frames": 0, "bytes": 0, "dropped_frames": 0, "unsent_frames": 0,
                      "max_held_bytes": 0, "late_us_max": 0.0, "late_us_sum": 0.0}
        self.buf = bytearray(FRAME_MAX)
        self.cmsg_space = socket.CMSG_SPACE(TIMESPEC.size)

    def run(self) -> None:
        """Until SIGTERM (raised here as `Stopped`)."""
        while True:
            timeout = None
            if self.heap:
                timeout = max(0.0, (self.heap[0][0] - time.time_ns() - RELEASE_SLACK_NS) / 1e9)
            readable, _, _ = select.select([*self.socks, sys.stdin], [], [], timeout)
            for sock in readable:
                if sock is sys.stdin:
                    self._command(sys.stdin.readline())
                else:
                    self._read(sock)
            self._release()

    def _command(self, line: str) -> None:
        if not line:
            raise Stopped
        name, delay = _port(line.strip())
        if name not in self.names:
            raise SystemExit(f"no port {name!r}: {self.names}")
        self.delay_ns[self.names.index(name)] = int(delay * 1e6)
        print("ok", flush=True)

    def _read(self, sock: socket.socket) -> None:
        port = self.index[sock.fileno()]
        for _ in range(READ_BATCH):
            try:
                size, ancdata, _, _ = sock.recvmsg_into([self.buf], self.cmsg_space, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            arrived = time.time_ns()
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = TIMESPEC.unpack_from(data)
                    arrived = sec * 1_000_000_000 + nsec
            self._hold(port, bytes(self.buf[:size]), arrived)

    def _hold(self, port: int, frame: bytes, arrived: int) -> None:
        eth = frame[VNET_HDR_BYTES:]
        if len(eth) < 14:
            return
        self.macs[bytes(eth[6:12])] = port
        target = self.macs.get(bytes(eth[0:6]))
        outs = [target] if target is not None else [q for q in range(len(self.socks)) if q != port]
        for out in outs:
            if out == port:
                continue
            if self.held_bytes + len(frame) > self.limit_bytes:
                self.stats["dropped_frames"] += 1
                continue
            self.held_bytes += len(frame)
            self.stats["max_held_bytes"] = max(self.stats["max_held_bytes"], self.held_bytes)
            self.seq += 1
            release = arrived + self.delay_ns[port] + self.delay_ns[out]
            heapq.heappush(self.heap, (release, self.seq, out, frame))

    def _release(self) -> None:
        now = time.time_ns()
        while self.heap and self.heap[0][0] <= now + RELEASE_SLACK_NS:
            release, _, out, frame = heapq.heappop(self.heap)
            self.held_bytes -= len(frame)
            try:
                self.socks[out].send(frame, socket.MSG_DONTWAIT)
            except OSError:
                self.stats["unsent_frames"] += 1
                continue
            late_us = max(0.0, (now - release) / 1e3)
            self.stats["frames"] += 1
            self.stats["bytes"] += len(frame) - VNET_HDR_BYTES
            self.stats["late_us_sum"] += late_us
            self.stats["late_us_max"] = max(self.stats["late_us_max"], late_us)
            now = time.time_ns()


def _open_port(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCKET_BUFFER_BYTES)
    sock.bind((name, ETH_P_ALL))
    return sock


def _port(text: str) -> tuple[str, float]:
    name, _, ms = text.partition("=")
    try:
        delay = float(ms)
    except ValueError:
        delay = float("nan")
    if not name or not 0 <= delay <= MAX_DELAY_MS:
        raise argparse.ArgumentTypeError(f"expected IFNAME=DELAY_MS with 0 <= DELAY_MS <= {MAX_DELAY_MS}, got {text!r}")
    return name, delay


def _realtime() -> str:
    """A link's delay must not stretch because the host is busy: run at the lowest real-time
    priority when allowed (root), which only puts this loop ahead of ordinary processes when it has
    a frame to move; the kernel's real-time throttling still leaves the others 5% of a core."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))
    except (PermissionError, OSError):
        return "normal"
    return "realtime"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=_port, action="append", required=True,
                        help="IFNAME=DELAY_MS: a hub-side veth end and the one-way delay its frames get")
    parser.add_argument("--limit-bytes", type=int, default=DEFAULT_LIMIT_BYTES,
                        help="frames beyond this many held bytes are dropped")
    args = parser.parse_args()
    line = DelayLine(dict(args.port), args.limit_bytes)
    line.stats["scheduling"] = _realtime()

    def on_term(signum, frame) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    try:
        line.run()
    except Stopped:
        pass
    frames = max(1, line.stats["frames"])
    line.stats["late_us_mean"] = round(line.stats.pop("late_us_sum") / frames, 1)
    line.stats["late_us_max"] = round(line.stats["late_us_max"], 1)
    print(json.dumps(line.stats), flush=True)


if __name__ == "__main__":
    sys.exit(main())
