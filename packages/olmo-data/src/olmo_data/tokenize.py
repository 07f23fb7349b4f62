"""`olmo-data tokenize`: turn text (local jsonl / parquet / txt files, or a HF hub dataset)
into zstd shards, with several processes, resumably, split into independent jobs.

    uv run --frozen olmo-data tokenize --input 'data/*.jsonl' --tokenizer tokenizer.json \
        --output shards/ --num-proc 8 [--shard-index 0 --num-shards 4] [--docs-per-shard 100000]

Work is cut into *units*: one local jsonl/parquet file (or .txt file with --txt-per-line),
a group of --docs-per-shard .txt files (one document each), or a block of --docs-per-shard
rows of a hub dataset. Units are sorted; job i of n takes units i, i+n, i+2n, ... Each unit
writes `<unit>-<part>.shard` files (unit: the input's path below the common input folder) of at most --docs-per-shard documents, each document's
ids followed by eos. A shard already present with a valid manifest for the same input
and first document is skipped, so a killed run resumes where it stopped.

--output (and --tokenizer) may be a ``gs://`` / ``s3://`` URL (`olmo_data.fileio`): each shard
is written to a local temp file and uploaded once complete, so a killed job leaves no partial
object and the resume check works on the bucket as on a folder.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.fileio import StorageError
from olmo_data.shards import DEFAULT_CHUNK_TOKENS, SHARD_SUFFIX, ShardWriter, read_manifest

_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
_TEXT_SUFFIXES = (*_JSON_SUFFIXES, ".parquet", ".txt")
# Documents tokenized per encode_batch call: large enough to amortise the call.
_ENCODE_BATCH = 256


@dataclass(frozen=True)
class Unit:
    """One independent piece of input: `kind` is jsonl|parquet|txt-lines|txt-files|hub."""

    name: str  # output file stem, unique among units
    kind: str
    paths: tuple[str, ...] = ()
    start: int = 0  # hub: first row
    stop: int = 0  # hub: one past the last row


@dataclass(frozen=True)
class Options:
    tokenizer: str
    output: str
    text_field: str
    docs_per_shard: int
    dtype: str
    eos_token_id: int
    chunk_tokens: int
    hub_split: str


def _kind_of(path: str, txt_per_line: bool) -> str:
    if path.endswith(_JSON_SUFFIXES):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".txt"):
        return "txt-lines" if txt_per_line else "txt-files"
    raise DataError(f"{path}: unsupported input type; use one of {', '.join(_TEXT_SUFFIXES)} or a hub dataset name")


def _local_files(inputs: list[str]) -> list[str] | None:
    """Local files named by the inputs, or None if the single input is a hub dataset name."""
    import glob

    files: set[str] = set()
    for item in inputs:
        if glob.has_magic(item):
            matches = [m for m in glob.glob(item, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise DataError(f"--input {item}: glob matches no file; check the pattern")
            files.update(matches)
        elif os.path.isdir(item):
            files.update(str(p) for p in Path(item).rglob("*") if p.is_file() and str(p).endswith(_TEXT_SUFFIXES))
        elif os.path.isfile(item):
            files.add(item)
        elif len(inputs) == 1 and not item.endswith(_TEXT_SUFFIXES) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", item):
            return None
        else:
            raise DataError(f"--input {item}: no such file, directory or glob; check the path")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no input files found (supported: {', '.join(_TEXT_SUFFIXES)})")
    return sorted(files)


def _stem(path: str, root: str) -> str:
    """A file-name-safe unit name; the input's suffix stays so a.jsonl and a.parquet differ."""
    return re.sub(r"[^\w.-]+", "_", os.path.relpath(path, root).replace(os.sep, "__"))


def plan_units(inputs: list[str], docs_per_shard: int, txt_per_line: bool, hub_split: str) -> list[Unit]:
    """All units of the inputs, in a deterministic order (independent of --num-shards)."""
    files = _local_files(inputs)
    if files is None:
        num_rows = _load_hub(inputs[0], hub_split).num_rows
        return [
            Unit(f"{_stem(inputs[0], '.')}-{hub_split}-{start:012d}", "hub", (inputs[0],), start, stop)
            for start in range(0, num_rows, docs_per_shard)
            for stop in [min(start + docs_per_shard, num_rows)]
        ]
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    units, loose_txt = [], []
    for f in files:
        kind = _kind_of(f, txt_per_line)
        if kind == "txt-files":
            loose_txt.append(f)
        else:
            units.append(Unit(_stem(os.path.abspath(f), root), kind, (f,)))
    for g in range(0, len(loose_txt), docs_per_shard):
        units.append(Unit(f"txt-{g // docs_per_shard:06d}", "txt-files", tuple(loose_txt[g : g + docs_per_shard])))
    return units


