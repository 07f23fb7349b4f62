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
import io
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.fileio import StorageError
from olmo_data.shards import DEFAULT_CHUNK_TOKENS, SHARD_SUFFIX, ShardWriter, read_manifest

__all__ = ["tokenize", "tokenize_main", "default_dtype", "plan_units"]

_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
_TEXT_SUFFIXES = (*_JSON_SUFFIXES, ".parquet", ".arrow", ".txt")
# What `datasets` writes beside its .arrow files: a folder holding these is read as a dataset,
# never as loose json inputs.
_DATASET_STATE, _DATASET_DICT = "state.json", "dataset_dict.json"
# Documents tokenized per encode_batch call: large enough to amortise the call.
_ENCODE_BATCH = 256
# The install line every error about a missing reader names.
_EXTRA = "install the tokenize extra: pip install 'olmo-data[tokenize]' (in this workspace: uv sync --extra tokenize)"
_NUMPY_RECORD = "olmo-data-tokenize-numpy"

Format = Literal["shards", "numpy"]


@dataclass(frozen=True)
class Unit:
    """One independent piece of input: `kind` is jsonl|parquet|arrow|txt-lines|txt-files|hub."""

    name: str  # output file stem, unique among units
    kind: str
    paths: tuple[str, ...] = ()
    start: int = 0  # hub: first row
    stop: int = 0  # hub: one past the last row


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


def _kind_of(path: str, txt_per_line: bool) -> str:
    if path.endswith(_JSON_SUFFIXES):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".arrow"):
        return "arrow"
    if path.endswith(".txt"):
        return "txt-lines" if txt_per_line else "txt-files"
    raise DataError(f"{path}: unsupported input type; use one of {', '.join(_TEXT_SUFFIXES)} or a hub dataset name")


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e}); re-save the dataset with save_to_disk") from None


def _dataset_files(folder: str, split: str) -> list[str] | None:
    """The .arrow files of a HF `datasets` save_to_disk folder in its row order, or None if
    `folder` is not one. A DatasetDict folder gives those of its split `split`."""
    if os.path.isfile(os.path.join(folder, _DATASET_DICT)):
        record = _read_json(os.path.join(folder, _DATASET_DICT))
        splits = record.get("splits", []) if isinstance(record, dict) else []
        if split not in splits:
            raise DataError(
                f"--input {folder}: this DatasetDict has no split {split!r} (has {splits}); pass --split NAME"
            )
        folder = os.path.join(folder, split)
        if not os.path.isfile(os.path.join(folder, _DATASET_STATE)):
            raise DataError(f"--input {folder}: split folder without {_DATASET_STATE}; re-save it with save_to_disk")
    state_path = os.path.join(folder, _DATASET_STATE)
    if not os.path.isfile(state_path):
        return None
    state = _read_json(state_path)
    try:
        files = [os.path.join(folder, item["filename"]) for item in state["_data_files"]]
    except (KeyError, TypeError):
        raise DataError(f"{state_path}: no _data_files list, so not a datasets save_to_disk folder") from None
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"{state_path}: lists {os.path.basename(f)}, which is missing; re-save the dataset")
    return files


def _is_dataset_folder(folder: Path) -> bool:
    """What save_to_disk leaves: a DatasetDict's dataset_dict.json, or a Dataset's state.json
    with its dataset_info.json (one state.json alone may be any program's)."""
    return (folder / _DATASET_DICT).is_file() or (
        (folder / _DATASET_STATE).is_file() and (folder / "dataset_info.json").is_file()
    )


def _local_files(inputs: list[str], split: str) -> list[str] | None:
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
            dataset = _dataset_files(item, split)
            if dataset is not None:
                files.update(dataset)
                continue
            found = [p for p in Path(item).rglob("*") if p.is_file()]
            nested = sorted({p.parent for p in found if _is_dataset_folder(p.parent)})
            if nested:
                # Its json would read as documents, and a DatasetDict's every split as training text.
                raise DataError(
                    f"--input {item}: holds a HF datasets folder, {nested[0]}; pass that folder as --input (with --split)"
                )
            files.update(str(p) for p in found if str(p).endswith(_TEXT_SUFFIXES))
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
    files = _local_files(inputs, hub_split)
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


def _pyarrow(path: str, what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading {what} needs pyarrow; {_EXTRA}, or convert it to jsonl") from None
    return pyarrow


def _texts_of(table: Any, path: str, opts: Options) -> list[Any]:
    """The text column of a pyarrow Table or RecordBatch, checked to exist and to hold strings."""
    import pyarrow

    if opts.text_field not in table.schema.names:
        raise DataError(f"{path}: no column {opts.text_field!r} (has {table.schema.names}); pass --text-field NAME")
    column = table.column(opts.text_field)
    if not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type)):
        raise DataError(
            f"{path}: column {opts.text_field!r} holds {column.type}, not text; pass --text-field NAME of a string column"
        )
    return column.to_pylist()


def _arrow_batches(path: str) -> Iterator[Any]:
    """Record batches of an Arrow IPC file: the stream format `datasets` writes, or the file
    format (which starts with ARROW1)."""
    pa = _pyarrow(path, ".arrow files")
    with pa.memory_map(path) as source:
        try:
            if source.read(6) == b"ARROW1":
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            else:
                source.seek(0)
                yield from pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not a readable Arrow IPC file ({str(e).splitlines()[0]}); re-save it") from None


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
        pa = _pyarrow(unit.paths[0], "parquet")
        yield from _texts_of(pa.parquet.read_table(unit.paths[0]), unit.paths[0], opts)
    elif unit.kind == "arrow":
        for batch in _arrow_batches(unit.paths[0]):
            yield from _texts_of(batch, unit.paths[0], opts)
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

    for text in _documents(unit, opts):
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    inputs = [input] if isinstance(input, str) else [str(i) for i in input]
    if format not in ("shards", "numpy"):
        raise DataError(f"--format {format!r} is unknown; use shards (olmo-data) or numpy (OLMo-core token files)")
    if not 0 <= shard_index < num_shards:
        raise DataError(f"--shard-index {shard_index} is outside [0, --num-shards {num_shards})")
    if docs_per_shard <= 0 or num_proc <= 0:
        raise DataError("--docs-per-shard and --num-proc must be positive")
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
    opts = Options(
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
    fileio.makedirs(output)
    units = plan_units(inputs, docs_per_shard, txt_per_line, split)[shard_index::num_shards]

    console = Console(stderr=True)
    totals: dict[str, Any] = {"docs": 0, "tokens": 0, "tokenized": 0, "written": 0, "skipped": 0, "files": []}
    t0 = time.perf_counter()
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
    seconds = time.perf_counter() - t0
    if progress:
        table = Table(title=f"olmo-data tokenize -> {output} (job {shard_index}/{num_shards}, {format})")
        for col in ("units", "docs", "tokens", "parts written", "parts skipped", "seconds", "tokens/s (new)"):
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
    return {
        "units": len(units),
        **totals,
        "files": sorted(totals["files"]),
        "seconds": seconds,
        "dtype": opts.dtype,
        "eos_token_id": eos_token_id,
    }


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
