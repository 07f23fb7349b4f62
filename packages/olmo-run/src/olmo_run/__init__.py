"""olmo_run: the run driver both trainers share (see ``olmo_run.driver``)."""

from .driver import TrainModule, run
from .loop import StepMetrics
from .startup import Processes, RunSetup, Trainer, announce_finished, read_inputs, resolve_run, start

__all__ = [
    "Processes",
    "RunSetup",
    "StepMetrics",
    "TrainModule",
    "Trainer",
    "announce_finished",
    "read_inputs",
    "resolve_run",
    "run",
    "start",
]
