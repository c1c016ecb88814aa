"""Real daemons for the rebalancing test (the job tests' fixtures), and real per-peer compute speeds.

Peers of a real swarm differ in speed; on one shared box they do not, so the test gives each daemon
process a CFS bandwidth quota (cgroup v1 `cpu` controller): a daemon held to 8% of a core computes
at most that fast, for real. Without a writable cpu controller (not root, or cgroup v2 only) the
test is skipped and says why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from jobswarm import kit, swarm, swarm_root, swarmctl  # noqa: F401 (fixtures)

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
#: CFS period of the test's groups: short, so even a few milliseconds of compute feel the quota.
PERIOD_US = 10_000


def _own_cpu_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_ROOT / path.lstrip("/")
    raise FileNotFoundError("no cgroup v1 cpu controller in /proc/self/cgroup")


class CpuQuotas:
    """One cgroup per throttled process under a group of our own; `close` moves them back out."""

    def __init__(self) -> None:
        self.home = _own_cpu_cgroup()
        self.base = self.home / f"swarmd-rebalance-{os.getpid()}"
        self.base.mkdir()
        self.groups: list[Path] = []

    def limit(self, pid: int, name: str, cores: float) -> None:
        group = self.base / name
        group.mkdir()
        self.groups.append(group)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        (group / "cgroup.procs").write_text(str(pid))  # v1: moves every thread of the process

    def close(self) -> None:
        for group in self.groups:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (self.home / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # exited meanwhile
            group.rmdir()
        self.base.rmdir()


@pytest.fixture
def cpu_quotas() -> Iterator[CpuQuotas]:
    try:
        quotas = CpuQuotas()
    except OSError as exc:
        pytest.skip(f"needs a writable cgroup v1 cpu controller to give peers real, different speeds: {exc}")
    try:
        yield quotas
    finally:
        quotas.close()
