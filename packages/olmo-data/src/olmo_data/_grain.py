"""Import Grain without its jax-profiler warning (olmo_data imports this first).

Grain tries to import jax's profiler when it is imported and, where jax is not installed (a
torch-only or data-only environment), logs "Failed to load jax profiler" through absl. olmo_data
never uses that profiler, so the line is noise. absl's first log call also installs a root
handler (``logging.basicConfig()``) when none exists, which would change how every later
library warning is printed; a stand-in handler during the import keeps the root as it was.
"""

from __future__ import annotations

import logging

from absl import logging as absl_logging


def _not_profiler_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load jax profiler")


def _import_grain_quietly() -> None:
    absl_logger, root = absl_logging.get_absl_logger(), logging.getLogger()
    # What Python prints with no logging configured: the message alone, on stderr.
    stand_in = None if root.handlers else (logging.lastResort or logging.NullHandler())
    absl_logger.addFilter(_not_profiler_warning)
    if stand_in is not None:
        root.addHandler(stand_in)
    try:
        import grain  # noqa: F401
    finally:
        absl_logger.removeFilter(_not_profiler_warning)
        if stand_in is not None:
            root.removeHandler(stand_in)


_import_grain_quietly()
