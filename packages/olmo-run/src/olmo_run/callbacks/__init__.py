"""The loop's cadenced jobs (``olmo_run.loop.Callback``), one class per job, one module each.
``default_callbacks`` is every job of this package's modules, ordered by ``Callback.order``
(the order of their hooks within a step): the train line, the checkpoint, the preemption check
(which saves the step if the checkpoint did not), the evaluation, the lock's heartbeat; the
profiler acts before a step. A new job is one new module here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from ..loop import Callback


def default_callbacks() -> list[Callback]:
    jobs = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        jobs += [
            cls()
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Callback) and cls is not Callback and cls.__module__ == module.__name__
        ]
    return sorted(jobs, key=lambda job: job.order)
