"""The daemon's control socket served in this process around a stand-in for the daemon (a `view`):
what in-process tests of control requests and their answers talk to, through the real client."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import AsyncIterator

from swarmd import control
from transport.rpc import Router, RpcConfig, RpcServer


@contextlib.asynccontextmanager
async def serve_control(path: Path, view: object) -> AsyncIterator[Path]:
    """Bind `path` as the daemon does, register the control methods on `view` and serve them, with the
    daemon's admission check; yield the socket's path, and close both on the way out."""
    bound = control.bind(path)
    router = Router()
    control.register(router, view)
    server = await RpcServer.serve_unix(router, sock=bound.sock, config=RpcConfig(),
                                        admit=control.Admission.for_socket(bound.path).check)
    try:
        yield bound.path
    finally:
        await server.close()
        bound.close()
