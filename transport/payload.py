"""Tensors to frame buffers and back: the codec work of one message, kept off the wire rules.

A message's tensors travel as the frame's `x` list (one metadata map per tensor) and its payload
buffers; `codecs.buffer_count` says how many buffers each tensor takes. torch is imported only once
a tensor is actually sent or received, so a control client never loads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import MalformedFrame, RpcError
from .limits import Limits
from .message import Message
from .wire import Frame

if TYPE_CHECKING:
    import torch

CODE_BAD_REPLY = "bad_reply"


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def frame_bytes(frame: Frame) -> int:
    return sum(len(b) for b in frame.buffers)


def check_reply(method: str, reply: object) -> Message:
    """A handler's return value, refused with `bad_reply` unless it is a Message."""
    if not isinstance(reply, Message):
        raise RpcError(CODE_BAD_REPLY, f"handler of {method} returned {type(reply).__name__}, not Message")
    return reply


def encode_all(tensors: list[torch.Tensor], codec: str) -> tuple[list[dict], list]:
    from .codecs import encode_tensor  # deferred: torch loads only once a tensor is sent

    metas, buffers = [], []
    for tensor in tensors:
        meta, bufs = encode_tensor(tensor, codec)
        metas.append(meta)
        buffers.extend(bufs)
    return metas, buffers


def decode_all(metas: list, buffers: list, limits: Limits) -> list[torch.Tensor]:
    """Split the frame's buffers among its tensors (codecs.buffer_count says how many each takes)."""
    if len(metas) > len(buffers) + limits.max_buffers_per_frame:
        raise MalformedFrame("more tensors announced than the frame can carry")
    if metas:
        from .codecs import buffer_count, check_message_budget, decode_tensor  # deferred: torch loads only for tensors
        check_message_budget(metas, buffers, limits)
    tensors, start = [], 0
    for meta in metas:
        count = buffer_count(meta)
        if start + count > len(buffers):
            raise MalformedFrame("tensor list needs more buffers than the frame has")
        tensors.append(decode_tensor(meta, buffers[start : start + count], limits))
        start += count
    if start != len(buffers):
        raise MalformedFrame(f"frame has {len(buffers) - start} buffers no tensor claims")
    return tensors


async def offload(size: int, threshold: int, work: Callable[..., Any], *args: Any) -> Any:
    """Codec work on the loop when small; in a worker thread past `threshold` bytes, so a 100 MB
    tensor does not stall every other connection's frames for the milliseconds it takes."""
    if size > threshold:
        return await asyncio.get_running_loop().run_in_executor(None, work, *args)
    return work(*args)
