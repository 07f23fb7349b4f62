"""`olmo-data tokenize` and `olmo_data.tokenize(...)`: turn text (local jsonl / parquet / txt
files, HF `datasets` folders and .arrow files, or a HF hub dataset) into zstd shards or
OLMo-core token files, with several processes, resumably, split into independent jobs.

    uv run --frozen olmo-data tokenize --input 'data/*.jsonl' --tokenizer tokenizer.json \
        --output shards/ --num-proc 8 [--shard-index 0 --num-shards 4] [--docs-per-shard 100000]

Work is cut into *units*: one local jsonl/parquet/.arrow file (or .txt file with
--txt-per-line), a group of --docs-per-shard .txt files (one document each), or a block of
--docs-per-shard rows of a hub dataset. A `datasets` `save_to_disk` folder is its .arrow
files, in its row order; a DatasetDict folder, those of its --split. Units are sorted; job i
of n takes units i, i+n, i+2n, ... Each unit writes parts of at most --docs-per-shard
documents, each document's ids followed by eos, named `<unit>-<part>` (unit: the input's path
below the common input folder):

- `--format shards` (default): `<name>.shard`, our zstd format (olmo_data.shards);
- `--format numpy`: OLMo-core's token files: `<name>.npy`, the headerless little-endian ids
  (uint16 if the vocab fits, else uint32: OLMo-core's own choice from the vocab size, from
  uint16 up), `<name>.csv.gz`, the `start,end` token offsets of every document, which
  OLMo-core reads for document boundaries where it does not scan the array (remote files,
  `use_array_if_local=False`), and `<name>.npy.json`, written last, what a re-run checks.

A part already present and complete (a shard with a valid manifest, or a .npy whose record
matches its size) for the same input and first document is skipped, so a killed run resumes
where it stopped.

--output (and --tokenizer) may be a ``gs://`` / ``s3://`` URL (`olmo_data.fileio`): each file
is written to a local temp file and uploaded once complete, so a killed job leaves no partial
object and the resume check works on the bucket as on a folder.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.fileio import StorageError
from olmo_data.shards import DEFAULT_CHUNK_TOKENS, SHARD_SUFFIX, ShardWriter, read_manifest
from olmo_data.text_inputs import Unit, documents, plan_units

__all__ = ["tokenize", "tokenize_main", "default_dtype"]

# Documents tokenized per encode_batch call: large enough to amortise the call.
_ENCODE_BATCH = 256
_NUMPY_RECORD = "olmo-data-tokenize-numpy"

Format = Literal["shards", "numpy"]


@dataclass(frozen=True)
class Options:
    tokenizer: str
    output: str
    format: Format
    text_field: str
    docs_per_shard: int
    dtype: str
    eos_token_id: int
    chunk_tokens: int
    hub_split: str


def default_dtype(vocab_size: int) -> str:
    """OLMo-core's rule (`NumpyDatasetConfig.get_dtype`): the smallest unsigned type that holds
    id vocab_size - 1, from uint16 up, since our readers store no uint8 (OLMo-core would infer
    uint8 for a vocab of <= 256 ids: give it dtype uint16 then)."""
    return "uint16" if vocab_size - 1 <= np.iinfo(np.uint16).max else "uint32"


def _part_path(unit: Unit, part: int, opts: Options) -> str:
    """The shard, or the .npy token file, of a unit's part."""
    suffix = SHARD_SUFFIX if opts.format == "shards" else ".npy"
    return fileio.join(opts.output, f"{unit.name}-{part:05d}{suffix}")


def _offsets_path(npy_path: str) -> str:
    """The .csv.gz beside a .npy, named as OLMo-core looks for it."""
    return npy_path[: -len(".npy")] + ".csv.gz"


