"""Boot Debian containers under a real systemd with systemd-nspawn, on a host without systemd as PID 1.

Why this shape (see docs/testing-system.md for the recipe and what failed on the way):

* The image is built once and cached in layers, because debootstrap takes minutes and the
  dependency wheels (torch) are large: a debootstrap'd base rootfs, an overlayfs upper layer with
  the dependency venv, a per-run upper layer with the swarmd wheel and units, and one writable
  upper layer per container. A layer is the upper dir of an overlay mount; once unmounted it
  serves as a lower dir of the next, so nothing is copied.
* No host systemd means nothing creates a cgroup for nspawn, and nspawn refuses to place the
  container in the root cgroup; each nspawn is moved into its own sub-cgroup of the named
  `systemd` hierarchy and of the unified one (this host runs the hybrid layout) before it execs.
* machinectl and `-M` need a host systemd, so commands reach a container through
  `nsenter -a -t <container PID 1>`.
* Containers talk over network namespaces this module creates (a bridge namespace plus one veth
  per container, private addresses set inside the namespaces only), never the host's own network.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SWARMD_TEST_CACHE", "/var/cache/swarmd-test"))
SUITE = "bookworm"
#: Beyond the issue's recipe: python3-venv, because `python3 -m venv` needs ensurepip to put pip in
#: the venv; procps, because it ships /bin/kill, which the unit's ExecReload runs (minbase lacks it).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps")
#: Bump when the way an image layer is made changes, so a cached layer built the old way is rebuilt.
RECIPE = "1"
STAMP = ".swarmd-test-stamp"
#: Where the docs (docs/operations.md) install swarmd on a host; the container follows the same steps.
VENV = "/opt/swarmd"
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"))
NETNS_DIR = Path("/run/netns")
#: Names of everything this module creates on the host carry this prefix, so a crashed run's
#: leftovers can be found and removed by the next one without touching anything else.
PREFIX = "swt-"
BRIDGE_NS = PREFIX + "br"
SUBNET = "10.213.0"
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SYSTEMD_PAGER": "cat",
             "SYSTEMD_COLORS": "0", "TERM": "dumb"}
BOOT_TIMEOUT_S = 90.0
POWEROFF_TIMEOUT_S = 30.0


class HarnessError(RuntimeError):
    """The test machinery itself failed (not the thing under test); the message says which step."""


def sh(argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a host command, capturing output; a failure names the command and shows its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"{' '.join(argv)}: no answer within {timeout:g} s") from exc
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done


# ---------------------------------------------------------------------------------------------------
# Image layers


def apt_mirror(sources: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's own apt uses for SUITE (deb822 or one-line format)."""
    if os.environ.get("SWARMD_TEST_MIRROR"):
        return os.environ["SWARMD_TEST_MIRROR"]
    files = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if SUITE in fields.get("Suites", "").split() and "main" in fields.get("Components", "").split():
                return fields.get("URIs", "").split()[0]
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 4 and words[0] == "deb" and words[2] == SUITE and "main" in words[3:]:
                return words[1]
    raise HarnessError(f"no apt source for {SUITE} main in {sources}; set SWARMD_TEST_MIRROR")


def say(message: str) -> None:
    """Progress of the slow, cached steps, so a first run's minutes of silence are explained."""
    print(f"test-system: {message}", file=sys.stderr, flush=True)


def _stamped(path: Path, key: str) -> bool:
    stamp = path / STAMP
    return stamp.is_file() and stamp.read_text() == key


def _stamp(path: Path, key: str) -> None:
    (path / STAMP).write_text(key)


