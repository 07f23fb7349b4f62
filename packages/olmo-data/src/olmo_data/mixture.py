"""Mixture files: the validated YAML schema, `load_mixture`, and the mixture fingerprint.

A mixture names the training sources (with a ratio or a token target each), the held-out
sources, the sequence length, seed, eos and vocab, and the eval/leakage settings (see the
package README for the full YAML). Paths are relative to the YAML's folder; a path (and the
YAML itself) may also be a ``gs://`` / ``s3://`` URL (`olmo_data.fileio`). Loading opens
every source, so a missing file, a wrong dtype, an id beyond the vocab, a source shorter
than one sequence or a held-out file that is also trained on fails at load time with a
one-line `DataError` naming the file, the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from olmo_data import fileio
from olmo_data.content_hash import content_sha256
from olmo_data.errors import DataError
from olmo_data.order import GlobalOrder, derive_key, largest_remainder
from olmo_data.sources import TokenSource, Windowing, num_windows, open_source, resolve_paths

SAMPLE = "sample"  # the mixture path that names the embedded sample (olmo_data.sample)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceConfig(_Strict):
    """One training source."""

    name: str
    paths: Annotated[list[str], Field(min_length=1)]  # files, globs or shard directories
    format: Literal["shards", "numpy"] = "shards"
    dtype: Literal["uint16", "uint32"] | None = None  # required for numpy; must match for shards
    ratio: Annotated[float, Field(ge=0)] | None = None  # share of training tokens (normalised)
    tokens: Annotated[int, Field(gt=0)] | None = None  # or: tokens per mixture epoch
    max_repetition: Annotated[float, Field(gt=0)] | None = None  # epochs of this source a run may read; None = no cap
    # concat: files sorted by path, one token stream, windows may cross file ends; olmo-core:
    # files in the order listed, each cut on its own, as OLMo-core's NumpyFSLDataset (numpy only)
    windowing: Windowing = "concat"

    @model_validator(mode="after")
    def _one_target(self) -> SourceConfig:
        if (self.ratio is None) == (self.tokens is None):
            raise ValueError(f"source {self.name!r}: give exactly one of ratio or tokens")
        if self.windowing == "olmo-core" and self.format != "numpy":
            raise ValueError(
                f"source {self.name!r}: windowing olmo-core reproduces OLMo-core over raw token files; "
                "set format: numpy (or drop windowing)"
            )
        return self


class HeldOutConfig(_Strict):
    """One evaluation-only source (never trained on)."""

    name: str
    paths: Annotated[list[str], Field(min_length=1)]
    format: Literal["shards", "numpy"] = "shards"
    dtype: Literal["uint16", "uint32"] | None = None


class EvalConfig(_Strict):
    sequences_per_source: Annotated[int, Field(ge=1)] = 16  # fixed evaluation set size per held-out source


class LeakageConfig(_Strict):
    ngram: Annotated[int, Field(ge=1)] = 13  # span length; 13-grams as in GPT-3's decontamination
    max_doc_overlap_fraction: Annotated[float, Field(ge=0, le=1)] = 0.0  # held-out docs allowed to hit training


class MixtureConfig(_Strict):
    name: str
    sequence_length: Annotated[int, Field(gt=0)]
    seed: int
    eos_token_id: Annotated[int, Field(ge=0)]
    vocab_size: Annotated[int, Field(gt=0)]
    tokenizer: str | None = None  # for humans and `olmo-data tokenize`; not part of the fingerprint
    sources: Annotated[list[SourceConfig], Field(min_length=1)]
    held_out: list[HeldOutConfig] = []
    eval: EvalConfig = EvalConfig()
    leakage: LeakageConfig = LeakageConfig()

    @model_validator(mode="after")
    def _consistent(self) -> MixtureConfig:
        for group, items in (("sources", self.sources), ("held_out", self.held_out)):
            names = [s.name for s in items]
            if len(set(names)) != len(names):
                raise ValueError(f"{group}: names must be unique, got {names}")
        by_ratio = [s.ratio is not None for s in self.sources]
        if any(by_ratio) and not all(by_ratio):
            raise ValueError("sources: give every source a ratio, or every source a tokens target, not a mix")
        if all(by_ratio) and sum(s.ratio for s in self.sources if s.ratio is not None) <= 0:
            raise ValueError("sources: all ratios are zero; give at least one source a ratio > 0")
        return self


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """Safe YAML that refuses a mapping key given twice: PyYAML keeps the last one silently, so a
    second `seed:` would change the data order without a word. (olmo_model.yamlfile does the same
    for recipes; the two packages do not depend on each other.)"""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a non-scalar key is refused by SafeLoader itself; `<<` merges may repeat
            key = self.construct_object(key_node)
            if key in first_line:
                raise _DuplicateKey(
                    None, None, f"key {key!r} is given twice (first on line {first_line[key] + 1})", key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _yaml_message(path: Path | str, err: yaml.YAMLError) -> str:
    """One line for a YAML error: the file, the line and column, what is wrong and the fix."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    if isinstance(err, _DuplicateKey):
        return f"{path}: {where}: {problem}; keep one of them"
    return f"{path}: not valid YAML{' at ' + where if where else ''} ({problem}); fix the file there"


