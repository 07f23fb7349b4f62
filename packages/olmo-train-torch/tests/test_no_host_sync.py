"""No host synchronisation in a torch training step except where the driver reads (issue 36):
the real entry point in this process (driver, loop, callbacks, module), one process, fp32, on
the embedded sample mixture, dense (``tiny``) and MoE (``tiny-moe``), with ``log.every`` 3.

From the start of a non-log step's ``train_step`` to the start of the next step's, every
tensor-to-host read torch exposes to Python (``Tensor.item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__``, ``__float__``, ``__int__``, ``__index__``) raises and is noted; none may happen.
Two kinds of call are let through, reads of host tensors that cost no synchronisation:
torch.optim reading the step counts that AdamW keeps in host tensors when its update is not
fused (the CPU's foreach path; on CUDA the trainer's AdamW is fused and keeps them on the
device), and, with several processes, the sizes that ``all_gather_object`` reads for the
preemption check's agreement (over gloo: on GPUs the module gathers over a gloo group).

The numbers are today's (the design keeps them): a ``log.every`` 1 run's train lines equal,
bitwise, a reference that runs the same steps the way the trainer did before (each figure read
to the host and combined there, ``SpikeGuard.decide`` on the host), with the spike guard on and
an LR that makes it skip; and a ``log.every`` 3 run logs at steps 3 and 6 exactly the
``log.every`` 1 run's figures there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from ranks import start_ranks

from olmo_model.moe import MOE_KEYS
from olmo_run import read_inputs
from olmo_run.recipe import load_recipe
from olmo_run.spike_guard import SpikeGuard
from olmo_train_torch.cli import main
from olmo_train_torch.moe import aux_loss as moe_aux_loss
from olmo_train_torch.moe import merge_micro_steps, moe_metrics
from olmo_train_torch.parallelize import Distributed
from olmo_train_torch.step import accumulate_gradients, clip_gradients, grad_global_norm, make_optimizer, start_model
from olmo_train_torch.train import TorchTrainModule

# The fixture (one_torch_thread) lives in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAPPED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
STEPS = 6
# The model's figures of a train line (the rest are timing, memory and wall clock).
FIGURES = ("loss", "ce_loss", "z_loss", "grad_norm", "skipped")
# lr 0.3 with a hair-trigger guard (any value above the running mean after 2 accepted steps)
# skips some of the 6 steps on both models (checked below), so the device decision is exercised.
GUARD = ["--optim.lr=0.3", "--spike_guard.enabled=true", "--spike_guard.min_history=2", "--spike_guard.sigma=1e-6"]


def args(model: str, run_dir: Path, every: int, *extra: str) -> list[str]:
    return [
        f"--model={model}",
        "--train.sequence_length=64",
        "--train.global_batch_tokens=512",
        f"--train.steps={STEPS}",
        "--train.precision=fp32",
        f"--log.every={every}",
        f"--checkpoint.every={STEPS}",
        f"--eval.every={STEPS}",
        "--log.progress=false",
        "--torch.parallel=none",
        f"--run_dir={run_dir}",
        *extra,
    ]


def train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == "train"}


def host_side(tensor: torch.Tensor) -> bool:
    """A read of a host tensor that costs no synchronisation: AdamW's step count read by
    torch.optim, or the sizes of an object collective over gloo (the preemption check's
    agreement between processes, which goes over gloo on GPUs too)."""
    caller = sys._getframe(2).f_code.co_filename
    optim = tensor.dim() == 0 and "/torch/optim/" in caller
    return tensor.device.type == "cpu" and (optim or "/torch/distributed/distributed_c10d.py" in caller)


def install_traps(patch) -> list[str]:
    """Trap host reads on non-log steps (every step but multiples of 3), each trap set with
    ``patch(owner, name, value)``; the reads seen."""
    seen: list[str] = []
    armed = [False]
    for name in TRAPPED:
        original = getattr(torch.Tensor, name)

        def trap(self, *a, _name=name, _original=original, **k):
            if armed[0] and not host_side(self):
                seen.append(f"{_name} at {sys._getframe(1).f_code.co_filename}:{sys._getframe(1).f_lineno}")
                raise AssertionError(f"host read Tensor.{_name} on a non-log step")
            return _original(self, *a, **k)

        patch(torch.Tensor, name, trap)
    step = TorchTrainModule.train_step

    def marked(self, batch, n, lr, guard, metrics):
        armed[0] = n % 3 != 0
        return step(self, batch, n, lr, guard, metrics)

    patch(TorchTrainModule, "train_step", marked)
    return seen


@pytest.fixture
def trapped(monkeypatch):
    return install_traps(monkeypatch.setattr)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_non_log_steps_read_nothing_to_the_host(model, trapped, tmp_path):
    run_dir = tmp_path / "run"
    assert main(args(model, run_dir, 3, *GUARD)) == 0
    assert trapped == []
    assert sorted(train_lines(run_dir)) == [3, 6]


def _ep_rank(rank: int, port: int, run_dir: Path, out: Path) -> None:
    """One rank of the EP 2 run, as torchrun starts it; its trapped reads go to ``out``."""
    env = dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(env)
    seen = install_traps(setattr)
    ep = ["--torch.parallel=ddp", "--torch.expert_parallel=2", "--moe.capacity_factor=1.25"]
    code = main(args("tiny-moe", run_dir, 3, *ep))
    (out / f"rank{rank}.json").write_text(json.dumps({"code": code, "seen": seen}))


def test_expert_parallel_2_with_a_capacity_factor_reads_nothing_on_non_log_steps(tmp_path):
    """Two processes (gloo): expert parallelism needs a rank per expert shard. DDP over 2 ranks,
    the experts split over them, ``moe.capacity_factor`` 1.25 (static all-to-all splits)."""
    start_ranks(_ep_rank, 2, tmp_path / "run", tmp_path)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"code": 0, "seen": []}
    assert sorted(train_lines(tmp_path / "run")) == [3, 6]


def reference_lines(model: str, steps: int) -> dict[int, dict]:
    """The steps as the trainer ran them before: every figure read to the host and combined
    there in float64, the spike guard decided on the host, ``optimizer.step`` skipped."""
    recipe = load_recipe(None, args(model, Path("unused"), 1, *GUARD))
    inputs = read_inputs(recipe)
    spec, layout = inputs.spec, inputs.batch_layout(1)
    one = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)
    torch.manual_seed(recipe.train.seed)
    net = start_model(recipe, spec, one, None, None)
    optimizer = make_optimizer(net, recipe, one.device)
    guard = SpikeGuard.from_recipe(recipe)
    out = {}
    for s in range(1, steps + 1):
        batch = inputs.mixture.order.global_batch(s - 1, layout.global_batch)
        tensors = {k: torch.from_numpy(batch[k]).long() for k in ("input_ids", "labels", "doc_ids")}
        sums, n, terms = accumulate_gradients(net, tensors, layout=layout, d=one, spec=spec, recipe=recipe, step=s)
        ce, z = (sums / n).tolist()
        loss = ce + spec.z_loss_weight * z
        line = {}
        if terms:
            merged = merge_micro_steps(terms)
            assert spec.moe is not None
            loss += float(moe_aux_loss(merged, spec.moe, recipe.moe.routing))
            line = moe_metrics(merged, ep_size=1)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = grad_global_norm(params)
        skipped = guard.decide(s, loss, float(norm))
        if not skipped:
            if recipe.optim.grad_clip is not None:
                clip_gradients(params, recipe.optim.grad_clip, norm)
            for group in optimizer.param_groups:
                group["lr"] = recipe.schedule.lr(s, recipe.optim.lr, steps)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out[s] = dict(loss=loss, ce_loss=ce, z_loss=z, grad_norm=float(norm), skipped=skipped, **line)
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_train_lines_are_todays_numbers_whatever_log_every_is(model, tmp_path):
    keys = FIGURES + (MOE_KEYS if model == "tiny-moe" else ())
    assert main(args(model, tmp_path / "every1", 1, *GUARD)) == 0
    assert main(args(model, tmp_path / "every3", 3, *GUARD)) == 0
    every1, every3 = train_lines(tmp_path / "every1"), train_lines(tmp_path / "every3")
    want = reference_lines(model, STEPS)
    assert any(r["skipped"] for r in want.values()) and not all(r["skipped"] for r in want.values())
    for s, line in every1.items():
        assert {k: line[k] for k in keys} == {k: want[s][k] for k in keys}, s
    assert sorted(every3) == [3, 6]
    for s, line in every3.items():
        assert {k: line[k] for k in keys} == {k: every1[s][k] for k in keys}, s
