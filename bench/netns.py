"""Two network namespaces joined by a veth pair with a `tc tbf` rate limit on both ends.

A real, shaped link on one machine: the benchmark measures goodput against it and the chaos tests
cut or slow it. Addresses live only inside the namespaces this module creates and deletes, so
nothing touches the host's own network. Needs root (CAP_NET_ADMIN) and iproute2.

    with shaped_link(rate_mbit=200) as link:
        server = link.popen("a", [sys.executable, "server.py", link.addr_a])
        ...  # connect from namespace "b": link.popen("b", ...)

Importable from tests by path as well as from bench/: build the module with
`importlib.util.spec_from_file_location`, put it in `sys.modules` under its name, then exec it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

# tbf needs a bucket at least one (GSO) packet deep and about rate/HZ; 256 KiB covers both at
# 200 Mb/s with HZ as low as 100, and is under 0.01 s of data so it does not inflate a measurement.
DEFAULT_BURST = "256kb"
# Queueing delay tbf allows before dropping; 50 ms lets TCP fill the pipe without a bufferbloat test.
DEFAULT_LATENCY = "50ms"
SUBNET_PREFIX = "10.203.0"


def unavailable_reason() -> str | None:
    """Why a shaped link cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


@dataclass(frozen=True)
class ShapedLink:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    rate_mbit: float

    def ns(self, side: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b}[side]

    def exec_prefix(self, side: str) -> list[str]:
        """Prepend to an argv to run it inside namespace `side` ("a" or "b")."""
        return ["ip", "netns", "exec", self.ns(side)]

    def popen(self, side: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(side), *argv], **kwargs)

    def qdisc_stats(self, side: str) -> str:
        """`tc -s qdisc` of that end's device: proof the shaper is installed and passing traffic."""
        dev = self.dev_a if side == "a" else self.dev_b
        return _run("tc", "-n", self.ns(side), "-s", "qdisc", "show", "dev", dev)

    def set_rate(self, rate_mbit: float, burst: str = DEFAULT_BURST, latency: str = DEFAULT_LATENCY) -> None:
        """Change the rate on both ends in place (a chaos test slowing a link mid-run)."""
        for side, dev in (("a", self.dev_a), ("b", self.dev_b)):
            _tbf(self.ns(side), dev, "change", rate_mbit, burst, latency)

    def set_up(self, up: bool) -> None:
        """Bring the link down (both ends) or back up: a cut cable, as seen by TCP."""
        state = "up" if up else "down"
        _run("ip", "-n", self.ns_a, "link", "set", self.dev_a, state)
        _run("ip", "-n", self.ns_b, "link", "set", self.dev_b, state)


@contextmanager
def shaped_link(
    rate_mbit: float = 200,
    burst: str = DEFAULT_BURST,
    latency: str = DEFAULT_LATENCY,
) -> Iterator[ShapedLink]:
    """Create the pair, yield it, and delete both namespaces (and with them the veth) on exit."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot build a shaped link: {reason}")
    tag = f"{os.getpid()}{secrets.token_hex(2)}"
    link = ShapedLink(
        ns_a=f"swd-a-{tag}",
        ns_b=f"swd-b-{tag}",
        dev_a=f"swa{tag}"[:15],
        dev_b=f"swb{tag}"[:15],
        addr_a=f"{SUBNET_PREFIX}.1",
        addr_b=f"{SUBNET_PREFIX}.2",
        rate_mbit=rate_mbit,
    )
    created: list[str] = []
    try:
        for ns in (link.ns_a, link.ns_b):
            _run("ip", "netns", "add", ns)
            created.append(ns)
        _run("ip", "link", "add", link.dev_a, "netns", link.ns_a, "type", "veth", "peer", "name", link.dev_b,
             "netns", link.ns_b)
        for ns, dev, addr in ((link.ns_a, link.dev_a, link.addr_a), (link.ns_b, link.dev_b, link.addr_b)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _tbf(ns, dev, "add", rate_mbit, burst, latency)
        yield link
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _tbf(ns: str, dev: str, verb: str, rate_mbit: float, burst: str, latency: str) -> None:
    _run("tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf",
         "rate", f"{rate_mbit}mbit", "burst", burst, "latency", latency)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout
