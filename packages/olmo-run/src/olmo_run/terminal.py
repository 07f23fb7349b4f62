"""What reaches the terminal. olmo_run's modules log through ``logging`` (loggers under
``olmo_run``); ``show_on_terminal`` is the command's choice of where that goes: INFO lines to
stdout, warnings and the end-of-run summary (``SUMMARY_LOGGER``) to stderr, each message as
it was written (no level or logger name in front). The streams are looked up when a line is
written, so a test's captured stdout and a progress bar's redirect of it both receive them."""

from __future__ import annotations

import logging
import sys

# The end-of-run table (``console.print_summary``) goes to stderr, apart from the run's lines.
SUMMARY_LOGGER = "olmo_run.summary"


class CurrentStream(logging.Handler):
    """Writes each record's message to ``sys.<name>`` as it is at that moment."""

    def __init__(self, name: str, to_stderr: bool):
        super().__init__(logging.INFO)
        self.name_of_stream = name
        self.to_stderr = to_stderr

    def filter(self, record: logging.LogRecord) -> bool:
        stderr = record.levelno >= logging.WARNING or record.name == SUMMARY_LOGGER
        return stderr == self.to_stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.name_of_stream)
            stream.write(record.getMessage() + "\n")
            stream.flush()
        except Exception:  # a closed stream: logging's own report, never a crash
            self.handleError(record)


def show_on_terminal() -> None:
    """Send ``olmo_run``'s log to the terminal (the handlers once; a later call sets the level
    and propagation again, should a library's logging set-up have reset them): the CLI calls it,
    and so does the start-up, for a run entered through ``train(recipe)`` in process."""
    logger = logging.getLogger("olmo_run")
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler the caller configured would print every line twice
    if not any(isinstance(h, CurrentStream) for h in logger.handlers):
        logger.addHandler(CurrentStream("stdout", to_stderr=False))
        logger.addHandler(CurrentStream("stderr", to_stderr=True))
