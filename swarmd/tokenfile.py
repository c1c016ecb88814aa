"""Token files: raw little-endian uint16 or uint32 token ids, memory-mapped, never read whole.

uint16 is nanoGPT's `.bin` layout and holds vocabularies up to 65,536; larger vocabularies (Llama
3's 128k, say) need uint32. There is no header, so the width is the job's `data.token_dtype`. A
file is mapped, not read: a trainer touches only the windows of its samples, so a 100 GB file costs
page cache, not memory. Every window a trainer reads is checked against the model's vocabulary
(`swarmd.job.data.TokenDataset.samples`); a whole-file scan would read it whole.

    python -m swarmd.tokenfile IN.txt OUT.bin [--dtype uint16|uint32]   # bytes as ids, for trying it out
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from swarmd.errors import LocalError

TokenDtype = Literal["uint16", "uint32"]
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenFileError(LocalError, ValueError):
    """A token file that cannot be what the job says it is (size, width). A ValueError too, as the
    data readers that open it catch malformed input as one."""


def largest_vocab(token_dtype: TokenDtype) -> int:
    """One past the largest id a file of this width can hold."""
    return 1 << (8 * TOKEN_DTYPES[token_dtype].itemsize)


def vocab_problem(token_dtype: TokenDtype, vocab: int) -> str | None:
    """Why a model of `vocab` ids cannot read files of `token_dtype`, or None."""
    if vocab > largest_vocab(token_dtype):
        return (f"is {vocab}, but data.token_dtype {token_dtype} holds ids below {largest_vocab(token_dtype)}; "
                "use uint32")
    return None


def map_tokens(file: str | os.PathLike | BinaryIO, token_dtype: TokenDtype) -> np.memmap:
    """The ids of a token file (a path, or an open binary file whose descriptor is used),
    memory-mapped read-only; raises TokenFileError for an empty file or a partial id."""
    dtype = TOKEN_DTYPES[token_dtype]
    name = getattr(file, "name", file)
    size = os.fstat(file.fileno()).st_size if hasattr(file, "fileno") else Path(file).stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise TokenFileError(f"{name} is {size} bytes, not a whole number of {token_dtype} tokens")
    return np.memmap(file, dtype=dtype, mode="r")


def write_tokens(path: str | os.PathLike, ids: np.ndarray, token_dtype: TokenDtype) -> None:
    """Write ids as a token file (for tools and tests); refuses ids the width cannot hold."""
    ids = np.asarray(ids)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= largest_vocab(token_dtype)):
        raise TokenFileError(f"ids must be in [0, {largest_vocab(token_dtype)}) for {token_dtype}")
    ids.astype(TOKEN_DTYPES[token_dtype]).tofile(path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m swarmd.tokenfile", description="Write a text file's bytes "
                                     "as a token file (ids 0-255), for data.tokens.")
    parser.add_argument("text", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=sorted(TOKEN_DTYPES), default="uint16")
    args = parser.parse_args(argv)
    write_tokens(args.out, np.frombuffer(args.text.read_bytes(), dtype=np.uint8), args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
