"""Where a job's data lives on this machine, found and read as the user who asked for it.

A spec names its data by globs (`data.files`) or one token file (`data.tokens`); `swarmctl
submit --data` / `train --data` name files instead. Finding them walks the filesystem, so it is
kept out of spec parsing (a spec read from the DHT never touches the disk here) and runs off the
event loop. Every directory listed and every file opened goes through `swarmd.job.opening`, with
the permissions of the `Reader` the sources belong to: the submitter's, or this process's own for
local tools. `Sources` holds resolved paths and that reader, not descriptors: `read_tokens` opens
each file again through the same checked walk and reads only through the descriptor it got, so
a later read (a trainer started long after the submission) is checked at the moment it reads,
and a daemon holds no descriptors for jobs that have no trainer here.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from swarmd.job.data import MAX_TEXT_BYTES, TokenDataset, TrainingData
from swarmd.job.errors import SpecError
from swarmd.job.opening import AccessDenied, NotAFile, OpenedFile, Opener, Reader
from swarmd.job.spec import BatchSpec, DataSpec, EvalSpec, eval_data_spec
from swarmd.tokenfile import TokenDtype, TokenFileError, map_tokens

STDLIB_PLACEHOLDER = "{stdlib}"
#: Data paths one `--data` list may name.
MAX_DATA_PATHS = 256


@dataclass(frozen=True)
class Sources:
    """A spec's data on this machine: text files, or one token file, and whose rights read them."""

    files: tuple[Path, ...] = ()
    tokens: Path | None = None
    reader: Reader = field(default_factory=Reader.this_process)
    token_dtype: TokenDtype = "uint16"


def expand_path(pattern: str, base_dir: str | Path) -> str:
    """`{stdlib}` becomes Python's standard library directory; relative paths start at `base_dir`
    (joined as text: `..` is left for the walk to resolve after any symlink, as the kernel does)."""
    pattern = pattern.replace(STDLIB_PLACEHOLDER, sysconfig.get_paths()["stdlib"])
    return str(Path(base_dir).absolute() / os.path.expanduser(pattern))


@dataclass(frozen=True)
class GlobLimits:
    """Bounds on expanding a spec's `data.files` patterns, all patterns of one spec together.

    A pattern comes from whoever submits the job: `/**/*` would walk the daemon's whole filesystem
    and match millions of files, so the walk stops with a `SpecError` on `data.files` as soon as
    either bound is passed, before anything is read. A training set of more files than this
    belongs in a pre-tokenized `data.tokens` file."""

    max_files: int = 4096  # distinct regular files matched
    max_entries: int = 50_000  # directory entries looked at while matching

    def __post_init__(self) -> None:
        if self.max_files < 1 or self.max_entries < 1:
            raise ValueError("GlobLimits needs max_files >= 1 and max_entries >= 1")


