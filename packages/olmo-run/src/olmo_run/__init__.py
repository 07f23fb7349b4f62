"""olmo_run: the run driver both trainers share (see ``olmo_run.driver``)."""

from .driver import RunPlan, StepResult, TrainModule, announce_finished, plan_run, run

__all__ = ["RunPlan", "StepResult", "TrainModule", "announce_finished", "plan_run", "run"]
