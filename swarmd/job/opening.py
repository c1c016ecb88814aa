"""Opening data files as their submitter would: every path component resolved through descriptors.

The daemon usually runs as root or its own user and reads data on behalf of whoever submitted the
job, so it must refuse what that user could not open. Reasoning about path text cannot do that:
`a/lnk/../f` is not `a/f` once `lnk` is a symlink, a symlink can lead into a directory the user may
not enter, and any name can be swapped between a check and an open. So the daemon walks each path
itself, one component at a time from a descriptor of `/`: it checks search permission on each
directory it holds (by `fstat` of that very descriptor), opens the next name with
`O_PATH | O_NOFOLLOW`, follows a symlink by reading it and walking its text the same way (`..`
after resolution, as the kernel does, bounded by `MAX_SYMLINKS`), checks read permission on the
file it reached, opens that same name for reading with `O_NOFOLLOW`, and refuses unless it got the
very inode it checked. Readers then read only through that descriptor, never by path.

Why not `setfsuid` and a plain `open`: it is per thread, needs CAP_SETUID and fails silently
without it. Why not the submitter's own process passing descriptors (SCM_RIGHTS): the control
API's framed transport carries no ancillary data; the walk here gives the same answer the kernel
would for mode bits, uid, primary and supplementary groups. What it does not model, each a refusal
or no more than the user could reach by other names: an object carrying a POSIX ACL is refused
(ACL entries can deny a named user what the mode bits grant); `fs.protected_symlinks` is not
applied; a `/proc/<pid>/...` magic link is followed by its text (so `/proc/self` is the daemon's
own process, whose private parts are 0500/0400 and refused).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import LocalError

#: Symlinks followed while resolving one path: the kernel's own bound (MAXSYMLINKS), which is what
#: ends a link loop.
MAX_SYMLINKS = 40
_ACL_XATTR = "system.posix_acl_access"
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block us


class AccessDenied(LocalError, PermissionError):
    """The reader may not open this path; the message names the user and the path."""


class NotAFile(LocalError, OSError):
    """The path names no regular file (missing, a directory, a device...); the message says which.
    An OSError too, with its errno, so a reader handles it beside the kernel's own refusals."""


@dataclass(frozen=True)
class Reader:
    """Whose permissions decide: a uid and every group it has (primary and supplementary).
    `by_kernel`: the reader is this very process, so the kernel's own checks on each `openat`
    decide (ACLs and capabilities included) and the walk adds none of its own."""

    uid: int
    groups: frozenset[int]
    by_kernel: bool = False

    @classmethod
    def of_user(cls, uid: int, gid: int) -> "Reader":
        """A peer's uid and gid (from SO_PEERCRED) plus the user's supplementary groups."""
        groups = {gid}
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return cls(uid, frozenset(groups))
        groups.update(os.getgrouplist(user.pw_name, user.pw_gid))
        return cls(uid, frozenset(groups))

    @classmethod
    def this_process(cls) -> "Reader":
        """This process itself: for tools that read their own data (reference trainer, benches)."""
        return cls(os.geteuid(), frozenset({os.getegid(), *os.getgroups()}), by_kernel=True)

    def may(self, info: os.stat_result, bit: int) -> bool:
        """`bit` is 4 (read) or 1 (search), checked against the owner, group or other triple
        the kernel would pick for this reader. Root may read and search anything."""
        if self.uid == 0 or self.by_kernel:
            return True
        if info.st_uid == self.uid:
            return bool(info.st_mode & (bit << 6))
        if info.st_gid in self.groups:
            return bool(info.st_mode & (bit << 3))
        return bool(info.st_mode & bit)