def base_rootfs() -> Path:
    """The debootstrap'd rootfs, built into a scratch dir and renamed into place when complete."""
    mirror = apt_mirror()
    key = f"{RECIPE}|{SUITE}|{mirror}|{','.join(PACKAGES)}"
    path = CACHE / f"rootfs-{SUITE}"
    if _stamped(path, key):
        return path
    scratch = CACHE / f"rootfs-{SUITE}.partial"
    # An interrupted debootstrap leaves /proc (and more) mounted inside its target.
    unmount_under(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    say(f"debootstrap {SUITE} from {mirror} (minutes; cached afterwards in {path})")
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(scratch), mirror]
    try:
        sh(argv, timeout=1800)
    except HarnessError as first:
        # A mirror that drops one download fails the whole bootstrap; one fresh retry tells a flaky
        # network from a broken recipe; a second failure fails the run (the first error is printed above).
        say(f"debootstrap failed; retrying once from scratch:\n{str(first)[-2000:]}")
        unmount_under(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        sh(argv, timeout=1800)
    # A container that reads an empty machine-id gets a fresh one on each boot, as nspawn intends.
    (scratch / "etc/machine-id").write_text("")
    _stamp(scratch, key)
    scratch.rename(path)
    return path


#: Wheel tags the containers' glibc (bookworm: 2.36) runs. pip matches each tag exactly, so every
#: one a dependency may be published under is named: safetensors ships manylinux_2_17 only, and a
#: list of manylinux_2_28 alone found no wheel for it.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")


def wheelhouse() -> Path:
    """Wheels for swarmd's dependencies, fetched on the host (the containers have no route out)."""
    path = CACHE / "wheelhouse"
    key = f"{RECIPE}|{_file_digest(REPO / 'pyproject.toml')}"
    if _stamped(path, key):
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    say(f"downloading dependency wheels into {path}")
    scratch = CACHE / "wheel-scratch"
    wheel = build_wheel(scratch)
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    sh([sys.executable, "-m", "pip", "download", "-q", "-d", str(path), "--only-binary", ":all:",
        "--python-version", "3.11", *platforms, str(wheel), "torch==2.13.0"], timeout=900)
    for own in path.glob("swarmd-*.whl"):
        own.unlink()
    shutil.rmtree(scratch, ignore_errors=True)
    _stamp(path, key)
    return path


def build_wheel(dest: Path) -> Path:
    """A wheel of the working tree as it is now, so the containers run the code under test."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(REPO)], timeout=300)
    (wheel,) = dest.glob("swarmd-*.whl")
    return wheel


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def deps_layer(base: Path, wheels: Path) -> Path:
    """Overlay layer over the base: the venv at VENV with every dependency installed offline."""
    names = sorted(p.name for p in wheels.glob("*.whl"))
    key = f"{RECIPE}|{(base / STAMP).read_text()}|{','.join(names)}"
    path = CACHE / f"layer-deps-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if _stamped(path, key):
        return path
    # An interrupted build leaves its overlay mounted and a partial layer behind.
    unmount_under(CACHE / "mnt-deps")
    for stale in CACHE.glob("layer-deps-*"):
        shutil.rmtree(stale)
    say(f"installing the dependency venv into layer {path}")
    with overlay([base], path, CACHE / "mnt-deps") as root:
        run_in_image(root, [
            f"python3 -m venv {VENV}",
            f"{VENV}/bin/pip install -q --no-index --find-links /mnt/wheels {' '.join('/mnt/wheels/' + n for n in names)}",
        ], binds={wheels: "/mnt/wheels"}, timeout=900)
    _stamp(path, key)
    return path


def swarmd_layer(lowers: Sequence[Path], dest: Path) -> Path:
    """Upper layer with the working tree's swarmd wheel and units, installed as docs/operations.md says."""
    wheel = build_wheel(dest.parent / "wheel")
    units = REPO / "systemd"
    shutil.rmtree(dest, ignore_errors=True)
    with overlay(lowers, dest, dest.parent / "mnt-swarmd") as root:
        run_in_image(root, [
            f"{VENV}/bin/pip install -q --no-index --no-deps /mnt/wheel/{wheel.name}",
            f"ln -sf {VENV}/bin/swarmd {VENV}/bin/swarmctl /usr/bin/",
            "install -m 0644 /mnt/units/sysusers.d/swarmd.conf /usr/lib/sysusers.d/swarmd.conf",
            "install -m 0644 /mnt/units/tmpfiles.d/swarmd.conf /usr/lib/tmpfiles.d/swarmd.conf",
            "install -m 0644 /mnt/units/swarmd.service /mnt/units/swarmd.socket /etc/systemd/system/",
            "install -m 0644 -D /mnt/units/swarmd.toml /etc/swarmd/swarmd.toml",
        ], binds={wheel.parent: "/mnt/wheel", units: "/mnt/units"}, timeout=300)
    return dest


def run_in_image(root: Path, script: Sequence[str], *, binds: dict[Path, str], timeout: float) -> None:
    """Run shell lines inside the image without booting it (nspawn's plain, non-boot mode)."""
    args = ["-q", "-D", str(root), "--register=no", "--keep-unit", "--pipe"]
    args += [f"--bind-ro={host}:{inside}" for host, inside in binds.items()]
    name = f"{PREFIX}build"
    with cgroups(name):
        argv = _in_cgroups(name, ["systemd-nspawn", *args, "-M", name, "/bin/sh", "-ec", "\n".join(script)])
        sh(argv, timeout=timeout, env=CLEAN_ENV)


# ---------------------------------------------------------------------------------------------------
# Host plumbing: overlay mounts, cgroups, network namespaces


@contextlib.contextmanager
def overlay(lowers: Sequence[Path], upper: Path, mountpoint: Path) -> Iterator[Path]:
    """Mount `upper` over `lowers` (first lower is topmost) at `mountpoint` for the duration."""
    mount_overlay(lowers, upper, mountpoint)
    try:
        yield mountpoint
    finally:
        sh(["umount", str(mountpoint)], check=False)
        shutil.rmtree(upper.with_name(upper.name + ".work"), ignore_errors=True)


def mount_overlay(lowers: Sequence[Path], upper: Path, mountpoint: Path) -> None:
    """overlayfs needs its work dir beside the upper dir, on the same filesystem."""
    work = upper.with_name(upper.name + ".work")
    for d in (upper, work, mountpoint):
        d.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work}"
    sh(["mount", "-t", "overlay", "overlay", "-o", options, str(mountpoint)])


