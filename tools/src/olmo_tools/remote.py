"""olmo-convert sources on object storage: a trainer checkpoint named by a gs:// or s3:// URL.

``torch:URL``, ``jax:URL``, ``torch-run:URL`` and ``jax-run:URL`` name, as locally, a
checkpoint (``RUN/checkpoints/step_N``), ``RUN/checkpoints/latest`` or a run dir (its latest
complete checkpoint: one with meta.json). That checkpoint is found in the bucket (listing and
meta.json only), its objects are streamed to a local temporary folder (concurrently, each in
bounded memory; a conversion reads every tensor, so nothing is read twice), and the conversion
then runs on that copy exactly as on a local checkpoint, verifying every file against the
sha256 in meta.json: a damaged object and a damaged transfer are both caught there.

Destinations stay local: write the result, then upload it with the cloud's own tool.
Credentials and endpoints are the storage clients' own (``olmo_data.fileio``).
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_run.errors import TrainingStateError
from olmo_run.init_source import resolve_checkpoint
from olmo_run.run_dir import run_path

from .checkpoint import CheckpointError

TRAINER_KINDS = ("torch", "jax", "torch-run", "jax-run")
# Objects downloaded at once.
DOWNLOAD_THREADS = 8


def refuse_remote_destination(dst: str) -> None:
    kind, _, path = dst.partition(":")
    if fileio.is_remote(path):
        raise CheckpointError(
            f"{dst}: olmo-convert writes local destinations; write {kind}:LOCAL_DIR, then upload it "
            "(gcloud storage cp -r / aws s3 cp --recursive)"
        )


def fetch_source(src: str) -> str:
    """``src`` unchanged when local; for a trainer checkpoint on gs:// or s3://, the same kind
    naming a local copy of that checkpoint (removed when the process exits)."""
    kind, _, path = src.partition(":")
    if not fileio.is_remote(path):
        return src
    if kind not in TRAINER_KINDS:
        raise CheckpointError(
            f"{src}: only trainer checkpoints ({', '.join(k + ':' for k in TRAINER_KINDS)}) are read from gs:// or "
            f"s3://; download the {kind}: folder first and name the local copy"
        )
    url = run_path(path)
    assert isinstance(url, URLPath)
    try:
        _, ckpt = resolve_checkpoint(url)
    except TrainingStateError as err:
        raise CheckpointError(str(err)) from None
    assert isinstance(ckpt, URLPath)
    root = Path(tempfile.mkdtemp(prefix="olmo-convert-"))
    atexit.register(shutil.rmtree, root, True)
    local = root / "checkpoints" / ckpt.name
    names = fileio.find(str(ckpt))

    def get(name: str) -> int:
        target = local / URLPath(name).relative(ckpt)
        target.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with fileio.open_write(target) as out:
            for block in fileio.iter_blocks(name):
                out.write(block)
                size += len(block)
        return size

    with ThreadPoolExecutor(max_workers=DOWNLOAD_THREADS) as pool:
        total = sum(pool.map(get, names))
    print(f"olmo-convert: read {ckpt} ({len(names)} objects, {total / 2**20:,.1f} MiB)", file=sys.stderr, flush=True)
    return f"{kind}:{local}"
