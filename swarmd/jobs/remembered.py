"""The stages a daemon served, kept in its state dir so that a restart rejoins them.

Why a file and not the DHT: after a crash the DHT still holds our old announcements, but only
until they expire, and they say nothing about which of them we meant to keep. The file is small
JSON (`{"format": 1, "stages": [{"job": hex, "stage": i}, ...]}`), written atomically (temp
file, fsync, rename, fsync of the directory) so a crash mid-write leaves the old file whole.
A file that cannot be read is set aside as `<name>.bad` with a warning, never fatal: losing the
memory costs a manual `swarmctl serve`, refusing to start would cost the whole daemon.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "served-stages.json"
FORMAT = 1
#: Entries read from the file (more than any `jobs.max_stages` a host runs); the rest are ignored.
MAX_REMEMBERED = 256
#: A file larger than this is not ours (MAX_REMEMBERED entries take about 25 KiB).
MAX_FILE_BYTES = 64 * 1024

Key = tuple[bytes, int]  # (job id, stage)


class RememberedStages:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE_NAME

    def load(self) -> list[Key]:
        """The remembered (job id, stage) pairs; [] when there is no file or it is unreadable."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return _parse(data)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s): set aside as %s.bad; its stages are not rejoined",
                        self.path, exc, self.path.name)
            try:
                os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            except OSError:
                pass
            return []

    def save(self, keys: set[Key]) -> None:
        """Replace the file with `keys` atomically (call off the event loop: it fsyncs)."""
        body = json.dumps({"format": FORMAT, "stages": [{"job": job.hex(), "stage": stage}
                                                        for job, stage in sorted(keys)]}, indent=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _parse(data: object) -> list[Key]:
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("stages"), list):
        raise ValueError(f"not a format-{FORMAT} served-stages file")
    keys: list[Key] = []
    for entry in data["stages"][:MAX_REMEMBERED]:
        job, stage = (entry.get("job"), entry.get("stage")) if isinstance(entry, dict) else (None, None)
        if not isinstance(job, str) or isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise ValueError(f"bad entry {entry!r}")
        try:
            job_id = bytes.fromhex(job)
        except ValueError:
            raise ValueError(f"bad job id {job!r}") from None
        keys.append((job_id, stage))
    return keys
