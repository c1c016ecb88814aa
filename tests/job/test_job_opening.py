"""Data paths opened as the submitter would: symlinks, `..`, hard links, swaps and /proc, each
judged by what the kernel would let uid `nobody` open, never by the path's text.

The test runs as root (as a daemon may) and asks for `nobody`'s view through `Reader`; the real
daemon's side of the same attacks is tests/security/test_data_paths_as_submitter.py."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from swarmd.job import AccessDenied, DataSpec, Reader, SpecError, named_sources, read_tokens, resolve_sources
from swarmd.job.opening import MAX_SYMLINKS, NotAFile, Opener

NOBODY = Reader(65534, frozenset({65534}))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="builds files nobody may not read: needs root")


@pytest.fixture
def att():
    """A 0755 directory under /tmp (pytest's own are 0700, which nobody may not enter)."""
    root = Path(tempfile.mkdtemp(prefix="swarmd-paths-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def public(path: Path, text: bytes = b"public text\n" * 8) -> Path:
    path.write_bytes(text)
    path.chmod(0o644)
    return path


def private_dir(att: Path) -> Path:
    """att/priv (0700, root) holding pub/f.txt, itself 0755/0644: only the 0700 step stops nobody."""
    (att / "priv" / "pub").mkdir(parents=True)
    (att / "priv").chmod(0o700)
    (att / "priv" / "pub").chmod(0o755)
    return public(att / "priv" / "pub" / "f.txt", b"behind a 0700 directory\n" * 8)


@needs_root
def test_symlink_then_dotdot_resolves_after_the_link_like_the_kernel(att):
    """Steps: att/lnk -> /etc/ssl, a readable decoy att/shadow; nobody names `att/lnk/../shadow`.
    Expected: the path means /etc/shadow (the link first, then `..`), which nobody may not read:
    refused naming /etc/shadow; the decoy is never what gets opened."""
    if Reader.of_user(65534, 65534).may(os.stat("/etc/shadow"), 4):
        pytest.skip("/etc/shadow is readable by nobody here")
    public(att / "shadow", b"decoy\n")
    (att / "lnk").symlink_to("/etc/ssl")
    for where in (lambda: named_sources([f"{att}/lnk/../shadow"], False, NOBODY),
                  lambda: resolve_sources(DataSpec(seq_len=2, files=("lnk/../shadow",)), att, reader=NOBODY)):
        with pytest.raises(AccessDenied, match=r"uid 65534 may not read /etc/shadow \(reached from .*lnk/\.\./shadow\)"):
            where()


@needs_root
def test_symlink_into_a_0700_directory_is_refused(att):
    """Steps: att/inlink -> att/priv/pub/f.txt, where priv is 0700 root and the file 0644.
    Expected: refused for nobody (may not enter att/priv), by name and by glob; root reads it."""
    target = private_dir(att)
    (att / "inlink").symlink_to(target)
    with pytest.raises(AccessDenied, match=r"may not enter directory .*/priv$"):
        named_sources([str(att / "inlink")], False, NOBODY)
    with pytest.raises(AccessDenied, match="may not enter directory"):
        resolve_sources(DataSpec(seq_len=2, files=("in*",)), att, reader=NOBODY)
    with pytest.raises(SpecError, match=r"'priv/pub/\*' matches no files .*; uid 65534 may not enter directory .*/priv$"):
        resolve_sources(DataSpec(seq_len=2, files=("priv/pub/*",)), att, reader=NOBODY)
    assert read_tokens(named_sources([str(att / "inlink")], False, Reader(0, frozenset({0})))).tobytes().startswith(b"behind")


@needs_root
def test_a_hard_link_to_an_unreadable_file_is_refused(att):
    """Steps: att/hard, a hard link to a 0600 root file (the link's name lives in nobody's view).
    Expected: refused: the mode is the inode's, whatever name reaches it."""
    secret = att / "secret"
    secret.write_bytes(b"root only\n")
    secret.chmod(0o600)
    os.link(secret, att / "hard")
    with pytest.raises(AccessDenied, match=r"may not read .*/hard"):
        named_sources([str(att / "hard")], False, NOBODY)


@needs_root
def test_a_symlink_swapped_after_the_check_cannot_redirect_the_read(att):
    """Steps: nobody's data att/data.txt -> att/ok.txt (readable) passes the check; then the link
    is pointed at a 0600 secret, and separately the checked file itself is replaced by a link
    to the secret, before the data is read.
    Expected: the first read gets the checked file's bytes (the walk recorded where the link led),
    the second is refused: every read walks again as the submitter and reads only what it opened."""
    secret = att / "secret"
    secret.write_bytes(b"root only\n" * 8)
    secret.chmod(0o600)
    public(att / "ok.txt", b"fine text\n" * 8)
    (att / "data.txt").symlink_to(att / "ok.txt")
    sources = named_sources([str(att / "data.txt")], False, NOBODY)
    (att / "data.txt").unlink()
    (att / "data.txt").symlink_to(secret)
    assert read_tokens(sources).tobytes() == b"fine text\n" * 8
    (att / "ok.txt").unlink()
    (att / "ok.txt").symlink_to(secret)
    with pytest.raises(AccessDenied, match="may not read .*/secret"):
        read_tokens(sources)


@needs_root
def test_proc_self_is_the_daemons_own_process_and_its_private_parts_are_refused(att, monkeypatch):
    """Steps: the reading process's cwd is att/priv/pub (behind a 0700 directory); nobody names
    /proc/self/cwd/f.txt, /proc/self/environ, /proc/self/fd/0 and /proc/self/root/etc/shadow.
    Expected: all refused: the magic links are followed by their text, so the 0700 step, the
    0400 environ and the 0500 fd directory stop nobody as they would in nobody's own lookup."""
    private_dir(att)
    monkeypatch.chdir(att / "priv" / "pub")
    with pytest.raises(AccessDenied, match="may not enter directory .*/priv"):
        named_sources(["/proc/self/cwd/f.txt"], False, NOBODY)
    with pytest.raises(AccessDenied, match=r"may not read /proc/\d+/environ"):
        named_sources(["/proc/self/environ"], False, NOBODY)
    with pytest.raises(AccessDenied, match=r"may not enter directory /proc/\d+/fd"):
        named_sources(["/proc/self/fd/0"], False, NOBODY)
    with pytest.raises(AccessDenied, match="may not read /etc/shadow"):
        named_sources(["/proc/self/root/etc/shadow"], False, NOBODY)


def test_a_link_loop_ends_at_the_kernels_symlink_bound(att):
    """Steps: att/a -> att/b -> att/a. Expected: NotAFile naming MAX_SYMLINKS, not a hang."""
    (att / "a").symlink_to(att / "b")
    (att / "b").symlink_to(att / "a")
    with pytest.raises(NotAFile, match=f"more than {MAX_SYMLINKS} symlinks"):
        Opener(NOBODY).open_file(att / "a")


def test_only_regular_files_are_data(att):
    """Steps: a FIFO, a directory, a file used as a directory, a missing name.
    Expected: each is no file (a SpecError on `data`), and opening the FIFO does not block."""
    os.mkfifo(att / "fifo")
    public(att / "f")
    for name in ("fifo", ".", "f/x", "missing"):
        with pytest.raises(SpecError, match=r"^data: .* is not an absolute path to a file"):
            named_sources([f"{att}/{name}"], False, NOBODY)


def test_readable_data_is_read_through_the_checked_descriptor(att):
    """Steps: text files reached through a symlinked directory and `..`, and a token file.
    Expected: nobody reads them; the files are the resolved paths; the token file is memory-mapped."""
    (att / "d").mkdir()
    (att / "d").chmod(0o755)
    public(att / "d" / "a.txt", b"AA")
    public(att / "b.txt", b"BBB")
    (att / "via").symlink_to(att / "d")
    sources = resolve_sources(DataSpec(seq_len=2, files=("via/a.txt", "via/../b.txt")), att, reader=NOBODY)
    assert sources.files == (att / "b.txt", att / "d" / "a.txt")
    assert read_tokens(sources).tobytes() == b"BBBAA"
    np.array([1, 2, 3], dtype="<u2").tofile(att / "t.bin")
    (att / "t.bin").chmod(0o644)
    tokens = read_tokens(named_sources([str(att / "t.bin")], True, NOBODY))
    assert isinstance(tokens, np.memmap) and tokens.tolist() == [1, 2, 3]


@needs_root
def test_group_and_supplementary_groups_grant_like_the_kernel(att):
    """Steps: a 0640 file of group 4242; a reader without the group, then with it as a
    supplementary group. Expected: refused, then read."""
    f = public(att / "g.txt", b"group text")
    os.chown(f, 0, 4242)
    f.chmod(0o640)
    with pytest.raises(AccessDenied):
        named_sources([str(f)], False, NOBODY)
    assert read_tokens(named_sources([str(f)], False, Reader(65534, frozenset({65534, 4242})))).tobytes() == b"group text"


@needs_root
def test_a_file_swapped_between_the_check_and_the_open_is_refused(att, monkeypatch):
    """Steps: the checked name is replaced (rename over it) by a 0600 secret in the instant between
    the walk's permission check and its open for reading (os.open patched to do the swap first).
    Expected: refused as changed: the descriptor read from must be the inode checked."""
    import swarmd.job.opening as opening

    secret = att / "secret"
    secret.write_bytes(b"root only\n")
    secret.chmod(0o600)
    public(att / "data.txt")
    real_open = os.open

    def swapping_open(path, flags, *args, **kwargs):
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_PATH and path == "data.txt":
            os.rename(secret, att / "data.txt")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(opening.os, "open", swapping_open)
    with pytest.raises(NotAFile, match="changed while it was being opened"):
        Opener(NOBODY).open_file(att / "data.txt")


@needs_root
def test_a_file_whose_acl_denies_what_its_mode_grants_is_refused(att):
    """Steps: a 0644 file with a POSIX access ACL entry `user:nobody:---` (written as the kernel's
    xattr, no setfacl needed); the kernel refuses nobody although the mode's `other` bits allow.
    Expected: refused too (an ACL'd object is never judged by its mode bits alone)."""
    f = public(att / "acl.txt")
    undefined = 0xFFFFFFFF
    entries = [(0x01, 6, undefined), (0x02, 0, 65534), (0x04, 4, undefined), (0x10, 4, undefined), (0x20, 4, undefined)]
    try:
        os.setxattr(f, "system.posix_acl_access",
                    struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs on this filesystem: {exc}")
    assert oct(f.stat().st_mode & 0o777) == "0o644"
    with pytest.raises(AccessDenied, match=r"may not read .*/acl\.txt"):
        named_sources([str(f)], False, NOBODY)


AS_THIS_PROCESS = """
import sys
from swarmd.job.opening import AccessDenied, Opener, Reader
reader = Reader.this_process()
for path in sys.argv[1:]:
    try:
        Opener(reader).open_file(path).close()
        print(path, "read")
    except AccessDenied as exc:
        print(path, "refused:", exc)
"""


@needs_root
@pytest.mark.slow
def test_a_local_tool_run_by_a_user_gets_the_kernels_own_answers(att):
    """Steps: as `nobody` (setpriv), a process opens a 0644 file, a 0600 root file and a 0644 file
    whose ACL denies nobody, as itself (`Reader.this_process()`: the kernel decides).
    Expected: read, refused (naming the file), refused."""
    readable, secret, acl = public(att / "r.txt"), att / "s.txt", public(att / "acl.txt")
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    denied = [(0x01, 6, 0xFFFFFFFF), (0x02, 0, 65534), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)]
    try:
        os.setxattr(acl, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in denied))
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs on this filesystem: {exc}")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[2]))}
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                           AS_THIS_PROCESS, str(readable), str(secret), str(acl)],
                          capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{readable} read"
    assert lines[1] == f"{secret} refused: uid 65534 may not read {secret}"
    assert lines[2].startswith(f"{acl} refused")
