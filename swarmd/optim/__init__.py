"""Stage-wide optimizer steps: optimizers (AdamW, LAMB, SGD), LR schedule, clipping, portable state."""

from swarmd.optim.lamb import Lamb
from swarmd.optim.schedule import lr_at
from swarmd.optim.stage_optimizer import (
    NonFiniteGradient,
    StageOptimizer,
    StepReport,
    build_optimizer,
    param_groups,
)
from swarmd.optim.state import OptimizerState, OptimizerStateError, export_state, import_state

__all__ = [
    "Lamb", "NonFiniteGradient", "OptimizerState", "OptimizerStateError", "StageOptimizer", "StepReport",
    "build_optimizer", "export_state", "import_state", "lr_at", "param_groups",
]