def _finished(path: str, unit: Unit, first_doc: int, opts: Options) -> tuple[int, int] | None:
    """(docs, tokens) of a part an earlier run completed for this very unit and first
    document, or None if it must be written."""
    # exists() and reads raise on missing credentials, a missing bucket or a network failure,
    # so those stop the job here instead of passing for "not written yet".
    if opts.format == "numpy":
        if not all(fileio.exists(p) for p in (path + ".json", path, _offsets_path(path))):
            return None
        try:
            record = json.loads(fileio.read_text(path + ".json"))
            complete = (
                record.get("format") == _NUMPY_RECORD
                and record.get("unit") == unit.name
                and record.get("first_input_doc") == first_doc
                and record.get("dtype") == opts.dtype
                and record.get("eos_token_id") == opts.eos_token_id
                and fileio.size(path) == record["num_tokens"] * np.dtype(opts.dtype).itemsize
            )
            done = (int(record["num_docs"]), int(record["num_tokens"]))
        except StorageError:
            raise  # a DataError, hence a ValueError: not a damaged record
        except (ValueError, KeyError, TypeError, AttributeError):  # a damaged record
            return None
        return done if complete else None
    if not fileio.exists(path):
        return None
    try:
        manifest = read_manifest(path)
    except StorageError:
        raise  # cannot read the store: not evidence that the shard is unfinished
    except DataError:  # truncated, corrupt, or gone since exists()
        return None
    meta = manifest["metadata"]
    if meta.get("unit") == unit.name and meta.get("first_input_doc") == first_doc:
        return manifest["num_docs"], manifest["num_tokens"]
    return None


_TOKENIZER: Any = None


def _init_worker(tokenizer_path: str, quiet_threads: bool) -> None:
    global _TOKENIZER
    if quiet_threads:
        # N worker processes each spawning a Rust thread pool would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = _load_tokenizer(tokenizer_path)


