"""The trainer side of SWARM training: stochastic wiring (pure) and the trainer that drives steps.
See docs/trainer.md."""

from swarmd.train.errors import InputRefused, TrainerError
from swarmd.train.events import EventSink, StatusEvent, StepEvent, TrainerEvent
from swarmd.train.replies import StageShapes, stage_shapes
from swarmd.train.trainer import BanRecord, Trainer, TrainerConfig
from swarmd.train.wiring import Kind, Pick, StageWiring, Throughput, Wiring, WiringConfig

__all__ = [
    "BanRecord", "EventSink", "InputRefused", "Kind", "Pick", "StageShapes", "StageWiring", "StatusEvent", "StepEvent",
    "Throughput", "Trainer", "TrainerConfig", "TrainerError", "TrainerEvent", "Wiring",
    "WiringConfig", "stage_shapes",
]