@contextlib.contextmanager
def cgroups(name: str) -> Iterator[None]:
    """A sub-cgroup `name` in each hierarchy nspawn needs, removed (deepest first) afterwards."""
    for root in CGROUP_ROOTS:
        (root / name).mkdir(exist_ok=True)
    try:
        yield
    finally:
        remove_cgroups(name)


def remove_cgroups(name: str) -> None:
    for root in CGROUP_ROOTS:
        top = root / name
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _in_cgroups(name: str, argv: list[str]) -> list[str]:
    """Wrap argv so the process joins cgroup `name` in every hierarchy before it execs."""
    joins = " && ".join(f"echo $$ > {root / name / 'cgroup.procs'}" for root in CGROUP_ROOTS)
    return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *argv]


def netns_exec(ns: str, *argv: str) -> None:
    sh(["ip", "netns", "exec", ns, *argv])


def create_network(names: Sequence[str]) -> dict[str, str]:
    """A bridge namespace and one namespace per container, cabled by veths; returns name -> address."""
    sh(["ip", "netns", "add", BRIDGE_NS])
    netns_exec(BRIDGE_NS, "ip", "link", "add", "br0", "type", "bridge")
    netns_exec(BRIDGE_NS, "ip", "link", "set", "br0", "up")
    addresses = {}
    for index, name in enumerate(names, start=1):
        sh(["ip", "netns", "add", name])
        netns_exec(name, "ip", "link", "set", "lo", "up")
        sh(["ip", "-n", BRIDGE_NS, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0",
            "netns", name])
        netns_exec(BRIDGE_NS, "ip", "link", "set", f"v{index}", "master", "br0", "up")
        addresses[name] = f"{SUBNET}.{index}"
        netns_exec(name, "ip", "addr", "add", f"{addresses[name]}/24", "dev", "eth0")
        netns_exec(name, "ip", "link", "set", "eth0", "up")
    return addresses


def remove_network() -> None:
    if NETNS_DIR.is_dir():
        for ns in NETNS_DIR.glob(PREFIX + "*"):
            sh(["ip", "netns", "delete", ns.name], check=False)


# ---------------------------------------------------------------------------------------------------
# Containers