def _load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(fileio.read_text(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise DataError(f"--tokenizer {path}: not a tokenizers JSON file ({e}); pass a tokenizer.json") from None


def _encoded(texts: list[str], opts: Options) -> Iterator[np.ndarray]:
    """Each text's ids followed by eos, as int64."""
    for b in range(0, len(texts), _ENCODE_BATCH):
        for enc in _TOKENIZER.encode_batch(texts[b : b + _ENCODE_BATCH], add_special_tokens=False):
            yield np.asarray(enc.ids + [opts.eos_token_id], dtype=np.int64)


def _write_shard(path: str, texts: list[str], unit: Unit, first_doc: int, opts: Options) -> int:
    tokens = 0
    with ShardWriter(
        path, opts.dtype, opts.chunk_tokens, metadata={"unit": unit.name, "first_input_doc": first_doc}
    ) as writer:
        for ids in _encoded(texts, opts):
            writer.add_document(ids)
            tokens += ids.size
    return tokens


def _write_numpy(path: str, texts: list[str], unit: Unit, first_doc: int, opts: Options) -> int:
    """The .npy token file, then its .csv.gz document offsets, then the record that marks the
    part complete (each atomic): a run killed in between rewrites the part."""
    dtype = np.dtype(opts.dtype).newbyteorder("<")
    ends: list[int] = []
    with fileio.AtomicWriter(path) as out:
        for ids in _encoded(texts, opts):
            if ids.max() > np.iinfo(dtype).max:  # leaving the block with it drops the temp file
                raise DataError(
                    f"{path}: token id {int(ids.max())} does not fit dtype {opts.dtype}; pass --dtype uint32"
                )
            out.file.write(ids.astype(dtype).tobytes())
            ends.append((ends[-1] if ends else 0) + ids.size)
    starts = [0, *ends[:-1]]
    offsets = "".join(f"{a},{b}\n" for a, b in zip(starts, ends)).encode()
    # mtime=0: the same documents give the same bytes, so re-runs and copies compare equal.
    fileio.write_bytes(_offsets_path(path), gzip.compress(offsets, mtime=0))
    record = {
        "format": _NUMPY_RECORD,
        "unit": unit.name,
        "first_input_doc": first_doc,
        "dtype": opts.dtype,
        "eos_token_id": opts.eos_token_id,
        "num_docs": len(ends),
        "num_tokens": ends[-1],
    }
    fileio.write_text(path + ".json", json.dumps(record, sort_keys=True))
    return ends[-1]


def _run_unit(args: tuple[Unit, Options]) -> dict[str, Any]:
    unit, opts = args
    stats: dict[str, Any] = {"docs": 0, "tokens": 0, "tokenized": 0, "written": 0, "skipped": 0, "files": []}
    part, first_doc = 0, 0
    texts: list[str] = []

    def flush() -> None:
        path = _part_path(unit, part, opts)
        done = _finished(path, unit, first_doc, opts)
        if done is not None:
            stats["docs"] += done[0]
            stats["tokens"] += done[1]
            stats["skipped"] += 1
            stats["files"].append(path)
            return
        kept = [t for t in texts if t]
        if not kept:
            return
        tokens = (_write_shard if opts.format == "shards" else _write_numpy)(path, kept, unit, first_doc, opts)
        stats["docs"] += len(kept)
        stats["tokens"] += tokens
        stats["tokenized"] += tokens
        stats["written"] += 1
        stats["files"].append(path)

    for text in documents(unit, opts.text_field, opts.hub_split):
        texts.append(text)
        if len(texts) == opts.docs_per_shard:
            flush()
            part, first_doc, texts = part + 1, first_doc + len(texts), []
    if texts:
        flush()
    return stats


def tokenize(
    input: str | Sequence[str],
    tokenizer: str,
    output: str,
    *,
    format: Format = "shards",
    text_field: str = "text",
    num_proc: int = 1,
    shard_index: int = 0,
    num_shards: int = 1,
    docs_per_shard: int = 100_000,
    dtype: Literal["uint16", "uint32"] | None = None,
    eos_token_id: int | None = None,
    txt_per_line: bool = False,
    split: str = "train",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize `input` (files, globs, folders, `datasets` folders, or one hub dataset name)
    into `output` (a folder or URL); the options are those of `olmo-data tokenize` (module
    docstring), `progress` shows its progress bar and summary table on stderr.

    Returns {units, docs, tokens, tokenized (new tokens), written, skipped (parts), seconds,
    dtype, eos_token_id, files (every part's .shard or .npy path, sorted)}. Bad input raises
    a one-line `DataError`."""
    from rich.console import Console

    inputs = [input] if isinstance(input, str) else [str(i) for i in input]
    if format not in ("shards", "numpy"):
        raise DataError(f"--format {format!r} is unknown; use shards (olmo-data) or numpy (OLMo-core token files)")
    if not 0 <= shard_index < num_shards:
        raise DataError(f"--shard-index {shard_index} is outside [0, --num-shards {num_shards})")
    if docs_per_shard <= 0 or num_proc <= 0:
        raise DataError("--docs-per-shard and --num-proc must be positive")
    opts = _options(tokenizer, output, format, text_field, docs_per_shard, dtype, eos_token_id, chunk_tokens, split)
    fileio.makedirs(output)
    units = plan_units(inputs, docs_per_shard, txt_per_line, split)[shard_index::num_shards]

    console = Console(stderr=True)
    t0 = time.perf_counter()
    totals = _run_units(units, opts, num_proc, console, progress)
    seconds = time.perf_counter() - t0
    if progress:
        title = f"olmo-data tokenize -> {output} (job {shard_index}/{num_shards}, {format})"
        _print_summary(console, title, len(units), totals, seconds)
    return {
        "units": len(units),
        **totals,
        "files": sorted(totals["files"]),
        "seconds": seconds,
        "dtype": opts.dtype,
        "eos_token_id": opts.eos_token_id,
    }


def _options(
    tokenizer: str,
    output: str,
    format: Format,
    text_field: str,
    docs_per_shard: int,
    dtype: str | None,
    eos_token_id: int | None,
    chunk_tokens: int,
    split: str,
) -> Options:
    """The workers' options, once the tokenizer is found and the output dtype and eos id are
    settled from it (the dtype that fits its vocab, its <|endoftext|> id) unless given."""
    if not fileio.isfile(tokenizer):
        raise DataError(f"--tokenizer {tokenizer}: file not found; pass a tokenizer.json")
    tok = _load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    chosen = dtype or default_dtype(vocab)
    if chosen == "uint16" and vocab > 1 << 16:
        raise DataError(f"--dtype uint16 cannot hold the {vocab} ids of {tokenizer}; use --dtype uint32")
    if eos_token_id is None:
        eos_token_id = tok.token_to_id("<|endoftext|>")
        if eos_token_id is None:
            raise DataError(f"{tokenizer}: no <|endoftext|> token; pass --eos-token-id")
    return Options(
        # absolute: workers may run elsewhere than the current folder (spawn)
        tokenizer=tokenizer if fileio.is_remote(tokenizer) else os.path.abspath(tokenizer),
        output=output,
        format=format,
        text_field=text_field,
        docs_per_shard=docs_per_shard,
        dtype=chosen,
        eos_token_id=eos_token_id,
        chunk_tokens=chunk_tokens,
        hub_split=split,
    )


def _run_units(units: list[Unit], opts: Options, num_proc: int, console: Any, progress: bool) -> dict[str, Any]:
    """Every unit tokenized, in this process or `num_proc` workers; the summed `_run_unit` stats."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    totals: dict[str, Any] = {"docs": 0, "tokens": 0, "tokenized": 0, "written": 0, "skipped": 0, "files": []}
    columns = (
        TextColumn("tokenize"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[docs]} docs"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False, disable=not progress) as bar:
        task = bar.add_task("units", total=len(units), docs=0)
        work = [(u, opts) for u in units]
        results: Iterator[dict[str, Any]]
        if num_proc == 1:
            _init_worker(opts.tokenizer, quiet_threads=False)
            results = map(_run_unit, work)
            pool = None
        else:
            # fork on Linux: a spawned worker re-imports olmo_data (grain included), ~2-10 s each.
            # Forking is safe here: the parent has not run a tokenizers thread pool (it only
            # read the vocab), and workers load their own tokenizer with threads off.
            method = "fork" if sys.platform == "linux" else "spawn"
            pool = multiprocessing.get_context(method).Pool(num_proc, _init_worker, (opts.tokenizer, True))
            results = pool.imap_unordered(_run_unit, work)
        try:
            for stats in results:
                for k in totals:
                    totals[k] += stats[k]
                bar.update(task, advance=1, docs=totals["docs"])
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    return totals


def _print_summary(console: Any, title: str, units: int, totals: dict[str, Any], seconds: float) -> None:
    """The command's summary table."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("units", "docs", "tokens", "parts written", "parts skipped", "seconds", "tokens/s (new)"):
        table.add_column(col, justify="right")
    table.add_row(
        str(units),
        f"{totals['docs']:,}",
        f"{totals['tokens']:,}",
        str(totals["written"]),
        str(totals["skipped"]),
        f"{seconds:.1f}",
        f"{totals['tokenized'] / max(seconds, 1e-9):,.0f}",
    )
    console.print(table)


def _parser() -> argparse.ArgumentParser:
    assert __doc__ is not None
    p = argparse.ArgumentParser(prog="olmo-data tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", nargs="+", required=True, help="files, globs, directories, datasets folders, or one hub dataset name"
    )
    p.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json (path or gs:// / s3:// URL)")
    p.add_argument("--output", required=True, help="folder for the output files (path or gs:// / s3:// URL)")
    p.add_argument(
        "--format",
        choices=["shards", "numpy"],
        default="shards",
        help="shards: olmo-data zstd shards; numpy: OLMo-core token files (.npy + .csv.gz)",
    )
    p.add_argument("--text-field", default="text", help="jsonl key / parquet, arrow or hub column of the text")
    p.add_argument("--num-proc", type=int, default=1, help="worker processes (units run in parallel)")
    p.add_argument("--shard-index", type=int, default=0, help="this job's index in [0, --num-shards)")
    p.add_argument("--num-shards", type=int, default=1, help="independent jobs the units are split over")
    p.add_argument("--docs-per-shard", type=int, default=100_000, help="most documents in one output file")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="default: uint16 if the vocab fits, else uint32")
    p.add_argument("--eos-token-id", type=int, help="default: the tokenizer's <|endoftext|> id")
    p.add_argument("--txt-per-line", action="store_true", help=".txt inputs hold one document per line")
    p.add_argument("--split", default="train", help="split of a hub dataset or of a DatasetDict folder")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per zstd chunk (shards)")
    return p


def tokenize_main(argv: list[str]) -> int:
    """Entry of `olmo-data tokenize` (the CLI prints its DataError as one line); returns 0."""
    args = _parser().parse_args(argv)
    tokenize(
        args.input,
        args.tokenizer,
        args.output,
        format=args.format,
        text_field=args.text_field,
        num_proc=args.num_proc,
        shard_index=args.shard_index,
        num_shards=args.num_shards,
        docs_per_shard=args.docs_per_shard,
        dtype=args.dtype,
        eos_token_id=args.eos_token_id,
        txt_per_line=args.txt_per_line,
        split=args.split,
        chunk_tokens=args.chunk_tokens,
        progress=True,
    )
    return 0
