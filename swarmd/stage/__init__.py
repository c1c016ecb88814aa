"""Serving pipeline stages: the executor, stage-wide optimizer steps among stage-mates, state
download for joiners and checkpoints. The RPC schema is docs/stage-rpc.md."""

from swarmd.stage.errors import BAD_INPUT, BUSY, NOT_READY, NOT_SERVING, STALE_STEP
from swarmd.stage.limits import StageLimits
from swarmd.stage.server import StageServer
from swarmd.stage.service import StageService, StepRecord

__all__ = ["BAD_INPUT", "BUSY", "NOT_READY", "NOT_SERVING", "STALE_STEP", "StageLimits", "StageServer",
           "StageService", "StepRecord"]