def _load_hub(name: str, split: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"--input {name}: not a local file, and reading hub datasets needs `datasets`; "
            "install the extra: uv sync --extra tokenize (or give local jsonl/parquet/txt files)"
        ) from None
    return datasets.load_dataset(name, split=split)


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8")
    return open(path, encoding="utf-8")


def _documents(unit: Unit, opts: Options) -> Iterator[str]:
    """The unit's document texts, in file order."""
    if unit.kind == "jsonl":
        with _open_text(unit.paths[0]) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    yield record[opts.text_field]
                except json.JSONDecodeError as e:
                    raise DataError(f"{unit.paths[0]}:{line_no}: invalid JSON ({e}); fix or drop the line") from None
                except (KeyError, TypeError):
                    raise DataError(
                        f"{unit.paths[0]}:{line_no}: no field {opts.text_field!r}; pass --text-field NAME"
                    ) from None
    elif unit.kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{unit.paths[0]}: reading parquet needs pyarrow; install it or convert to jsonl") from None
        table = pq.read_table(unit.paths[0])
        if opts.text_field not in table.column_names:
            raise DataError(
                f"{unit.paths[0]}: no column {opts.text_field!r} (has {table.column_names}); pass --text-field"
            )
        yield from table.column(opts.text_field).to_pylist()
    elif unit.kind == "txt-lines":
        with open(unit.paths[0], encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f)
    elif unit.kind == "txt-files":
        for path in unit.paths:
            yield Path(path).read_text(encoding="utf-8")
    else:
        rows = _load_hub(unit.paths[0], opts.hub_split).select(range(unit.start, unit.stop))
        for row in rows:
            yield row[opts.text_field]


def _finished(path: str, unit: Unit, first_doc: int) -> bool:
    """A shard from an earlier run is reusable if complete and written for this very part."""
    # exists() raises on missing credentials, a missing bucket or a network failure, so those
    # stop the job here instead of passing for "not written yet".
    if not fileio.exists(path):
        return False
    try:
        meta = read_manifest(path)["metadata"]
    except StorageError:
        raise  # cannot read the store: not evidence that the shard is unfinished
    except DataError:  # truncated, corrupt, or gone since exists()
        return False
    return meta.get("unit") == unit.name and meta.get("first_input_doc") == first_doc


_TOKENIZER: Any = None


def _init_worker(tokenizer_path: str, quiet_threads: bool) -> None:
    global _TOKENIZER
    if quiet_threads:
        # N worker processes each spawning a Rust thread pool would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(fileio.read_text(tokenizer_path))


def _write_part(path: str, texts: list[str], unit: Unit, first_doc: int, opts: Options) -> tuple[int, int]:
    texts = [t for t in texts if t]
    if not texts:
        return 0, 0
    tokens = 0
    with ShardWriter(
        path, opts.dtype, opts.chunk_tokens, metadata={"unit": unit.name, "first_input_doc": first_doc}
    ) as writer:
        for b in range(0, len(texts), _ENCODE_BATCH):
            for enc in _TOKENIZER.encode_batch(texts[b : b + _ENCODE_BATCH], add_special_tokens=False):
                ids = np.asarray(enc.ids + [opts.eos_token_id], dtype=np.int64)
                writer.add_document(ids)
                tokens += ids.size
    return len(texts), tokens


def _run_unit(args: tuple[Unit, Options]) -> dict[str, int]:
    unit, opts = args
    stats = {"docs": 0, "tokens": 0, "tokenized": 0, "written": 0, "skipped": 0}
    part, first_doc = 0, 0
    texts: list[str] = []

    def flush() -> None:
        path = fileio.join(opts.output, f"{unit.name}-{part:05d}{SHARD_SUFFIX}")
        if _finished(path, unit, first_doc):
            m = read_manifest(path)
            stats["docs"] += m["num_docs"]
            stats["tokens"] += m["num_tokens"]
            stats["skipped"] += 1
            return
        docs, tokens = _write_part(path, texts, unit, first_doc, opts)
        stats["docs"] += docs
        stats["tokens"] += tokens
        stats["tokenized"] += tokens
        stats["written"] += docs > 0

    for text in _documents(unit, opts):
        texts.append(text)
        if len(texts) == opts.docs_per_shard:
            flush()
            part, first_doc, texts = part + 1, first_doc + len(texts), []
    if texts:
        flush()
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="olmo-data tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files, globs, directories, or one hub dataset name")
    p.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json (path or gs:// / s3:// URL)")
    p.add_argument("--output", required=True, help="folder for the .shard files (path or gs:// / s3:// URL)")
    p.add_argument("--text-field", default="text", help="jsonl key / parquet column / hub column of the text")
    p.add_argument("--num-proc", type=int, default=1, help="worker processes (units run in parallel)")
    p.add_argument("--shard-index", type=int, default=0, help="this job's index in [0, --num-shards)")
    p.add_argument("--num-shards", type=int, default=1, help="independent jobs the units are split over")
    p.add_argument("--docs-per-shard", type=int, default=100_000, help="most documents in one output shard")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="default: uint16 if the vocab fits, else uint32")
    p.add_argument("--eos-token-id", type=int, help="default: the tokenizer's <|endoftext|> id")
    p.add_argument("--txt-per-line", action="store_true", help=".txt inputs hold one document per line")
    p.add_argument("--split", default="train", help="hub dataset split")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per zstd chunk")
    return p


