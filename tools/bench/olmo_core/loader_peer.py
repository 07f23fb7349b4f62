"""OLMo-core's numpy data loader timed over raw token files; prints one JSON line.

Runs inside the isolated OLMo-core env (never this workspace's: ai2-olmo-core pins torch
2.13). packages/olmo-data/bench/bench_loader.py starts it as

    uv run --isolated --no-project --python 3.11 --with ai2-olmo-core \
        python tools/bench/olmo_core/loader_peer.py --paths A.npy B.npy --dtype uint16 \
        --sequence-length 4096 --batch 64 --batches 40 --threads 2 --work-dir DIR

The loader is built the way an OLMo-core training script builds it:
``NumpyFSLDatasetConfig`` (the files concatenated and cut into fixed-length instances) and
``NumpyDataLoaderConfig`` (a seeded global shuffle of instances, ``global_batch_size`` in
tokens). Its natural setting for a 2-core host with no accelerator is in-process reading
(``num_workers=0``) with ``num_threads`` reader threads, which is what OLMo-core's own
iterator does when no worker processes are asked for. A batch counts as delivered when the
iterator hands out its collated ``input_ids`` tensor (batch x sequence_length, int64).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version

import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", required=True, help="raw headerless token files")
    parser.add_argument("--dtype", default="uint16", choices=("uint16", "uint32"))
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="sequences per global batch")
    parser.add_argument("--batches", type=int, default=40, help="timed batches after one warm-up batch")
    parser.add_argument("--threads", type=int, default=2, help="OLMo-core reader threads (num_workers=0)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--eos", type=int, default=0)
    parser.add_argument("--work-dir", required=True, help="where OLMo-core caches its shuffled indices")
    args = parser.parse_args()

    tokenizer = TokenizerConfig(vocab_size=args.vocab_size, eos_token_id=args.eos, pad_token_id=args.vocab_size - 1)
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer,
        paths=list(args.paths),
        dtype=args.dtype,
        sequence_length=args.sequence_length,
        work_dir=args.work_dir,
    ).build()
    t0 = time.perf_counter()
    loader = NumpyDataLoaderConfig(
        global_batch_size=args.batch * args.sequence_length,
        seed=0,
        num_workers=0,
        num_threads=args.threads,
        work_dir=args.work_dir,
        target_device_type="cpu",
    ).build(dataset)
    loader.reshuffle(epoch=1)
    setup_s = time.perf_counter() - t0
    if loader.total_batches < args.batches + 1:
        raise SystemExit(
            f"loader_peer: {loader.total_batches} batches in the files, {args.batches + 1} needed; "
            "write more tokens or time fewer batches"
        )
    batches = iter(loader)
    first = next(batches)["input_ids"]
    if tuple(first.shape) != (args.batch, args.sequence_length):
        raise SystemExit(
            f"loader_peer: batch shape {tuple(first.shape)}, expected ({args.batch}, {args.sequence_length})"
        )
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(batches)["input_ids"]
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "tokens_per_second": args.batches * args.batch * args.sequence_length / seconds,
                "setup_s": setup_s,
                "olmo_core": version("ai2-olmo-core"),
                "torch": torch.__version__,
                "num_workers": 0,
                "num_threads": args.threads,
                "instances": len(dataset),
            }
        )
    )


if __name__ == "__main__":
    main()
