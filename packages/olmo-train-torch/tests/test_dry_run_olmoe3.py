"""The torch dry run with expert parallelism (issue 35, Build 5) and the torch block counts
olmo-plan uses for OLMo-core 3's MoE models (``olmo_run.plan_moe``), against autograd's own record.

Expert parallelism with ``moe.capacity_factor`` runs the capacity rule's static E x B x C buffers
(``olmo_train_torch.capacity``): equal-split all-to-alls whose shapes follow from the recipe, so
the fake process group runs the step. Dropless expert parallelism is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from olmo_model import get_preset
from olmo_run.plan_moe import torch_block_values
from olmo_train_torch.cli import main
from olmo_train_torch.model import OlmoModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL_MOE = ["--model=small-moe-64", "--train.sequence_length=256", "--train.global_batch_tokens=2048"]


def test_expert_parallel_dry_run_keeps_e_over_ep_experts_outside_fsdp(capsys):
    """small-moe-64 (module doc of olmo-run's test_plan_moe: 1,443,968 dense and 6,291,456 routed
    parameters, 4 MoE layers) on 8 fake ranks at EP 8 with capacity factor 1.25: rank 0 holds
    1,443,968 / 8 = 180,496 dense parameters (FSDP2) and 6,291,456 / 8 = 786,432 expert ones
    (its 8 experts of every layer, outside the wrapper), fp32: 3,867,712 bytes, and the AdamW
    moments of both, 8 bytes each and a 4-byte step count per tensor."""
    capsys.readouterr()
    args = [*SMALL_MOE, "--torch.expert_parallel=8", "--moe.capacity_factor=1.25", "--dry-run", "--devices", "h100:8"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not dist.is_initialized()
    assert report["mesh"] == {"dp": 8, "edp": 1, "ep": 8}
    assert report["memory_bytes"]["params"] == 4 * (180_496 + 786_432) == 3_867_712
    # 63 tensors: embedding, head, final norm, and per layer q, k, v, o, four norms, the router,
    # the shared expert's three and the routed experts' three.
    assert report["memory_bytes"]["optimizer"] == 8 * (180_496 + 786_432) + 4 * (3 + 4 * 15) == 7_735_676


def test_dropless_expert_parallel_dry_run_is_one_line_naming_the_capacity_factor(capsys):
    capsys.readouterr()
    assert main([*SMALL_MOE, "--torch.expert_parallel=8", "--dry-run", "--devices", "h100:8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe.capacity_factor" in err[0] and "1.1875" in err[0]
    assert not dist.is_initialized()


def _saved_bytes_per_token(spec, layer: int, tokens: int) -> float:
    """Bytes autograd keeps for the backward of block ``layer`` (bf16 weights and input, fake
    tensors), per token: every saved tensor's storage once, the parameters left out."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the weights in bf16, as FSDP2 gathers them
    try:
        with torch.device("meta"):
            model = OlmoModel(spec)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            weights = {p.untyped_storage()._cdata for p in model.parameters()}
            x = torch.zeros((1, tokens, spec.d_model), requires_grad=True)
            rope = torch.zeros((tokens, spec.head_dim), dtype=torch.float32)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model.blocks[layer](x, rope, rope, None)
    finally:
        torch.set_default_dtype(previous)
    # The RoPE tables are the model's cache, not the block's (one fp32 head_dim row per token).
    return (sum(b for k, b in saved.items() if k not in weights) - tokens * spec.head_dim * 4) / tokens


@pytest.mark.parametrize("preset", ["olmoe3-t001", "olmoe3-u001"])
def test_plan_counts_of_a_torch_block_match_what_autograd_saves(preset):
    """olmo-plan's bf16-sized values per token of a dense leading block and an MoE block, x 2 bytes,
    against the bytes autograd saves for them; t001's expert width equals d_model, u001's does not
    (6144 vs 8192), so the d- and h-wide terms are told apart. Within 1%: the small fp32 and int64
    routing tensors (top-k ids and weights, sort orders: about 60 bytes per token) are not counted."""
    full = get_preset(preset)
    assert full.moe is not None
    moe_layers = [i for i in range(3) if full.is_moe_layer(i)]  # the dense leading blocks kept
    spec = full.replace(n_layers=3, moe={**full.moe.model_dump(), "layers": moe_layers})
    for layer in (0, 2):
        assert spec.is_moe_layer(layer) is (layer == 2)
        measured = _saved_bytes_per_token(spec, layer, tokens=1024)
        assert 2 * torch_block_values(spec, layer) == pytest.approx(measured, rel=0.01)


def test_olmoe3_blocks_dry_run_over_several_micro_steps(capsys):
    """tiny-olmoe3 (t001's block kinds: a dense leading block, peri-norm, per-head QK-norm) with two
    micro-steps of one sequence on 8 FSDP2 ranks: rank 0's parameters are its padded dim-0 shards
    of every tensor of the model (ceil(rows / 8) rows, fp32; the experts stacked [E, ...]) and AdamW
    keeps two moments of each and a 4-byte step count per tensor."""
    args = ["--model=tiny-olmoe3", "--train.sequence_length=256", "--train.global_batch_tokens=4096"]
    capsys.readouterr()
    assert main([*args, "--train.micro_batch_size=1", "--dry-run", "--devices", "h100:8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not dist.is_initialized()
    assert (report["per_device_batch"], report["accumulation_steps"]) == (1, 2)
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in OlmoModel(get_preset("tiny-olmoe3")).parameters()]
    params = sum(4 * math.ceil(s[0] / 8) * math.prod(s[1:]) for s in shapes)
    assert report["memory_bytes"]["params"] == params
    assert report["memory_bytes"]["optimizer"] == 2 * params + 4 * len(shapes)
