"""StageServer: the `stage.*` RPC methods on one transport Router, dispatched to served stages.

A daemon has one Router but may serve several stages (of one job or of several), and a Router
takes each method name once, so the server registers every method once and routes each call by
its `job` and `stage` meta to the `StageService` serving it; a call for anything else is refused
with `not_serving`. The schema is docs/stage-rpc.md.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from swarmd.stage.errors import bad_input, not_serving
from transport.rpc import Message, Request, Router

if TYPE_CHECKING:
    from swarmd.stage.service import StageService

UNARY = ("forward", "backward", "forward_backward", "info",
         "sync.progress", "sync.round", "sync.reduce", "sync.gather", "sync.abort")


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
        self._services: dict[tuple[bytes, int], StageService] = {}
        for name in UNARY:
            router.unary(f"stage.{name}", self._unary(name))
        router.stream("stage.state", self._state)

    def add(self, service: "StageService") -> None:
        key = (service.job_id, service.stage_index)
        if key in self._services:
            raise ValueError(f"stage {service.stage_index} of this job is already served here")
        self._services[key] = service

    def remove(self, service: "StageService") -> None:
        if self._services.get((service.job_id, service.stage_index)) is service:
            del self._services[(service.job_id, service.stage_index)]

    def services(self) -> list["StageService"]:
        return list(self._services.values())

    def _unary(self, name: str):
        method = name.replace(".", "_")

        async def handle(req: Request) -> Message:
            return await getattr(self._lookup(req), method)(req)

        return handle

    async def _state(self, req: Request) -> AsyncIterator[Message]:
        async for item in self._lookup(req).state_stream(req):
            yield item

    def _lookup(self, req: Request) -> "StageService":
        job, stage = req.meta.get("job"), req.meta.get("stage")
        if not isinstance(job, bytes) or type(stage) is not int:
            raise bad_input("meta must carry 'job' (bytes) and 'stage' (int)")
        service = self._services.get((job, stage))
        if service is None:
            raise not_serving(f"this peer does not serve stage {stage} of job {job.hex()[:16]}")
        return service
