"""The `olmo-data` command line.

    olmo-data inspect MIX [--json]
    olmo-data batches MIX --start S --count N [--global-batch B] [--dp-size R --dp-rank r] [--digest]
    olmo-data check-leakage MIX [--json] [--allow]
    olmo-data tokenize ...    (olmo_data.tokenize)
    olmo-data sample ...      (olmo_data.sample)

MIX is a mixture YAML path or `sample`. Example: `uv run --frozen olmo-data inspect sample`.

Batch digests (`batches --digest`): `olmo_data.digest`'s additive digest of each global batch
(0-based), the value both trainers log as `batch_digest` at the 1-based step that trains it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from olmo_data.digest import batch_digest, combine_digests
from olmo_data.errors import DataError
from olmo_data.leakage import LeakageError, assert_no_leakage, check_leakage
from olmo_data.loader import MixtureLoader
from olmo_data.mixture import Mixture, load_mixture


def describe(mixture: Mixture) -> dict[str, Any]:
    """Per-source numbers for `inspect`: sizes, target vs realised ratio, epochs."""
    order = mixture.order
    slots = mixture.slots_per_epoch()
    instances = mixture.num_instances()
    caps = mixture.max_instances()
    # cast: a source without a ratio has tokens (SourceConfig._one_target).
    weights = [s.ratio if s.ratio is not None else cast(int, s.tokens) for s in mixture.config.sources]
    sources = []
    for i, (cfg, src) in enumerate(zip(mixture.config.sources, mixture.training_sources)):
        cap = caps[i]
        sources.append(
            {
                "name": cfg.name,
                "files": len(mixture.training_files[i]),
                "tokens": src.num_tokens,
                "docs": src.num_docs,
                "instances": instances[i],
                "target_ratio": weights[i] / sum(weights),
                "realised_ratio": slots[i] / order.epoch_size,
                "source_epochs_per_mixture_epoch": slots[i] / instances[i],
                "max_repetition": cfg.max_repetition,
                "mixture_epochs_allowed": None if cap is None else cap / max(1, slots[i]),
            }
        )
    held = [
        {
            "name": name,
            "tokens": src.num_tokens,
            "docs": src.num_docs,
            "instances": src.num_tokens // mixture.sequence_length,
            "eval_sequences": mixture.config.eval.sequences_per_source,
        }
        for name, src in mixture.held_out_sources.items()
    ]
    return {
        "mixture": str(mixture.path),
        "name": mixture.config.name,
        "fingerprint": mixture.fingerprint(),
        "seed": mixture.seed,
        "sequence_length": mixture.sequence_length,
        "instances_per_mixture_epoch": order.epoch_size,
        "sources": sources,
        "held_out": held,
    }


def _inspect(args: argparse.Namespace, console: Console) -> int:
    info = describe(load_mixture(args.mixture))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    console.print(
        f"[bold]{info['name']}[/] {info['mixture']}\nfingerprint {info['fingerprint']}  seed {info['seed']}  "
        f"sequence {info['sequence_length']}  instances/mixture epoch {info['instances_per_mixture_epoch']}"
    )
    table = Table(
        "source",
        "files",
        "tokens",
        "docs",
        "instances",
        "target",
        "realised",
        "epochs/mix-epoch",
        "max rep",
        "mix-epochs allowed",
        title="training sources",
    )
    for s in info["sources"]:
        allowed = "-" if s["mixture_epochs_allowed"] is None else f"{s['mixture_epochs_allowed']:.3g}"
        table.add_row(
            s["name"],
            str(s["files"]),
            f"{s['tokens']:,}",
            f"{s['docs']:,}",
            f"{s['instances']:,}",
            f"{s['target_ratio']:.4f}",
            f"{s['realised_ratio']:.4f}",
            f"{s['source_epochs_per_mixture_epoch']:.3f}",
            str(s["max_repetition"] or "-"),
            allowed,
        )
    console.print(table)
    held = Table("held-out source", "tokens", "docs", "instances", "eval sequences", title="held-out sources")
    for h in info["held_out"]:
        held.add_row(h["name"], f"{h['tokens']:,}", f"{h['docs']:,}", f"{h['instances']:,}", str(h["eval_sequences"]))
    console.print(held)
    return 0


def _batches(args: argparse.Namespace, console: Console) -> int:
    ranks = range(args.dp_size) if args.dp_rank is None else [args.dp_rank]
    mixture = load_mixture(args.mixture)
    loaders = [MixtureLoader(mixture, args.global_batch, r, args.dp_size) for r in ranks]
    rows = args.global_batch // args.dp_size
    for step in range(args.start, args.start + args.count):
        if args.digest:
            digests = [batch_digest(ld.batch_at(step), step, ld.dp_rank * rows) for ld in loaders]
            print(f"{step} {combine_digests(digests)}")
            continue
        first = step * args.global_batch
        for ld in loaders:
            index = np.arange(first + ld.dp_rank * rows, first + (ld.dp_rank + 1) * rows)
            source, within = mixture.order.instances_at(index)
            for i, s, w in zip(index.tolist(), source.tolist(), within.tolist()):
                print(f"step {step} rank {ld.dp_rank} instance {i}: {mixture.source_names[s]}[{w}]")
    return 0


def _check_leakage(args: argparse.Namespace, console: Console) -> int:
    mixture = load_mixture(args.mixture)
    report = check_leakage(mixture)
    try:
        assert_no_leakage(mixture, allow=args.allow)  # reads the report check_leakage just cached
        status = 0
    except LeakageError as e:
        Console(stderr=True).print(f"[bold red]LEAKAGE[/] {e}", soft_wrap=True)
        status = 1
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        return status
    table = Table(
        "held-out source",
        "docs",
        "exact copies",
        "docs with n-gram hits",
        "contaminated",
        "fraction",
        title=f"leakage ({report.ngram}-grams, {report.training_tokens:,} training tokens, {report.seconds:.2f} s)",
    )
    for h in report.held_out:
        table.add_row(
            h.source,
            str(h.docs_checked),
            str(len(h.exact_matches)),
            str(len(h.ngram_hits)),
            str(len(h.contaminated_docs)),
            f"{h.fraction:.2%}",
        )
    console.print(table)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # tokenize and sample belong to their own modules, which parse their own arguments.
    if argv and argv[0] in ("tokenize", "sample"):
        if argv[0] == "tokenize":
            from olmo_data.tokenize import tokenize_main as entry
        else:
            from olmo_data.sample import sample_main as entry
        return _one_line_errors(lambda: entry(argv[1:]))
    parser = argparse.ArgumentParser(prog="olmo-data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="per-source tokens, docs, target vs realised ratio, epochs, fingerprint")
    p.add_argument("mixture")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("batches", help="print the instances or the digests of global batches")
    p.add_argument("mixture")
    p.add_argument("--start", type=int, default=0, help="first step")
    p.add_argument("--count", type=int, default=1, help="number of steps")
    p.add_argument("--global-batch", type=int, default=8, help="instances per global batch")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--dp-rank", type=int, default=None, help="only this rank's rows (default: all ranks)")
    p.add_argument("--digest", action="store_true", help="one additive sha256 digest per batch line")
    p = sub.add_parser("check-leakage", help="held-out documents / n-grams found in training sources")
    p.add_argument("mixture")
    p.add_argument("--json", action="store_true")
    p.add_argument("--allow", action="store_true", help="report leakage but exit 0 (loud warning)")
    sub.add_parser("tokenize", help="tokenize text into shards (olmo-data tokenize --help)")
    sub.add_parser("sample", help="build the embedded sample mixture (olmo-data sample --help)")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # rich assumes 80 columns when piped; the tables need more
        console = Console(width=160)
    command = {"inspect": _inspect, "batches": _batches, "check-leakage": _check_leakage}[args.command]
    return _one_line_errors(lambda: command(args, console))


def _one_line_errors(run: Callable[[], int]) -> int:
    """Run a command; bad input (a DataError names the file, the field and the fix) or an
    unreadable file prints one line instead of a traceback, and exits 2."""
    try:
        return run()
    except (DataError, ValueError, OSError) as e:
        # Text, not markup: messages hold brackets such as olmo-data[tokenize]
        Console(stderr=True).print(Text.assemble(("error", "bold red"), f" {e}"), soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