class _GlobWalk:
    """glob's rules (`*`, `?`, `[...]` within a name, `**` for any depth, names starting with a
    dot only matched by patterns that start with one), walked by hand so every directory entry
    is counted and every listing is one the reader may make (a directory it may not list has no
    matches, as with its own glob). Unlike glob, `**` does not descend into symlinked
    directories: a link loop or a link to `/` cannot multiply the walk. Candidates are path text;
    each is opened through the checked walk, which resolves its symlinks and `..`."""

    def __init__(self, limits: GlobLimits, opener: Opener) -> None:
        self.limits, self.opener = limits, opener
        self.entries = 0
        self.refused: AccessDenied | None = None  # the first listing refused, for the "no files" message

    def matches(self, expanded: str, pattern: str) -> Iterator[str]:
        """Candidate paths for `expanded`; `pattern` (as the spec wrote it) is for messages."""
        yield from self._walk("/", Path(expanded).parts[1:], pattern)

    def _walk(self, here: str, parts: tuple[str, ...], pattern: str) -> Iterator[str]:
        if not parts:
            yield here
            return
        head, rest = parts[0], parts[1:]
        if head == "**":
            yield from self._walk(here, rest, pattern)
            for entry in self._listing(here, pattern):
                if entry.name.startswith("."):
                    continue
                if not rest:
                    yield os.path.join(here, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(os.path.join(here, entry.name), parts, pattern)
        elif glob.has_magic(head):
            for entry in self._listing(here, pattern):
                if fnmatch.fnmatchcase(entry.name, head) and (head.startswith(".") or not entry.name.startswith(".")):
                    yield from self._walk(os.path.join(here, entry.name), rest, pattern)
        else:
            yield from self._walk(os.path.join(here, head), rest, pattern)

    def _listing(self, here: str, pattern: str) -> list[os.DirEntry]:
        try:
            fd = self.opener.open_dir(here)
        except AccessDenied as exc:  # not the reader's to list: no matches there, as with its glob
            self.refused = self.refused or exc
            return []
        except OSError:  # not a directory, or gone
            return []
        listing: list[os.DirEntry] = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    self.entries += 1
                    if self.entries > self.limits.max_entries:
                        raise SpecError("data.files", f"{pattern!r} looks at more than {self.limits.max_entries} "
                                                      "directory entries (jobs.data_max_entries); name the files "
                                                      "more precisely, or pre-tokenize them into data.tokens")
                    listing.append(entry)
        except OSError:  # a listing the kernel refuses even the daemon midway (/proc/1/map_files)
            return []
        finally:
            os.close(fd)
        return listing


def _probe(opener: Opener, path: str) -> OpenedFile | None:
    """The file at `path` opened as the reader would, or None when it is no regular file.
    `AccessDenied` passes: a file the pattern names that the reader may not read is an error."""
    try:
        return opener.open_file(path)
    except NotAFile:
        return None


def resolve_sources(data: DataSpec, base_dir: str | Path, limits: GlobLimits = GlobLimits(),
                    reader: Reader | None = None) -> Sources:
    """The concrete files behind a data spec, each opened once as `reader` (default: this
    process) to prove it may; raises `SpecError` naming the field when any is missing or when
    `data.files` expands past `limits`, `AccessDenied` when the reader may not read one. It walks
    the filesystem: call it off the event loop."""
    reader = reader or Reader.this_process()
    opener = Opener(reader)
    if data.tokens is not None:
        path = expand_path(data.tokens, base_dir)
        opened = _probe(opener, path)
        if opened is None:
            raise SpecError("data.tokens", f"{path} is not a file")
        opened.close()
        return Sources(tokens=opened.path, reader=reader, token_dtype=data.token_dtype)
    found: dict[tuple[int, int], Path] = {}
    walk = _GlobWalk(limits, opener)
    for pattern in data.files or ():
        matched = False
        for candidate in walk.matches(expand_path(pattern, base_dir), pattern):
            opened = _probe(opener, candidate)
            if opened is None:
                continue
            matched = True
            found.setdefault(opened.identity(), opened.path)
            opened.close()
            if len(found) > limits.max_files:
                raise SpecError("data.files", f"{pattern!r} matches more than {limits.max_files} files "
                                              "(jobs.data_max_files); pre-tokenize them into data.tokens")
        if not matched:
            why = f"; {walk.refused}" if walk.refused else ""
            raise SpecError("data.files", f"{pattern!r} matches no files (from {base_dir}){why}")
    return Sources(files=tuple(sorted(set(found.values()))), reader=reader)


def named_sources(paths: Sequence[str], tokens: bool, reader: Reader, token_dtype: TokenDtype = "uint16") -> Sources:
    """`--data` files given by absolute path (they replace the spec's own), each opened once as
    `reader`; `tokens`: the spec reads one token file, of `token_dtype` ids. Raises `SpecError` or
    `AccessDenied`."""
    if len(paths) > MAX_DATA_PATHS:
        raise SpecError("data", f"{len(paths)} paths, over MAX_DATA_PATHS ({MAX_DATA_PATHS})")
    opener, found = Opener(reader), []
    for path in paths:
        try:
            opened = opener.open_file(path)
        except NotAFile as exc:  # its message says why: missing, a directory, a loop, ...
            raise SpecError("data", f"{path} is not an absolute path to a file ({exc.strerror})") from None
        found.append(opened.path)
        opened.close()
    if tokens:
        if len(found) != 1:
            raise SpecError("data.tokens", "a token-file job takes exactly one --data file")
        return Sources(tokens=found[0], reader=reader, token_dtype=token_dtype)
    return Sources(files=tuple(sorted(set(found))), reader=reader)


def read_tokens(sources: Sources, max_text_bytes: int = MAX_TEXT_BYTES) -> np.ndarray:
    """The whole token stream: uint8 bytes of the files in path order, or the memory-mapped .bin.
    Each file is opened through the checked walk as `sources.reader` and read through that
    descriptor alone."""
    opener = Opener(sources.reader)
    if sources.tokens is not None:
        return _map_tokens(_reopen(opener, sources.tokens, "data.tokens"), sources.token_dtype)
    sizes = []
    for path in sources.files:  # one descriptor at a time: a daemon's soft fd limit may be 1024
        with _reopen(opener, path, "data.files") as file:
            sizes.append(file.size())
    if sum(sizes) > max_text_bytes:
        raise SpecError("data.files", f"{sum(sizes)} bytes of text exceed max_text_bytes ({max_text_bytes}); "
                                      "pre-tokenize into a .bin file for data.tokens")
    stream = np.empty(sum(sizes), dtype=np.uint8)
    offset = 0
    for path, size in zip(sources.files, sizes):  # a file grown since is read up to its size then
        with _reopen(opener, path, "data.files") as file:
            offset += _read_into(file.fd, memoryview(stream)[offset: offset + size])
    return stream[:offset]


def _reopen(opener: Opener, path: Path, field_name: str) -> OpenedFile:
    opened = _probe(opener, str(path))
    if opened is None:
        raise SpecError(field_name, f"{path} is no longer a file")
    return opened


def _read_into(fd: int, buffer: memoryview) -> int:
    """Fill `buffer` from the start of `fd` (less if the file shrank); the bytes read."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], done)
        if n == 0:
            break
        done += n
    return done


def _map_tokens(opened: OpenedFile, token_dtype: TokenDtype) -> np.ndarray:
    """The token file memory-mapped from its descriptor (the map outlives the descriptor)."""
    try:
        with os.fdopen(os.dup(opened.fd), "rb") as file:
            return map_tokens(file, token_dtype)
    except TokenFileError as exc:
        raise SpecError("data.tokens", str(exc)) from None
    finally:
        opened.close()


def open_training_data(data: DataSpec, batch: BatchSpec, vocab: int, seed: int, base_dir: str | Path,
                       max_text_bytes: int = MAX_TEXT_BYTES, evaluation: EvalSpec | None = None) -> TrainingData:
    """A local tool's data (the reference trainer, benches): found and read as this process."""
    tokens = read_tokens(resolve_sources(data, base_dir), max_text_bytes)
    held_out = None
    if evaluation is not None and evaluation.enabled and evaluation.files is not None:
        eval_data = eval_data_spec(data, evaluation)
        try:
            eval_tokens = read_tokens(resolve_sources(eval_data, base_dir), max_text_bytes)
        except SpecError as exc:  # named after the [eval] field it came from
            raise SpecError("eval.files", exc.message) from None
        held_out = TokenDataset(eval_tokens, data.seq_len, vocab)
    return TrainingData(TokenDataset(tokens, data.seq_len, vocab), batch, seed, evaluation, held_out)


__all__ = ["MAX_DATA_PATHS", "GlobLimits", "Sources", "expand_path", "named_sources",
           "open_training_data", "read_tokens", "resolve_sources"]