def tokenize_main(argv: list[str]) -> int:
    """Entry of `olmo-data tokenize`; returns the exit status."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from tokenizers import Tokenizer

    args = _parser().parse_args(argv)
    if not 0 <= args.shard_index < args.num_shards:
        raise DataError(f"--shard-index {args.shard_index} is outside [0, --num-shards {args.num_shards})")
    if args.docs_per_shard <= 0 or args.num_proc <= 0:
        raise DataError("--docs-per-shard and --num-proc must be positive")
    if not fileio.isfile(args.tokenizer):
        raise DataError(f"--tokenizer {args.tokenizer}: file not found; pass a tokenizer.json")
    tokenizer = Tokenizer.from_str(fileio.read_text(args.tokenizer))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = args.dtype or ("uint16" if vocab <= 1 << 16 else "uint32")
    if dtype == "uint16" and vocab > 1 << 16:
        raise DataError(f"--dtype uint16 cannot hold the {vocab} ids of {args.tokenizer}; use --dtype uint32")
    eos = args.eos_token_id if args.eos_token_id is not None else tokenizer.token_to_id("<|endoftext|>")
    if eos is None:
        raise DataError(f"{args.tokenizer}: no <|endoftext|> token; pass --eos-token-id")
    opts = Options(
        # absolute: workers may run elsewhere than the current folder (spawn)
        tokenizer=args.tokenizer if fileio.is_remote(args.tokenizer) else os.path.abspath(args.tokenizer),
        output=args.output,
        text_field=args.text_field,
        docs_per_shard=args.docs_per_shard,
        dtype=dtype,
        eos_token_id=eos,
        chunk_tokens=args.chunk_tokens,
        hub_split=args.split,
    )
    fileio.makedirs(args.output)
    units = plan_units(args.input, args.docs_per_shard, args.txt_per_line, args.split)[
        args.shard_index :: args.num_shards
    ]

    console = Console(stderr=True)
    totals = {"docs": 0, "tokens": 0, "tokenized": 0, "written": 0, "skipped": 0}
    t0 = time.perf_counter()
    columns = (
        TextColumn("tokenize"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[docs]} docs"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("units", total=len(units), docs=0)
        work = [(u, opts) for u in units]
        results: Iterator[dict[str, int]]
        if args.num_proc == 1:
            _init_worker(opts.tokenizer, quiet_threads=False)
            results = map(_run_unit, work)
            pool = None
        else:
            # fork on Linux: a spawned worker re-imports olmo_data (grain included), ~2-10 s each.
            # Forking is safe here: the parent has not run a tokenizers thread pool (it only
            # read the vocab), and workers load their own tokenizer with threads off.
            method = "fork" if sys.platform == "linux" else "spawn"
            pool = multiprocessing.get_context(method).Pool(args.num_proc, _init_worker, (opts.tokenizer, True))
            results = pool.imap_unordered(_run_unit, work)
        try:
            for stats in results:
                for k in totals:
                    totals[k] += stats[k]
                progress.update(task, advance=1, docs=totals["docs"])
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    seconds = time.perf_counter() - t0
    table = Table(title=f"olmo-data tokenize -> {args.output} (job {args.shard_index}/{args.num_shards})")
    for col in ("units", "docs", "tokens", "shards written", "shards skipped", "seconds", "tokens/s (new)"):
        table.add_column(col, justify="right")
    table.add_row(
        str(len(units)),
        f"{totals['docs']:,}",
        f"{totals['tokens']:,}",
        str(totals["written"]),
        str(totals["skipped"]),
        f"{seconds:.1f}",
        f"{totals['tokenized'] / max(seconds, 1e-9):,.0f}",
    )
    console.print(table)
    return 0
