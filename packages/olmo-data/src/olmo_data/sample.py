"""The embedded sample mixture: a small, deterministic, offline corpus every test and smoke
run can use, built from what ships with Python itself.

- "code": Python source files of the standard library (tests, generated tables and huge
  files skipped);
- "prose": documentation text of the standard library: the module, class and function
  docstrings (extracted with `ast`) of a *disjoint* set of stdlib modules, and the
  language-reference topics of `pydoc_data`.

A hash of each module's path sends it to code or to prose, so prose docstrings
are not copies of code we train on. Exact duplicate documents are removed; a hash of each
document's name puts ~3% of every source (at least ~25k tokens) into its held-out split, and held-out documents
sharing any 13-gram with the training sources are then dropped (decontamination), so the
sample passes the loader's leakage check. A byte-level BPE tokenizer (vocab 4096,
"<|endoftext|>" = 0 = eos, "<|pad|>" = 1) is trained on the training documents.

The build runs once per Python version into `$OLMO_CACHE/sample-v1/python-X.Y.Z` (default
cache `~/.cache/olmo-twin`), in a unique temp dir renamed into place, so concurrent
builders are safe; a cache whose build.json records another Python version or another
recipe (a hash of this module, shards.py and ngrams.py) is rebuilt. Build it (or print where it is) with:

    uv run --frozen olmo-data sample [--rebuild]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_data.errors import DataError
from olmo_data.ngrams import isin_sorted, ngram_hashes, unique_sorted
from olmo_data.shards import ShardWriter

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent builders then just race (safely)
    fcntl = None  # type: ignore[assignment]  # mypy types the name as the module, never None

SAMPLE_VERSION = "sample-v1"  # bump when the build recipe changes: old caches are then ignored
VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"  # id 0
PAD_TOKEN = "<|pad|>"  # id 1
SEQUENCE_LENGTH = 512
SEED = 1234
EVAL_SEQUENCES = 16
NGRAM = 13
HELD_OUT_PER_MILLE = 30  # ~3% of each source's documents are held out
# ~25k tokens of text: twice the EVAL_SEQUENCES x SEQUENCE_LENGTH the eval set needs, so
# decontamination can cut some and the build still works on other Python versions.
HELD_OUT_MIN_CHARS = 96_000
MIN_FRAGMENT = 64  # shortest decontaminated held-out fragment worth keeping, in tokens
MAX_FILE_BYTES = 120_000  # larger stdlib files are mostly data tables (_pydecimal aside)
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
TRAIN_SHARDS = 2  # training shards per source, so the sample exercises multi-file sources


@dataclass(frozen=True)
class Document:
    name: str  # stable identity, e.g. "code:json/decoder.py"
    text: str


def cache_root() -> Path:
    return Path(os.environ.get("OLMO_CACHE") or Path.home() / ".cache" / "olmo-twin")


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def sample_dir() -> Path:
    return cache_root() / SAMPLE_VERSION / f"python-{python_version()}"


def _bucket(name: str, modulo: int) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % modulo


def _stdlib_modules() -> list[tuple[str, Path]]:
    """(relative path, path) of the stdlib .py files worth reading, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append((rel.as_posix(), path))
    return sorted(out)


def _docstrings(source: str) -> str:
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a few stdlib files are templates, not Python 3
        return ""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    parts = []
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc:
            title = getattr(node, "name", None)
            parts.append(f"{title}\n\n{doc}" if title else doc)
    return "\n\n".join(parts)


