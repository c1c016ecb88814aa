"""The swarm key: a shared secret that makes a swarm private (see docs/security.md).

Every daemon of a private swarm loads the same key file (`--swarm-key-file`) and proves it knows the
key in each connection's hello (an HMAC over the transcript, never the key itself); a peer without
it is dropped before any other frame is read. `swarmctl keygen` writes a new one with `generate`.

File format: 32 random bytes, stored either raw (exactly 32 bytes) or as 64 hex digits with an
optional trailing newline (easy to paste into a secrets manager). Anything else is refused. A key
file is a credential: one that its group or other users can read (or write) is refused, the way ssh
refuses a private key with loose permissions, because anyone who reads it can join the swarm.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from swarmd.errors import LocalError

SWARM_KEY_BYTES = 32


class SwarmKeyError(LocalError, ValueError):
    """The key file is missing, unreadable, badly formatted or readable by others."""


def generate(path: str | os.PathLike, *, hex_format: bool = True) -> bytes:
    """Write a fresh key to `path` (mode 0600, created exclusively: an existing key is never
    overwritten, since replacing it silently would cut this machine off from its swarm)."""
    key = secrets.token_bytes(SWARM_KEY_BYTES)
    data = (key.hex() + "\n").encode() if hex_format else key
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{path}: a key file already exists; remove it first to replace it") from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def load(path: str | os.PathLike) -> bytes:
    """Read and check a key file; the 32 key bytes, or SwarmKeyError saying what is wrong."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SwarmKeyError(f"{path}: no such swarm key file (create one with `swarmctl keygen`)") from None
    except OSError as exc:
        raise SwarmKeyError(f"{path}: cannot open the swarm key file: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of the file we opened, so a swap between check and read cannot fool us
        if not stat.S_ISREG(info.st_mode):
            raise SwarmKeyError(f"{path}: a swarm key file must be a regular file")
        loose = stat.S_IMODE(info.st_mode) & 0o077
        if loose:
            raise SwarmKeyError(
                f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets other users read or write the swarm "
                f"key; run `chmod 600 {path}`"
            )
        raw = os.read(fd, 2 * SWARM_KEY_BYTES + 3)
    finally:
        os.close(fd)
    if len(raw) == SWARM_KEY_BYTES:
        return raw
    text = raw.rstrip(b"\r\n")
    if len(text) == 2 * SWARM_KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise SwarmKeyError(
        f"{path}: a swarm key file holds {SWARM_KEY_BYTES} raw bytes or {2 * SWARM_KEY_BYTES} hex digits"
    )
