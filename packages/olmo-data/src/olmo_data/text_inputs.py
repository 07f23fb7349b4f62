"""The text `olmo-data tokenize` reads, cut into units: local jsonl / parquet / txt files, HF
`datasets` folders and .arrow files, or a HF hub dataset (the units are described in
`olmo_data.tokenize`).

- `plan_units(...)`: every unit of the inputs, in a deterministic order;
- `documents(unit, text_field, hub_split)`: a unit's document texts, in file order.

Bad input (no such file, a missing column, invalid JSON, a missing reader) raises a one-line
`DataError` naming the file and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmo_data.errors import DataError

__all__ = ["Unit", "plan_units", "documents"]

_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
_TEXT_SUFFIXES = (*_JSON_SUFFIXES, ".parquet", ".arrow", ".txt")
# What `datasets` writes beside its .arrow files: a folder holding these is read as a dataset,
# never as loose json inputs.
_DATASET_STATE, _DATASET_DICT = "state.json", "dataset_dict.json"
# The install line every error about a missing reader names.
_EXTRA = "install the tokenize extra: pip install 'olmo-data[tokenize]' (in this workspace: uv sync --extra tokenize)"


@dataclass(frozen=True)
class Unit:
    """One independent piece of input: `kind` is jsonl|parquet|arrow|txt-lines|txt-files|hub."""

    name: str  # output file stem, unique among units
    kind: str
    paths: tuple[str, ...] = ()
    start: int = 0  # hub: first row
    stop: int = 0  # hub: one past the last row


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


def _texts_of(table: Any, path: str, text_field: str) -> list[Any]:
    """The text column of a pyarrow Table or RecordBatch, checked to exist and to hold strings."""
    import pyarrow

    if text_field not in table.schema.names:
        raise DataError(f"{path}: no column {text_field!r} (has {table.schema.names}); pass --text-field NAME")
    column = table.column(text_field)
    if not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type)):
        raise DataError(
            f"{path}: column {text_field!r} holds {column.type}, not text; pass --text-field NAME of a string column"
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


def documents(unit: Unit, text_field: str, hub_split: str) -> Iterator[str]:
    """The unit's document texts, in file order."""
    if unit.kind == "jsonl":
        with _open_text(unit.paths[0]) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    yield record[text_field]
                except json.JSONDecodeError as e:
                    raise DataError(f"{unit.paths[0]}:{line_no}: invalid JSON ({e}); fix or drop the line") from None
                except (KeyError, TypeError):
                    raise DataError(
                        f"{unit.paths[0]}:{line_no}: no field {text_field!r}; pass --text-field NAME"
                    ) from None
    elif unit.kind == "parquet":
        pa = _pyarrow(unit.paths[0], "parquet")
        yield from _texts_of(pa.parquet.read_table(unit.paths[0]), unit.paths[0], text_field)
    elif unit.kind == "arrow":
        for batch in _arrow_batches(unit.paths[0]):
            yield from _texts_of(batch, unit.paths[0], text_field)
    elif unit.kind == "txt-lines":
        with open(unit.paths[0], encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f)
    elif unit.kind == "txt-files":
        for path in unit.paths:
            yield Path(path).read_text(encoding="utf-8")
    else:
        rows = _load_hub(unit.paths[0], hub_split).select(range(unit.start, unit.stop))
        for row in rows:
            yield row[text_field]
