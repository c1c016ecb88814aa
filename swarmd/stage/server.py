"""StageServer: the `stage.*` RPC methods on one transport Router, dispatched to served stages.

A daemon has one Router but may serve several stages (of one job or of several), and a Router
takes each method name once, so the server registers every method once and routes each call by
its `job` and `stage` meta to the `StageService` serving it; a call for anything else is refused
with `not_serving`. The schema is docs/stage-rpc.md.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Protocol

from swarmd.stage.errors import AlreadyServed, bad_input, not_serving
from transport.rpc import Message, Request, Router


class ServedStage(Protocol):
    """What the server routes calls to (StageService)."""

    job_id: bytes
    stage_index: int

    async def forward(self, req: Request) -> Message: ...
    async def backward(self, req: Request) -> Message: ...
    async def forward_backward(self, req: Request) -> Message: ...
    async def evaluate(self, req: Request) -> Message: ...
    async def info(self, req: Request) -> Message: ...
    async def sync_progress(self, req: Request) -> Message: ...
    async def sync_round(self, req: Request) -> Message: ...
    async def sync_reduce(self, req: Request) -> Message: ...
    async def sync_gather(self, req: Request) -> Message: ...
    async def sync_abort(self, req: Request) -> Message: ...
    def state_stream(self, req: Request) -> AsyncGenerator[Message, None]: ...


Handler = Callable[[ServedStage, Request], Awaitable[Message]]

#: Every unary method and the service handler it reaches: one explicit table, no name strings.
UNARY: dict[str, Handler] = {
    "stage.forward": lambda s, r: s.forward(r),
    "stage.backward": lambda s, r: s.backward(r),
    "stage.forward_backward": lambda s, r: s.forward_backward(r),
    "stage.evaluate": lambda s, r: s.evaluate(r),
    "stage.info": lambda s, r: s.info(r),
    "stage.sync.progress": lambda s, r: s.sync_progress(r),
    "stage.sync.round": lambda s, r: s.sync_round(r),
    "stage.sync.reduce": lambda s, r: s.sync_reduce(r),
    "stage.sync.gather": lambda s, r: s.sync_gather(r),
    "stage.sync.abort": lambda s, r: s.sync_abort(r),
}


_BY_ROUTER: "weakref.WeakKeyDictionary[Router, StageServer]" = weakref.WeakKeyDictionary()


class StageServer:
    @classmethod
    def for_router(cls, router: Router) -> "StageServer":
        """The router's StageServer, created on first use (a Router takes each method once)."""
        server = _BY_ROUTER.get(router)
        if server is None:
            server = _BY_ROUTER[router] = cls(router)
        return server

    def __init__(self, router: Router) -> None:
        self._services: dict[tuple[bytes, int], ServedStage] = {}
        for method, handler in UNARY.items():
            router.unary(method, self._unary(handler))
        router.stream("stage.state", self._state)

    def add(self, service: ServedStage) -> None:
        key = (service.job_id, service.stage_index)
        if key in self._services:
            raise AlreadyServed(f"stage {service.stage_index} of this job is already served here")
        self._services[key] = service

    def remove(self, service: ServedStage) -> None:
        if self._services.get((service.job_id, service.stage_index)) is service:
            del self._services[(service.job_id, service.stage_index)]

    def services(self) -> list[ServedStage]:
        return list(self._services.values())

    def _unary(self, handler: Handler):
        async def handle(req: Request) -> Message:
            return await handler(self._lookup(req), req)

        return handle

    async def _state(self, req: Request) -> AsyncIterator[Message]:
        # Closed here, not left to the garbage collector: the service frees its slot in `finally`.
        async with contextlib.aclosing(self._lookup(req).state_stream(req)) as items:
            async for item in items:
                yield item

    def _lookup(self, req: Request) -> ServedStage:
        job, stage = req.meta.get("job"), req.meta.get("stage")
        if not isinstance(job, bytes) or type(stage) is not int:
            raise bad_input("meta must carry 'job' (bytes) and 'stage' (int)")
        service = self._services.get((job, stage))
        if service is None:
            raise not_serving(f"this peer does not serve stage {stage} of job {job.hex()[:16]}")
        return service