@dataclass
class OpenedFile:
    """A regular file opened for reading after the checks; `path` is where the walk found it
    (for messages and ordering), `fd` the only way to its bytes."""

    path: Path
    fd: int

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def identity(self) -> tuple[int, int]:
        info = os.fstat(self.fd)
        return info.st_dev, info.st_ino

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "OpenedFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Opener:
    """Resolves paths for one `Reader`; every descriptor it opens it closes, except the ones it
    returns (an `OpenedFile`, or a directory descriptor from `open_dir`)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def open_file(self, path: str | Path) -> OpenedFile:
        """The regular file `path` (absolute) names, opened for reading; raises `AccessDenied`
        or `NotAFile`."""
        chain, leaf, where = self._walk(str(path))
        try:
            if leaf is None:
                raise NotAFile(errno.EISDIR, f"{where} is a directory, not a file")
            return self._open_leaf(chain[-1], leaf, where, str(path))
        finally:
            _close_all(chain)

    def open_dir(self, path: str | Path) -> int:
        """A readable descriptor of the directory `path` names, for listing: the reader needs
        read and search permission on it. The caller closes it."""
        chain, leaf, where = self._walk(str(path))
        try:
            if leaf is not None:
                os.close(leaf[1])
                raise NotAFile(errno.ENOTDIR, f"{where} is not a directory")
            if not (self._allows(chain[-1], 4) and self._allows(chain[-1], 1)):
                raise AccessDenied(f"uid {self.reader.uid} may not list directory {where}")
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=chain[-1])
        finally:
            _close_all(chain)

    def _open_leaf(self, parent: int, leaf: tuple[str, int], where: str, asked: str) -> OpenedFile:
        name, probe = leaf  # the O_PATH descriptor the walk ended on: what is checked
        try:
            checked = os.fstat(probe)
            if not stat.S_ISREG(checked.st_mode):
                raise NotAFile(errno.EINVAL, f"{where} is not a regular file")
            if not self._allows(probe, 4):
                raise AccessDenied(f"uid {self.reader.uid} may not read {_shown(where, asked)}")
        finally:
            os.close(probe)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=parent)
        except PermissionError:  # the kernel's own answer, for a reader that is this process
            raise AccessDenied(f"uid {self.reader.uid} may not read {_shown(where, asked)}") from None
        except OSError as exc:  # swapped for a symlink (ELOOP) or removed since the check
            raise NotAFile(exc.errno, f"{where} changed while it was being opened") from None
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            os.close(fd)
            raise NotAFile(errno.ESTALE, f"{where} changed while it was being opened")
        return OpenedFile(Path(where), fd)

    def _walk(self, text: str) -> tuple[list[int], tuple[str, int] | None, str]:
        """Directory descriptors from `/` to the last directory reached; the final name and its
        `O_PATH` descriptor when it is not a directory (None when it is); the resolved path."""
        if not text.startswith("/"):
            raise NotAFile(errno.EINVAL, f"{text} is not an absolute path")
        chain, names = [os.open("/", _PATH_FLAGS | os.O_DIRECTORY)], []
        try:
            pending, links = _components(text), 0
            while pending:
                part = pending.pop()
                if part == "..":
                    if len(chain) > 1:
                        os.close(chain.pop())
                        names.pop()
                    continue
                self._check_search(chain[-1], names)
                fd = _open_entry(chain[-1], part, names)
                try:
                    info = os.fstat(fd)
                except OSError:
                    os.close(fd)
                    raise
                if stat.S_ISDIR(info.st_mode):
                    chain.append(fd)
                    names.append(part)
                    continue
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    target = _read_link(fd, names, part, links)
                    if target.startswith("/"):
                        _close_all(chain[1:])
                        del chain[1:], names[:]
                    pending.extend(_components(target))
                    continue
                if pending:
                    os.close(fd)
                    raise NotAFile(errno.ENOTDIR, f"{_text([*names, part])} is not a directory")
                return chain, (part, fd), _text([*names, part])
            return chain, None, _text(names)
        except BaseException:
            _close_all(chain)
            raise

    def _check_search(self, fd: int, names: list[str]) -> None:
        if not self._allows(fd, 1):
            raise AccessDenied(f"uid {self.reader.uid} may not enter directory {_text(names)}")

    def _allows(self, fd: int, bit: int) -> bool:
        """The mode bits of the object `fd` holds grant `bit`, and no ACL could say otherwise."""
        if not self.reader.may(os.fstat(fd), bit):
            return False
        return self.reader.uid == 0 or self.reader.by_kernel or not _has_acl(fd)


def _components(text: str) -> list[str]:
    """A path's names, last first (a stack: a symlink's target is pushed onto what remains)."""
    return [p for p in reversed(text.split("/")) if p not in ("", ".")]


def _open_entry(parent: int, name: str, names: list[str]) -> int:
    try:
        return os.open(name, _PATH_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise NotAFile(errno.ENOENT, f"{_text([*names, name])} does not exist") from None
    except PermissionError:  # this process itself may not (e.g. /proc/1/cwd without ptrace rights)
        raise NotAFile(errno.EACCES, f"{_text([*names, name])} cannot be opened by this process") from None


def _read_link(fd: int, names: list[str], name: str, links: int) -> str:
    try:
        if links > MAX_SYMLINKS:
            raise NotAFile(errno.ELOOP, f"{_text([*names, name])}: more than {MAX_SYMLINKS} symlinks (MAX_SYMLINKS)")
        return os.readlink("", dir_fd=fd)  # the link this descriptor holds, not whatever the name is now
    except OSError as exc:
        if isinstance(exc, NotAFile):
            raise
        raise NotAFile(exc.errno, f"{_text([*names, name])}: cannot read the symlink: {exc.strerror}") from None
    finally:
        os.close(fd)


def _has_acl(fd: int) -> bool:
    """Whether the object carries an access ACL (its mode bits alone may then grant too much)."""
    try:
        os.getxattr(f"/proc/self/fd/{fd}", _ACL_XATTR)
    except OSError:  # ENODATA: none; ENOTSUP: the filesystem has no ACLs
        return False
    return True


def _text(names: list[str]) -> str:
    return "/" + "/".join(names)


def _shown(where: str, asked: str) -> str:
    return where if where == asked else f"{where} (reached from {asked})"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
