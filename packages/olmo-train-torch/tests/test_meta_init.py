"""The trainer's start-up (``step.start_model``: build on meta, parallelize, allocate and fill only
this rank's shards) on CPU with gloo:

- the full weights, gathered after start-up, are bit for bit those of one process (``initial_model``,
  itself checked against ``olmo_model.init``, whose own tests recompute the scheme from its parts)
  on 2 and 4 processes under FSDP2, HSDP, DDP (with activation checkpointing) and, for the MoE
  spec, expert parallelism (the dense parts under FSDP2 or DDP, EP=2 and EP=4);
- a rank allocates its shards only: after start-up its parameter storage is a quarter of the
  model on 4 ranks (FSDP2 pads nothing for olmo3-30m's shapes), and the process's peak memory
  grows during start-up by less than half the model (one full copy would be all of it);
- an HF init reads only the blocks a rank holds and gives the HF weights.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.distributed as dist
from ranks import start_ranks
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from olmo_model import hf_param_shapes
from olmo_model.init import init_values
from olmo_run.recipe import load_recipe
from olmo_train_torch.hf_adapter import SafetensorsBlocks, initial_model, to_hf
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh
from olmo_train_torch.step import start_model

SEED = 11
ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


def _layouts(world: int) -> list[list[str]]:
    dense, moe = ["--model=tiny"], ["--model=tiny-moe"]
    return [
        [*dense, "--torch.parallel=fsdp"],
        [*dense, "--torch.parallel=hsdp", "--torch.replicate=2"],
        [*dense, "--torch.parallel=ddp", "--torch.activation_checkpointing=true"],
        [*moe, "--torch.parallel=fsdp", "--torch.expert_parallel=2"],
        [*moe, "--torch.parallel=ddp", f"--torch.expert_parallel={world}"],
    ]


def _recipe(overrides: list[str]):
    return load_recipe(None, [*overrides, f"--train.seed={SEED}", "--train.precision=fp32"])


def _start(overrides: list[str], d: Distributed, **kw) -> torch.nn.Module:
    recipe = _recipe(overrides)
    mesh, experts = build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch)
    return start_model(recipe, recipe.model_spec(), d, mesh, experts, **kw)


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors under the plain module names (every rank takes part; rank 0 keeps them)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert got.keys() == want.keys(), (label, got.keys() ^ want.keys())
    for name, value in want.items():
        assert torch.equal(got[name], value), (label, name)


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage materialised on this rank (a shard's padded buffer included)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.untyped_storage().nbytes() for t in local if not t.is_meta)


def _connect(rank: int, world: int, port: int) -> Distributed:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return Distributed(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), initialized=True)


def _layout_worker(rank: int, port: int, world: int, tmp: str) -> None:
    d = _connect(rank, world, port)
    try:
        if world == 4:
            _check_memory(d)
        for overrides in _layouts(world):
            got = _gathered(_start(overrides, d))
            if rank == 0:
                spec = _recipe(overrides).model_spec()
                _assert_equal(got, initial_model(spec, seed=SEED).state_dict(), f"{world} ranks {overrides}")
        if world == 2:
            _check_hf_init(d, tmp)
    finally:
        dist.destroy_process_group()


def _peak_rss() -> int:
    """This process's peak resident bytes since the last ``_reset_peak_rss`` (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmHWM:")).split()[1])


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (proc(5))


def _check_memory(d: Distributed) -> None:
    """olmo3-30m (219 MB in fp32) under FSDP2 on 4 ranks: each rank allocates its quarter."""
    overrides = ["--model=olmo3-30m", "--torch.parallel=fsdp"]
    recipe = _recipe(overrides)
    full_bytes = 4 * sum(math.prod(s) for s in hf_param_shapes(recipe.model_spec()).values())
    mesh = build_mesh(d, recipe.torch)
    # A first start-up of a tiny model pages in the code and imports the modules the start-up
    # uses, which would count as resident memory of the measured one.
    _start(["--model=tiny", "--torch.parallel=fsdp"], d)
    _reset_peak_rss()
    before = _peak_rss()
    model = start_model(recipe, recipe.model_spec(), d, mesh, None)
    growth = _peak_rss() - before
    # Every dim 0 (100352, 256, 768) divides by 4: FSDP2's shards need no padding.
    assert _storage_bytes(model) == full_bytes // 4
    # The shards (55 MB) plus one parameter block computed at a time (the embedding's quarter:
    # 26 MB) and its float64 chunks: about 85 MB (measured: 77 MB); a full copy adds 219 MB.
    assert growth < full_bytes // 2, (growth, full_bytes)


def _check_hf_init(d: Distributed, tmp: str) -> None:
    """An HF folder (other weights than the seed's) as init on 2 ranks under FSDP2: each rank
    reads exactly its shards' elements, and the gathered model holds the HF tensors."""
    overrides = ["--model=tiny", "--torch.parallel=fsdp"]
    spec = _recipe(overrides).model_spec()
    source = initial_model(spec, seed=SEED + 1)
    files = [os.path.join(tmp, "model.safetensors")]
    if d.rank == 0:
        save_file({k: v.contiguous() for k, v in to_hf(source, spec).items()}, files[0])
    d.barrier()
    read: list[int] = []
    plain_call = SafetensorsBlocks.__call__

    def counting(self, name, region):
        block = plain_call(self, name, region)
        read.append(block.numel())
        return block

    SafetensorsBlocks.__call__ = counting  # this worker process only
    model = _start(overrides, d, hf_files=files)
    SafetensorsBlocks.__call__ = plain_call
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    assert sum(read) == local < sum(p.numel() for p in source.parameters())
    got = _gathered(model)
    if d.rank == 0:
        _assert_equal(got, source.state_dict(), "hf init")


def _spawn(world: int, tmp) -> None:
    start_ranks(_layout_worker, world, world, str(tmp))


def test_initial_model_holds_the_neutral_init():
    """One process: ``initial_model`` (and the start-up without a process group) hold exactly
    ``olmo_model.init``'s values under the HF names, experts stacked."""
    for name in ("tiny", "tiny-moe"):
        spec = load_recipe(None, [f"--model={name}"]).model_spec()
        model = initial_model(spec, seed=SEED)
        hf = to_hf(model, spec)
        for hf_name in hf_param_shapes(spec):
            assert np.array_equal(hf[hf_name].numpy(), init_values(spec, SEED, hf_name)), hf_name
        started = _start([f"--model={name}", "--torch.parallel=none"], ONE)
        assert not any(p.is_meta for p in started.parameters())
        _assert_equal(started.state_dict(), model.state_dict(), f"{name}, no process group")


def test_two_processes_start_with_one_process_weights(tmp_path):
    _spawn(2, tmp_path)


def test_four_processes_start_with_one_process_weights_and_allocate_their_shards(tmp_path):
    _spawn(4, tmp_path)