def collect_documents() -> dict[str, list[Document]]:
    """The sample's documents per source (before dedup and held-out split), in sorted order."""
    code, prose = [], []
    for rel, path in _stdlib_modules():
        # Half the modules give code, the other half prose (their docstrings), so no module
        # feeds both: ~4 MB of code, ~1.3 MB of prose.
        if rel.startswith("pydoc_data/"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if _bucket(rel, 2):
            code.append(Document(f"code:{rel}", text))
        else:
            doc = _docstrings(text)
            if len(doc) >= 200:
                prose.append(Document(f"prose:{rel}", doc))
    topics_file = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if topics_file.exists():
        tree = ast.parse(topics_file.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
                topics = ast.literal_eval(node.value)
                prose.extend(Document(f"prose:pydoc_data/topics.py:{k}", topics[k]) for k in sorted(topics))
    return {"code": code, "prose": prose}


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE with "<|endoftext|>" = 0 and "<|pad|>" = 1, deterministic for given texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if (
        tokenizer.get_vocab_size() != vocab_size
        or tokenizer.token_to_id(EOS_TOKEN) != 0
        or tokenizer.token_to_id(PAD_TOKEN) != 1
    ):
        raise DataError(
            f"sample tokenizer: got vocab {tokenizer.get_vocab_size()} (eos {tokenizer.token_to_id(EOS_TOKEN)}), "
            f"need {vocab_size} with eos 0 and pad 1; train on more text"
        )
    return tokenizer


def _dedup(sources: dict[str, list[Document]]) -> dict[str, list[Document]]:
    """Drop exact duplicate texts across all sources, keeping the first in source order."""
    seen: set[bytes] = set()
    out = {}
    for name, docs in sources.items():
        kept = []
        for doc in docs:
            key = hashlib.sha256(doc.text.encode()).digest()
            if key not in seen:
                seen.add(key)
                kept.append(doc)
        out[name] = kept
    return out


def _split_held_out(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(training, held-out): held-out are the first documents in the order of a hash of
    their names, enough to be HELD_OUT_PER_MILLE of the documents and HELD_OUT_MIN_CHARS of text."""
    ranked = sorted(docs, key=lambda d: hashlib.sha256(b"held-out:" + d.name.encode()).digest())
    count, chars = 0, 0
    while count < len(ranked) and (count * 1000 < HELD_OUT_PER_MILLE * len(ranked) or chars < HELD_OUT_MIN_CHARS):
        chars += len(ranked[count].text)
        count += 1
    held = {d.name for d in ranked[:count]}
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


def _mixture_yaml(fingerprint: str) -> str:
    return f"""\
# The embedded olmo-data sample (built by olmo_data.sample; do not edit, it is rebuilt when stale).
# python_version: {python_version()}
# content_fingerprint: {fingerprint}
name: sample
sequence_length: {SEQUENCE_LENGTH}
seed: {SEED}
eos_token_id: 0
vocab_size: {VOCAB_SIZE}
tokenizer: tokenizer.json
sources:
  - name: code
    paths: ["code/*.shard"]
    format: shards
    ratio: 0.5
  - name: prose
    paths: ["prose/*.shard"]
    format: shards
    ratio: 0.5
held_out:
  - name: code
    paths: ["heldout/code/*.shard"]
    format: shards
  - name: prose
    paths: ["heldout/prose/*.shard"]
    format: shards
eval:
  sequences_per_source: {EVAL_SEQUENCES}
leakage:
  ngram: {NGRAM}
  max_doc_overlap_fraction: 0.0
"""


def content_fingerprint(root: Path) -> str:
    """sha256 over the relative path and bytes of every shard and the tokenizer."""
    h = hashlib.sha256()
    for path in sorted([root / "tokenizer.json", *root.rglob("*.shard")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return "sha256:" + h.hexdigest()


def _clean_fragments(doc: np.ndarray, train_hashes: np.ndarray) -> list[np.ndarray]:
    """The parts of a held-out document that share no NGRAM-gram with training, each
    eos-terminated and at least MIN_FRAGMENT tokens long.

    Code shares boilerplate 13-grams (imports, `def __init__(self`) with almost every other
    file, so dropping whole documents would leave no held-out code; instead every token
    covered by a training n-gram is cut out and the clean runs between them are kept.
    """
    body = doc[:-1]  # without its eos, re-added to each fragment
    hit = isin_sorted(ngram_hashes(body, NGRAM), train_hashes)
    # Token j is covered when a hit window starts in (j - NGRAM, j]: a prefix-sum of hits.
    starts = np.concatenate([[0], np.cumsum(hit)])
    j = np.arange(body.size)
    covered = starts[np.minimum(j + 1, hit.size)] - starts[np.clip(j - NGRAM + 1, 0, hit.size)] > 0
    edges = np.flatnonzero(np.diff(np.concatenate([[True], covered, [True]]).astype(np.int8)))
    fragments = []
    for lo, hi in zip(edges[::2], edges[1::2]):
        frag = np.append(body[lo:hi], doc[-1]).astype(doc.dtype)
        # The re-added eos makes new windows; keep the fragment only if those are clean too.
        if frag.size >= MIN_FRAGMENT and not isin_sorted(ngram_hashes(frag, NGRAM), train_hashes).any():
            fragments.append(frag)
    return fragments


def _write_shards(directory: Path, name: str, docs: list[np.ndarray], parts: int) -> None:
    bounds = np.linspace(0, len(docs), parts + 1).astype(int)
    for part in range(parts):
        with ShardWriter(directory / f"{name}-{part:05d}.shard", "uint16", metadata={"source": name}) as w:
            for doc in docs[bounds[part] : bounds[part + 1]]:
                w.add_document(doc)


def build_sample(target: Path) -> dict:
    """Build the sample into the empty directory `target`; returns the build record."""
    t0 = time.perf_counter()
    sources = _dedup(collect_documents())
    split = {name: _split_held_out(docs) for name, docs in sources.items()}
    tokenizer = train_tokenizer([d.text for train, _ in split.values() for d in train])

    def encode(docs: list[Document]) -> list[np.ndarray]:
        return [np.array(e.ids + [0], dtype=np.uint16) for e in tokenizer.encode_batch([d.text for d in docs])]

    train_tokens = {name: encode(train) for name, (train, _) in split.items()}
    # The leakage check hashes the training token stream, windows across document ends
    # included, so hash the same stream here.
    train_hashes = unique_sorted(
        np.concatenate([ngram_hashes(np.concatenate(t), NGRAM) for t in train_tokens.values()])
    )
    record: dict = {
        "version": SAMPLE_VERSION,
        "python_version": python_version(),
        "recipe": recipe_hash(),
        "sources": {},
    }
    for name, (train, held) in split.items():
        held_tokens = encode(held)
        clean = [f for t in held_tokens for f in _clean_fragments(t, train_hashes)]
        held_total = sum(t.size for t in clean)
        if held_total < EVAL_SEQUENCES * SEQUENCE_LENGTH:
            raise DataError(
                f"sample: held-out {name} keeps {held_total} tokens after decontamination, fewer than "
                f"{EVAL_SEQUENCES}x{SEQUENCE_LENGTH}; raise HELD_OUT_MIN_CHARS in olmo_data/sample.py"
            )
        _write_shards(target / name, name, train_tokens[name], TRAIN_SHARDS)
        _write_shards(target / "heldout" / name, name, clean, 1)
        record["sources"][name] = {
            "train_docs": len(train),
            "train_tokens": int(sum(t.size for t in train_tokens[name])),
            "held_out_fragments": len(clean),
            "held_out_tokens": int(held_total),
            "held_out_source_docs": len(held_tokens),
            "held_out_tokens_dropped_by_decontamination": int(sum(t.size for t in held_tokens) - held_total),
        }
    tokenizer.save(str(target / "tokenizer.json"))
    fingerprint = content_fingerprint(target)
    (target / "mixture.yaml").write_text(_mixture_yaml(fingerprint))
    record["content_fingerprint"] = fingerprint
    record["build_seconds"] = round(time.perf_counter() - t0, 2)
    (target / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    return record


def recipe_hash() -> str:
    """sha256 of the code that decides the sample's bytes: a cache built by other code is stale."""
    h = hashlib.sha256()
    for module in ("sample.py", "shards.py", "ngrams.py"):
        h.update((Path(__file__).parent / module).read_bytes())
    return h.hexdigest()


def _is_current(directory: Path) -> bool:
    try:
        record = json.loads((directory / "build.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return (
        (directory / "mixture.yaml").exists()
        and record.get("version") == SAMPLE_VERSION
        and record.get("python_version") == python_version()
        and record.get("recipe") == recipe_hash()
    )


def sample_mixture_path(rebuild: bool = False) -> Path:
    """Path of the sample mixture YAML, building the sample first if it is not cached."""
    final = sample_dir()
    if not rebuild and _is_current(final):
        return final / "mixture.yaml"
    final.parent.mkdir(parents=True, exist_ok=True)
    # Parallel test workers would each spend ~40 s of CPU on the same build: the first one
    # builds, the others wait on this lock and then find it current. The temp dir + rename
    # below keeps the cache consistent even where the lock is advisory or absent.
    with open(final.parent / ".lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not rebuild and _is_current(final):
            return final / "mixture.yaml"
        _build_into(final, rebuild)
    return final / "mixture.yaml"


def _build_into(final: Path, rebuild: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build_sample(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        if final.exists() and (rebuild or not _is_current(final)):
            # Move the stale copy aside first: rename cannot replace a non-empty directory.
            stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=final.parent))
            try:
                os.rename(final, stale / "old")
            except FileNotFoundError:
                pass  # another builder moved it already
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first: its build is the same, use it.
            if not _is_current(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sample_main(argv: list[str]) -> int:
    """Entry of `olmo-data sample`: build the sample if needed, print its mixture path."""
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        prog="olmo-data sample", description="Build (once) and locate the embedded sample."
    )
    parser.add_argument("--rebuild", action="store_true", help="build again even if a current cache exists")
    args = parser.parse_args(argv)
    path = sample_mixture_path(rebuild=args.rebuild)
    record = json.loads((path.parent / "build.json").read_text())
    table = Table(
        title=f"olmo-data sample ({record['content_fingerprint'][:19]}..., built in {record['build_seconds']} s)"
    )
    for col in (
        "source",
        "train docs",
        "train tokens",
        "held-out fragments",
        "held-out tokens",
        "tokens cut (13-gram)",
    ):
        table.add_column(col, justify="right")
    for name, s in record["sources"].items():
        table.add_row(
            name,
            f"{s['train_docs']:,}",
            f"{s['train_tokens']:,}",
            f"{s['held_out_fragments']:,}",
            f"{s['held_out_tokens']:,}",
            f"{s['held_out_tokens_dropped_by_decontamination']:,}",
        )
    Console(stderr=True).print(table)
    print(path)
    return 0
