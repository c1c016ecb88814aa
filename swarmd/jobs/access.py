"""May the user who asked for a job read its data? Checked before the daemon opens anything.

Why a check at all: the daemon usually runs as its own user (or root) and reads data files on the
submitter's behalf; without this, any member of the control socket's group could train on (and so
leak through the model) files only the daemon may read. Why stat and not `os.setfsuid`: setfsuid
is per thread and silently ignored without CAP_SETUID, so a wrong result would look like success;
the mode bits are what the kernel itself checks (ACLs aside, which we do not grant through).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Iterable

from swarmd.errors import LocalError


class AccessDenied(LocalError, PermissionError):
    """`uid` may not read `path`; the message names both."""


def user_groups(uid: int, gid: int) -> set[int]:
    """The caller's primary group (from SO_PEERCRED) plus the user's supplementary groups."""
    groups = {gid}
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return groups
    groups.update(os.getgrouplist(user.pw_name, user.pw_gid))
    return groups


def _allowed(info: os.stat_result, uid: int, groups: set[int], read: int, other: int, group: int) -> bool:
    if info.st_uid == uid:
        return bool(info.st_mode & read)
    if info.st_gid in groups:
        return bool(info.st_mode & group)
    return bool(info.st_mode & other)


def check_readable(paths: Iterable[Path], uid: int, gid: int) -> None:
    """Raise `AccessDenied` unless `uid` could open every path for reading (search on every parent
    directory, read on the file). Root may read anything, as the kernel lets it."""
    if uid == 0:
        return
    groups = user_groups(uid, gid)
    searched: set[Path] = set()
    for path in paths:
        path = Path(os.path.abspath(path))
        for parent in reversed(path.parents):
            if parent in searched:
                continue
            info = os.stat(parent)
            if not _allowed(info, uid, groups, stat.S_IXUSR, stat.S_IXOTH, stat.S_IXGRP):
                raise AccessDenied(f"uid {uid} may not enter directory {parent}, so may not train on {path}")
            searched.add(parent)
        info = os.stat(path)
        if not _allowed(info, uid, groups, stat.S_IRUSR, stat.S_IROTH, stat.S_IRGRP):
            raise AccessDenied(f"uid {uid} may not read {path}")