def _windowing(src: SourceConfig | HeldOutConfig) -> Windowing:
    """Held-out sources are windowed as ours: their eval set never depends on OLMo-core's layout."""
    return src.windowing if isinstance(src, SourceConfig) else "concat"


def _validation_message(path: Path | str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if not loc:
            parts.append(e["msg"].removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key; remove it or fix its spelling")
        elif e["type"] == "missing":
            parts.append(f"{loc}: required field is missing; add it")
        else:
            parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return f"{path}: " + "; ".join(parts)


class Mixture:
    """A loaded, validated mixture with its sources opened (use `load_mixture`). `path` is
    the YAML's resolved local Path, or its URL; `root`, its folder, what source paths are
    relative to."""

    def __init__(self, config: MixtureConfig, path: Path | str) -> None:
        self.config = config
        self.path = path
        self.root: Path | str = fileio.dirname(path) if isinstance(path, str) else path.parent
        self.training_files = [self._resolve(s, f"sources.{i}") for i, s in enumerate(config.sources)]
        self.held_out_files = [self._resolve(h, f"held_out.{i}") for i, h in enumerate(config.held_out)]
        self.training_sources = [self._open(s, f) for s, f in zip(config.sources, self.training_files)]
        self.held_out_sources = {h.name: self._open(h, f) for h, f in zip(config.held_out, self.held_out_files)}
        self._identities: dict[int, tuple[TokenSource, list[dict[str, Any]]]] = {}
        self._check()

    def with_sequence_length(self, sequence_length: int) -> Mixture:
        """The same sources cut into windows of another length (a recipe's train.sequence_length,
        e.g. a long-context stage); the fingerprint changes with it, as the order does."""
        if sequence_length == self.config.sequence_length:
            return self
        return Mixture(self.config.model_copy(update={"sequence_length": sequence_length}), self.path)

    def _resolve(self, src: SourceConfig | HeldOutConfig, field: str) -> list[str]:
        try:
            return resolve_paths(
                [fileio.join(self.root, p) for p in src.paths], src.format, _windowing(src) == "olmo-core"
            )
        except DataError as e:
            # The same class: a caller can still tell a missing bucket from a missing file.
            raise type(e)(f"{self.path}: {field}.paths ({src.name}): {e}") from None

    def _open(self, src: SourceConfig | HeldOutConfig, files: list[str]) -> TokenSource:
        return open_source(
            files,
            src.format,
            dtype=src.dtype,
            eos_token_id=self.config.eos_token_id,
            vocab_size=self.config.vocab_size,
            windowing=_windowing(src),
        )

    def _check(self) -> None:
        seq = self.config.sequence_length

        def same(f: str) -> str:  # one name per file: symlinks resolved locally, URLs as normalized
            return f if fileio.is_remote(f) else os.path.realpath(f)

        trained = {same(f): s.name for s, files in zip(self.config.sources, self.training_files) for f in files}
        for h, files in zip(self.config.held_out, self.held_out_files):
            for f in files:
                if same(f) in trained:
                    raise DataError(
                        f"{self.path}: held_out {h.name!r} file {f} is also in training source "
                        f"{trained[same(f)]!r}; held-out data must never be trained on: remove it from one"
                    )
        named = [("sources", s.name, src) for s, src in zip(self.config.sources, self.training_sources)]
        named += [("held_out", n, src) for n, src in self.held_out_sources.items()]
        for group, name, src in named:
            if src.num_tokens < seq:
                raise DataError(
                    f"{self.path}: sequence_length {seq} is longer than {group} {name!r} ({src.path}: "
                    f"{src.num_tokens} tokens); lower sequence_length or add data"
                )
            if num_windows(src, seq) == 0:
                raise DataError(
                    f"{self.path}: sequence_length {seq} is longer than every file of {group} {name!r} "
                    f"({src.path}), and windowing olmo-core cuts each file on its own; lower sequence_length or add data"
                )
        for name, src in self.held_out_sources.items():
            if src.num_tokens // seq < self.config.eval.sequences_per_source:
                raise DataError(
                    f"{self.path}: eval.sequences_per_source {self.config.eval.sequences_per_source} exceeds the "
                    f"{src.num_tokens // seq} sequences of held_out {name!r} ({src.path}); lower it or add data"
                )

    @property
    def sequence_length(self) -> int:
        return self.config.sequence_length

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.config.sources]

    def num_instances(self) -> list[int]:
        """Windows of sequence_length tokens in each training source."""
        return [num_windows(src, self.sequence_length) for src in self.training_sources]

    def slots_per_epoch(self) -> list[int]:
        """Each training source's slots in one mixture epoch (see olmo_data.order)."""
        # Every source has a ratio or every one has tokens (MixtureConfig._consistent): the
        # `is not None` filters below only narrow the types, they drop nothing.
        if self.config.sources[0].ratio is not None:
            return largest_remainder(
                [s.ratio for s in self.config.sources if s.ratio is not None], sum(self.num_instances())
            )
        return [max(1, round(s.tokens / self.sequence_length)) for s in self.config.sources if s.tokens is not None]

    def max_instances(self) -> list[int | None]:
        """The stream length max_repetition allows each training source (None: unbounded)."""
        return [
            None if s.max_repetition is None else int(np.floor(s.max_repetition * n))
            for s, n in zip(self.config.sources, self.num_instances())
        ]

    def source_identity(self, source: TokenSource) -> list[dict[str, Any]]:
        """What identifies a source's files: name relative to the YAML's folder (a file that
        is not below it, such as a URL named by a local YAML, by its full path), size, token
        count, dtype, and their content: the manifest's chunk checksums for shards, the sha256
        of every byte for raw files (`content_sha256`: computed once, then cached by the file's
        stat or object version; the value never depends on mtimes or location). So a mixture
        folder copied to a bucket, YAML included, keeps its fingerprint. Computed once per
        source and mixture, so the eval set and the fingerprint agree for the life of the
        mixture."""
        memo = self._identities.get(id(source))
        if memo is not None and memo[0] is source:
            return memo[1]
        parts = getattr(source, "sources", [source])
        out = []
        for p in parts:
            item = {
                "file": fileio.relpath(p.path, self.root),
                "bytes": fileio.size(p.path),
                "tokens": int(p.num_tokens),
                "dtype": np.dtype(p.dtype).name,
            }
            manifest = getattr(p, "manifest", None)
            if manifest is not None:
                item["chunks"] = [c["sha256_compressed"] for c in manifest["chunks"]]
                item["doc_starts"] = manifest["doc_starts"]["sha256_compressed"]
            else:  # raw files carry no checksums: hash all of it, or a same-size edit goes unseen
                item["sha256"] = content_sha256(p.path)
            out.append(item)
        self._identities[id(source)] = (source, out)
        return out

    @cached_property
    def _fingerprint(self) -> str:
        config = self.config.model_dump(mode="json", exclude={"name", "seed", "tokenizer"})
        for source in config["sources"]:
            # windowing came after mixtures were in use: its default is left out, so every
            # mixture written before it keeps its fingerprint, hence its data order
            if source["windowing"] == "concat":
                del source["windowing"]
        identity = {
            "config": config,
            "sources": [self.source_identity(s) for s in self.training_sources],
            "held_out": [self.source_identity(s) for s in self.held_out_sources.values()],
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def fingerprint(self) -> str:
        """sha256 (hex) of the resolved config (name, seed and tokenizer excluded: the seed
        is kept beside it in loader state) and every source's identity."""
        return self._fingerprint

    @cached_property
    def order(self) -> GlobalOrder:
        """The global training order of this mixture and seed."""
        return GlobalOrder(
            self.training_sources,
            self.source_names,
            self.slots_per_epoch(),
            self.max_instances(),
            self.sequence_length,
            derive_key(self.fingerprint(), self.seed, "train-order"),
            vocab_size=self.config.vocab_size,
        )

    def __repr__(self) -> str:
        return f"Mixture({str(self.path)!r}, name={self.config.name!r}, fingerprint={self.fingerprint()[:12]})"


def load_mixture(path: str | os.PathLike) -> Mixture:
    """Load and validate a mixture YAML (a local path or a URL); the word "sample" names the
    embedded sample."""
    if str(path) == SAMPLE:
        from olmo_data.sample import sample_mixture_path

        path = sample_mixture_path()
    name = fileio.normalize(path)
    where: Path | str = name if fileio.is_remote(name) else Path(name)
    if isinstance(where, Path) and where.is_dir():
        inside = sorted(p.name for p in where.glob("*.y*ml"))[:3]
        hint = f" ({', '.join(inside)} there)" if inside else ""
        raise DataError(f"{where}: is a folder, not a mixture file; name the mixture YAML in it{hint}")
    try:
        data = fileio.read_bytes(where)
    except FileNotFoundError:
        raise DataError(f"{where}: mixture file not found; check the path (or use 'sample')") from None
    try:
        raw = yaml.load(data.decode("utf-8"), Loader=_UniqueKeys)
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); save the mixture as UTF-8 YAML"
        ) from None
    except yaml.YAMLError as e:
        raise DataError(_yaml_message(where, e)) from None
    if not isinstance(raw, dict):
        got = "nothing (an empty file)" if raw is None else f"a {type(raw).__name__}"
        raise DataError(f"{where}: a mixture must be a YAML mapping with name, sources, ...; got {got}; see the README")
    try:
        config = MixtureConfig.model_validate(raw)
    except ValidationError as e:
        raise DataError(_validation_message(where, e)) from None
    return Mixture(config, where if isinstance(where, str) else where.resolve())
