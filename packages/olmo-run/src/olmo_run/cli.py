"""The command line both trainers share: ``olmo-train-{jax,torch} [RECIPE.yaml] [--key=value ...]``
and ``... --dry-run --devices KIND:COUNT [--json]`` (``olmo_run.dry_run``). ``--help`` lists every
recipe key with its default and meaning; ``--print-recipe`` prints the resolved recipe and exits.

A dry run exits 0 when the step fits the devices and 1 when it does not. Bad input (a recipe,
spec, data or checkpoint problem) is one line on stderr and exit status 2, before anything is
written; a run that diverges is one line and exit status 3, with the newest checkpoint the last
good state. SIGTERM or SIGINT (``olmo_run.preempt``): the step in flight finishes, a checkpoint
of it is committed, one line, exit status 4 (rerun the same command to resume); a second signal,
or ``checkpoint.preempt_timeout_s`` without an end, exits at once with 128 + the signal number.
A checkpoint or metrics write that fails mid-run (a full disk, a quota, an I/O error) stops the
run before its next step: one line naming the file and the OS's reason ("No space left on
device"), exit status 5; the newest complete checkpoint stays the latest, and a rerun once the
fault is fixed resumes from it and removes the unfinished checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from olmo_data import DataError
from olmo_model import PEAKS, SpecError, UnknownDeviceError
from olmo_run.errors import RunDirWriteError, TrainingDivergedError, TrainingStateError
from olmo_run.recipe import Recipe, RecipeError, load_recipe
from olmo_run.recipe_help import recipe_help

from .dry_run import DryRunReport, parse_dry_run_args, print_report
from .preempt import EXIT_PREEMPTED, Preempted
from .terminal import show_on_terminal

# What ``--help`` says of the flags besides the recipe keys, after the trainer's own text.
OPTIONS = """Options:
  -h, --help        this text: the options, the exit statuses, every recipe key
  --print-recipe    print the resolved recipe (defaults, RECIPE.yaml, then --key=value) as YAML and exit
  --dry-run --devices KIND:COUNT [--json]
                    one step of the recipe set up for COUNT devices of KIND, measured without running
                    it: the per-device memory beside olmo-plan's estimate; exit 0 when it fits, 1 when
                    it does not. KIND: {kinds} (olmo_model.PEAKS; each
                    trainer names the kinds it cannot target)"""

# What ``--help`` says of the exit statuses, after the options.
EXIT_STATUSES = """Exit statuses:
  0  finished (or already complete)
  2  bad input (recipe, spec, data, checkpoint): one line, nothing written
  3  diverged (non-finite loss or state, too many skipped steps): one line, no bad checkpoint
  4  preempted (SIGTERM / SIGINT): the step in flight finished and its checkpoint committed;
     rerun the same command to resume. A second signal, or checkpoint.preempt_timeout_s without
     an end, exits at once with 128 + the signal number, the newest committed checkpoint kept
  5  a checkpoint or metrics write failed (a full disk): one line naming the file and the
     reason; the newest complete checkpoint stays the latest, rerun once the fault is fixed
  1  (dry run) the step does not fit the devices; otherwise a bug: its traceback"""

# Bad input, as opposed to a bug, whichever trainer reads it (each adds its own weight errors).
INPUT_ERRORS: tuple[type[Exception], ...] = (RecipeError, SpecError, DataError, TrainingStateError, UnknownDeviceError)
# A checkpoint or metrics write that failed mid-run (errors.RunDirWriteError: a full disk, say).
EXIT_WRITE_FAILED = 5


def run_cli(
    prog: str,
    doc: str | None,
    argv: list[str] | None,
    train: Callable[[], Callable[[Recipe], Any]],
    input_errors: tuple[type[Exception], ...],
    *,
    reports: Callable[[], bool] = lambda: True,
    cleanup: Callable[[], None] | None = None,
    dry_run: Callable[[], Callable[[Recipe, str, int], DryRunReport]] | None = None,
) -> int:
    """Parse ``argv`` (default: sys.argv), run ``train()(recipe)``, map failures to exit statuses.
    ``train`` returns the trainer's entry point, so a framework import can wait until the recipe
    parsed; ``reports`` says whether this process prints errors (rank 0); ``cleanup`` runs last.
    ``dry_run`` returns the trainer's ``(recipe, device_kind, count) -> DryRunReport``."""
    args = list(sys.argv[1:] if argv is None else argv)
    show_on_terminal()  # olmo_run's log lines: INFO to stdout, warnings and the summary to stderr
    if args and args[0] in ("-h", "--help"):
        print(f"{doc}\n{OPTIONS.format(kinds=', '.join(PEAKS))}\n\n{EXIT_STATUSES}\n\n{recipe_help()}")
        return 0
    try:
        print_recipe = "--print-recipe" in args
        args, dry = parse_dry_run_args([a for a in args if a != "--print-recipe"])
        path = args.pop(0) if args and not args[0].startswith("--") else None
        recipe = load_recipe(path, args)
        if print_recipe:
            print(recipe.to_yaml(), end="")
            return 0
        if dry is not None:
            if dry_run is None:
                raise RecipeError(f"{prog} has no --dry-run")
            return print_report(recipe, dry_run()(recipe, dry.device_kind, dry.count), dry.as_json)
        train()(recipe)
    except input_errors as err:
        if reports():
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except TrainingDivergedError as err:
        if reports():
            print(f"{prog}: stopped: {err}", file=sys.stderr, flush=True)
        return 3
    except Preempted as err:
        if reports():
            print(f"{prog}: preempted: {err}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except RunDirWriteError as err:
        if reports():
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_WRITE_FAILED
    finally:
        if cleanup is not None:
            cleanup()
    return 0