@dataclass
class Container:
    """One booted container: nspawn's process on the host, and its PID 1 for nsenter."""

    name: str
    root: Path
    address: str
    console: Path
    process: subprocess.Popen[bytes] | None = None
    leader: int = 0

    def boot(self) -> None:
        """Start nspawn in its own cgroups; returns once the container's PID 1 exists."""
        with contextlib.suppress(FileNotFoundError):
            (self.root.parent / "nspawn.pid").unlink()
        for root in CGROUP_ROOTS:
            (root / self.name).mkdir(exist_ok=True)
        argv = _in_cgroups(self.name, [
            "systemd-nspawn", "-q", "-D", str(self.root), "--boot", "--register=no", "--keep-unit",
            "--console=pipe", "-M", self.name, f"--network-namespace-path={NETNS_DIR / self.name}",
        ])
        with open(self.console, "wb") as console:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console,
                                            stderr=subprocess.STDOUT, env=CLEAN_ENV)
        (self.root.parent / "nspawn.pid").write_text(str(self.process.pid))
        self.leader = self._wait_leader()

    def _wait_leader(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise HarnessError(f"{self.name}: nspawn exited {self.process.returncode}:\n{self.console_text()}")
            pid = container_init(self.name)
            if pid:
                return pid
            time.sleep(0.1)
        raise HarnessError(f"{self.name}: no container PID 1 after 30 s:\n{self.console_text()}")

    def console_text(self) -> str:
        return self.console.read_text(errors="replace")[-4000:] if self.console.exists() else ""

    def run(self, *argv: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside the container (every namespace of its PID 1), as root."""
        return sh(["nsenter", "-t", str(self.leader), "-a", "--", *argv], timeout=timeout, check=check,
                  env=CLEAN_ENV)

    def wait_system_running(self, timeout: float = BOOT_TIMEOUT_S) -> str:
        """`systemctl is-system-running --wait`, retried while the manager is not yet answering."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(f"{self.name}: systemd did not finish booting in {timeout:g} s\n"
                                   f"{self.console_text()}")
            done = self.run("systemctl", "is-system-running", "--wait", timeout=left, check=False)
            state = done.stdout.strip()
            if state in ("running", "degraded"):
                return state
            time.sleep(0.2)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, "-p", ",".join(properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def write(self, path: str, text: str) -> None:
        """Write a file into the container's own writable layer (before or after boot)."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.run("journalctl", "-u", unit, "--no-pager", "-n", str(lines), "-o", "short-monotonic",
                        check=False).stdout

    def poweroff(self) -> None:
        """SIGTERM to nspawn (the container's systemd shuts down cleanly), SIGKILL if it hangs."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(POWEROFF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None


def container_init(name: str) -> int:
    """The host pid of the container's PID 1: the process in cgroup `name` that is pid 1 in its own namespace."""
    pids: list[str] = []
    # The container's systemd creates and removes cgroups under us while it boots.
    with contextlib.suppress(OSError):
        for procs in (CGROUP_ROOTS[1] / name).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids += procs.read_text().split()
    for pid in pids:
        with contextlib.suppress(OSError):
            nspid = re.search(r"^NSpid:\s*(.*)$", Path(f"/proc/{pid}/status").read_text(), re.M)
            if nspid and len(nspid.group(1).split()) > 1 and nspid.group(1).split()[-1] == "1":
                return int(pid)
    return 0


@dataclass
class Swarm:
    """Containers sharing one image and one bridged network; torn down whole, on any failure too."""

    containers: list[Container]

    def __getitem__(self, index: int) -> Container:
        return self.containers[index]


def prepare_image() -> list[Path]:
    """Every cached layer, newest first: what `scripts/test-system.sh` builds before pytest."""
    base = base_rootfs()
    return [deps_layer(base, wheelhouse()), base]


def cleanup(run_dir: Path = CACHE / "run") -> None:
    """Remove whatever a run left on the host: nspawns it started, mounts, cgroups, namespaces."""
    if run_dir.is_dir():
        for pidfile in run_dir.glob("*/nspawn.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text())
                if "systemd-nspawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    _terminate(pid)
        unmount_under(run_dir)
    for root in CGROUP_ROOTS:
        for top in root.glob(PREFIX + "*"):
            remove_cgroups(top.name)
    remove_network()
    shutil.rmtree(run_dir, ignore_errors=True)


def _terminate(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + POWEROFF_TIMEOUT_S
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def unmount_under(path: Path) -> None:
    """Lazily unmount every mount at or below `path`, deepest first."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    inside = [m for m in mounts if m == str(path) or m.startswith(str(path) + "/")]
    for mount in sorted(inside, key=len, reverse=True):
        sh(["umount", "-l", mount], check=False)


@contextlib.contextmanager
def swarm(count: int, configure: Callable[[Container, dict[str, str]], None], run_dir: Path = CACHE / "run") -> Iterator[Swarm]:
    """Boot `count` containers of the current image; `configure(container, addresses)` runs before boot."""
    cleanup(run_dir)
    run_dir.mkdir(parents=True)
    containers: list[Container] = []
    try:
        cached = prepare_image()
        lowers = [swarmd_layer(cached, run_dir / "layer-swarmd"), *cached]
        names = [f"{PREFIX}{chr(ord('a') + i)}" for i in range(count)]
        addresses = create_network(names)
        for name in names:
            home = run_dir / name
            root = home / "root"
            mount_overlay(lowers, home / "upper", root)
            container = Container(name, root, addresses[name], home / "console.log")
            configure(container, addresses)
            containers.append(container)
        for container in containers:
            container.boot()
        for container in containers:
            container.wait_system_running()
        yield Swarm(containers)
    finally:
        for container in containers:
            container.poweroff()
        cleanup(run_dir)


if __name__ == "__main__":
    if sys.argv[1:] != ["prepare"]:
        sys.exit("usage: nspawn.py prepare   (build or reuse the cached image layers)")
    for layer in prepare_image():
        print(f"layer ready: {layer}")
