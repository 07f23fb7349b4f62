"""olmo-convert: copy Olmo 3 weights between the HF layout, OLMo-core, and our two trainers.

    uv run --frozen olmo-convert SRC DST [--dtype float32|bfloat16] [--spec PRESET_OR_FILE] [--overwrite]

SRC and DST are ``hf:DIR``, ``olmo-core:PATH`` (.pt file or DCP dir), ``torch:DIR`` or
``jax:DIR`` (formats in tools/README.md); a ``torch:``/``jax:`` source may also be a trainer
checkpoint, ``RUN/checkpoints/latest`` or a run dir, local or on ``gs://`` / ``s3://``
(olmo_tools.remote; destinations are local). ``torch-run:RUN_OR_CHECKPOINT`` and
``jax-run:DIR`` on both sides convert a whole training state between the trainers
(olmo_tools.train_state); as a source for weights alone they read as ``torch:``/``jax:``. For example:

    uv run --frozen olmo-convert olmo-core:step1000/model.pt hf:out/olmo3-1b --spec olmo3-1b --dtype bfloat16
    uv run --frozen olmo-convert jax:runs/a hf:out/a        # a JAX run's latest checkpoint, with its tokenizer
    uv run --frozen olmo-convert hf:out/olmo3-1b jax:out/olmo3-1b-jax

With an MoE spec, olmo-core: is OLMo-core 3's OLMoDDP MoE model (olmo_tools.olmo_core_moe; its older
moe_reordered_norm model is read too), torch: and jax: hold our MoE models, and hf: is transformers'
OLMoE (olmo_tools.hf_olmoe) where OLMoE can express the spec, refused with the reason otherwise
(OLMo-core 3's MoE; tools/README.md says what exports where).

An hf: export also gets the tokenizer (``--tokenizer``, a trainer checkpoint's mixture, or an hf:
source's) and generation_config.json (olmo_tools.hf_tokenizer). Every tensor is checked against
the spec before anything is written; the result is built in a temporary sibling of DST and renamed
into place only when complete. Only jax: and jax-run: need JAX (the olmo-tools[jax] extra).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from olmo_data import DataError
from olmo_model import ModelSpec, hf_param_shapes
from olmo_model.presets import SpecError

from .checkpoint import Checkpoint, CheckpointError, Location, parse_location, require_jax
from .formats import DTYPES, atomic_destination, check_destination, open_checkpoint, write_hf, write_olmo_core
from .hf_tokenizer import ExportTokenizer, export_tokenizer
from .native import write_jax, write_torch


def convert(
    src: str,
    dst: str,
    *,
    dtype: torch.dtype | None = None,
    spec: str | ModelSpec | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: str | None = None,
) -> ModelSpec:
    """Convert SRC to DST (``KIND:PATH`` strings); ``dtype`` None keeps each tensor's stored dtype;
    ``tokenizer`` (a tokenizer.json or an HF tokenizer folder) is the one an hf: export gets.
    Returns the spec of the converted model (an hf: export's: with its special-token ids); raises
    CheckpointError on any bad input. ``torch-run:``/``jax-run:`` on both sides convert a whole
    training state (train_state.py); as a source of weights alone they read as torch:/jax:."""
    from .remote import fetch_source, refuse_remote_destination
    from .train_state import is_run_location

    refuse_remote_destination(dst)
    src = fetch_source(src)
    if is_run_location(dst):
        return _convert_run(src, dst, dtype=dtype, overwrite=overwrite, tokenizer=tokenizer)
    if is_run_location(src):
        kind, _, path = src.partition(":")
        src = f"{kind.removesuffix('-run')}:{path}"  # the weights of that training state
    src_loc, dst_loc = parse_location(src), parse_location(dst)
    if src_loc.path.absolute() == dst_loc.path.absolute():
        raise CheckpointError(f"{dst}: destination is the source; write to another path")
    if tokenizer is not None and dst_loc.kind != "hf":
        raise CheckpointError(f"{dst}: --tokenizer applies to hf: destinations only; {dst_loc.kind}: holds weights")
    check_destination(dst_loc.path, overwrite)
    if dst_loc.kind == "jax":
        require_jax(dst)
    with open_checkpoint(src_loc, spec) as ckpt:
        if dst_loc.kind == "hf" and ckpt.spec.moe is not None:
            _refuse_moe_hf(dst, ckpt.spec)
        export, why_none = export_tokenizer(ckpt, tokenizer) if dst_loc.kind == "hf" else (None, "")
        with atomic_destination(dst_loc.path, overwrite) as tmp:
            _write_weights(dst_loc, tmp, ckpt, dtype, export, max_shard_bytes)
        if dst_loc.kind == "hf" and export is None:
            print(
                f"olmo-convert: {dst} has no tokenizer: {why_none}; pass --tokenizer FILE_OR_DIR to add one",
                file=sys.stderr,
            )
        return ckpt.spec if export is None else export.spec


def _refuse_moe_hf(dst: str, spec: ModelSpec) -> None:
    """An MoE spec exports to hf: as transformers' OLMoE (olmo_tools.hf_olmoe) when OLMoE can express
    it: pre-norm, no shared expert, no restored weight scale, no embedding norm, heads of d_model /
    n_heads. OLMo-core 3's MoE is none of these; such a spec is refused with olmoe_config's reason."""
    from olmo_model.hf_moe import olmoe_config

    try:
        olmoe_config(spec)
    except SpecError as err:
        raise CheckpointError(
            f"{dst}: spec '{spec.name}' is MoE and hf: holds the dense Olmo3 layout ({err}) or an OLMoE model, "
            "which this spec is not; convert to olmo-core:, torch: or jax: instead"
        ) from None


def _convert_run(src: str, dst: str, *, dtype: torch.dtype | None, overwrite: bool, tokenizer: str | None) -> ModelSpec:
    """A whole training state from the run ``src`` to the run ``dst`` (olmo_tools.train_state)."""
    from .train_state import RUN_KINDS, convert_training_state, is_run_location

    if not is_run_location(src):
        raise CheckpointError(
            f"{dst}: a run is written from a training state (a {' or '.join(k + ':' for k in RUN_KINDS)} source), "
            f"and {src} holds weights only; to start a run from weights, set init.checkpoint in its recipe"
        )
    if dtype is not None:
        raise CheckpointError("--dtype does not apply to a training state: it stays float32 (master weights)")
    if tokenizer is not None:
        raise CheckpointError("--tokenizer applies to hf: destinations only; a run keeps its mixture's")
    return convert_training_state(src, dst, overwrite=overwrite)


def _write_weights(
    dst_loc: Location,
    tmp: Path,
    ckpt: Checkpoint,
    dtype: torch.dtype | None,
    export: ExportTokenizer | None,
    max_shard_bytes: int,
) -> None:
    """``ckpt``'s weights into ``tmp`` in the format of ``dst_loc`` (with the tokenizer ``export``
    for hf:), each tensor cast to ``dtype`` or kept as stored."""

    def dtype_of(name: str) -> torch.dtype:
        return dtype or ckpt.stored[name][1]

    if dst_loc.kind == "hf":
        write_hf(tmp, ckpt.spec if export is None else export.spec, ckpt.tensor, dtype_of, max_shard_bytes)
        if export is not None:
            export.write(tmp)
    elif dst_loc.kind == "olmo-core":
        write_olmo_core(tmp, ckpt, dtype_of, as_file=dst_loc.path.suffix == ".pt")
    elif dst_loc.kind == "torch":
        write_torch(tmp, ckpt, dtype_of)
    else:
        stored = {d for _, d in ckpt.stored.values()}
        keep_bf16 = dtype is None and stored == {torch.bfloat16}
        write_jax(tmp, ckpt, "bfloat16" if dtype == torch.bfloat16 or keep_bf16 else "float32")


def _size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="olmo-convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="hf:DIR | olmo-core:PATH | torch:DIR | jax:DIR | torch-run:RUN | jax-run:RUN")
    parser.add_argument(
        "dst",
        help="hf:DIR | olmo-core:PATH (.pt file, else a DCP dir) | torch:DIR | jax:DIR | torch-run:DIR | jax-run:DIR",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast every tensor (default: keep the stored dtype)")
    parser.add_argument("--spec", help="preset name or spec file; required for olmo-core sources, else checked")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing DST (only once the new one is complete)"
    )
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="hf: split safetensors above this size (GiB)")
    parser.add_argument(
        "--tokenizer",
        help="hf: the tokenizer.json or HF tokenizer folder to export with (default: a trainer checkpoint's "
        "mixture's, or an hf: source's)",
    )
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    start = time.perf_counter()
    try:
        spec = convert(
            args.src,
            args.dst,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            spec=args.spec,
            overwrite=args.overwrite,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            tokenizer=args.tokenizer,
        )
    except (CheckpointError, SpecError, DataError) as err:  # DataError: fileio's StorageError
        print(f"olmo-convert: error: {err}", file=sys.stderr)  # one line, never wrapped
        return 2
    dst = Path(args.dst.partition(":")[2])
    table = Table(title="olmo-convert", show_header=False)
    table.add_row("source", args.src)
    table.add_row("destination", args.dst)
    table.add_row("spec", f"{spec.name} ({sum(math.prod(s) for s in hf_param_shapes(spec).values()):,} parameters)")
    table.add_row("dtype", args.dtype or "as stored")
    table.add_row("size on disk", f"{_size_of(dst) / 2**20:,.1f} MiB")
    table.add_row("time", f"{time.perf_counter() - start:.1f} s")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
