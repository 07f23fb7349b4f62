"""``olmo-train-jax`` as a multi-process job: the trainer's own CLI, no wrapper, started as 2
processes x 4 simulated CPU devices on 127.0.0.1 (gloo collectives, JAX's default on CPU),
against the same job as 1 process x 8 devices.

- data 4 x fsdp 2, started with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID:
  every step's loss within the layout bound (``olmo_model.layout_loss_tolerance``) of the
  1-process run; process 1 SIGKILLed after the
  step-3 checkpoint: process 0 exits non-zero within 2 x jax.heartbeat_timeout_seconds (it
  aborts: neither process cleans up); relaunched, steps 4-6 are bitwise those of the
  uninterrupted 2-process run; the same checkpoint resumed on 1 process is within the bound;
- tensor 8 (the tensor axis spans both processes, so both read the same rows), started with
  the recipe keys jax.coordinator_address / num_processes / process_id, with 2 accumulation
  micro-steps: within the bound;
- tiny-moe with expert 8 (the all-to-all crosses processes), started by JAX's own Slurm
  detection from a Slurm-like environment (one task per "node"): within the bound, the same
  expert counts;
- a run dir process 1 does not see (a private mount namespace; a directory of its own where
  user namespaces are not available) is refused at start by both, with the documented line,
  and left as it was; so is a mixture that only process 1 cannot read.

Each process runs the trainer's own ``cli.main`` (what ``python -m olmo_train_jax`` runs), forked
from the fork server of tests/support/ranks.py (``start_forked``): JAX and the trainer
are imported there but no backend is started, so a process still takes its device count
(XLA_FLAGS), its JAX_* or Slurm variables and its recipe keys when the trainer starts JAX, without
paying the imports again. The run-dir test is the real launch: two ``python -m olmo_train_jax``
processes, process 1 in a mount namespace of its own.

The runs share the test session's persistent compilation cache (the root conftest.py): a
cached executable is the compiled program itself, so the bitwise comparison holds, and the runs
skip recompiling what an earlier one compiled. The mixture has no held-out source, so no run compiles an evaluation step.

    uv run --frozen pytest -q packages/olmo-train-jax/tests/test_multihost.py
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ranks import run_forked, start_forked
from test_train import _documents

from olmo_data import MixtureLoader, load_mixture
from olmo_model import layout_loss_tolerance
from olmo_run.checkpoints import complete_checkpoints
from olmo_run.metrics import read_metrics
from olmo_run.recipe import RecipeError, load_recipe
from olmo_run.startup import SHARED_CHECK_FILE, check_shared_run_dir
from olmo_train_jax import parallelize

STEPS = 6
CHECKPOINT = 3
HEARTBEAT = 10  # jax.heartbeat_timeout_seconds of every multi-process run here
TIMEOUT = 600  # per job: these runs take well under a minute each on a loaded 2-core machine
COMMON = [
    "--train.global_batch_tokens=1024",  # 16 sequences of 64 tokens
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    f"--checkpoint.every={CHECKPOINT}",
    "--log.progress=false",
    f"--jax.heartbeat_timeout_seconds={HEARTBEAT}",
]
# tiny with 8 heads, so that tensor 8 splits attention as well as the MLP and the vocabulary.
DENSE = ["--model.preset=tiny", "--model.n_heads=8", "--model.n_kv_heads=8", *COMMON]
MOE = ["--model=tiny-moe", "--moe.routing=uniform", *COMMON]
DP = ["--jax.mesh.data=4", "--jax.mesh.fsdp=2"]  # 2 sequences per device
TENSOR = ["--jax.mesh.data=1", "--jax.mesh.tensor=8", "--train.micro_batch_size=8"]  # 2 micro-steps of 8
EXPERT = ["--jax.mesh.data=1", "--jax.mesh.expert=8"]
REFUSED = "put the run dir on a shared file system every host mounts at the same path, or use a remote URL"


# ---- launching -----------------------------------------------------------------------------


def _clean_env(devices: int) -> dict[str, str]:
    """This machine's environment without any job it may itself run in (a CI job under Slurm),
    with ``devices`` simulated CPU devices (the session's compilation cache comes with it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "JAX_COORDINATOR", "JAX_NUM_", "JAX_PROCESS_", "JAX_LOCAL_"))
    }
    # This process's own XLA_FLAGS come along (a CPU code path chosen by flags: --xla_cpu_max_isa=AVX2).
    env.update(
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip(),
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_after_checkpoint() -> None:
    """Make this process SIGKILL itself as step CHECKPOINT + 1 starts, once process 0 has
    committed the step-CHECKPOINT checkpoint (it waits for it, so that checkpoint is complete):
    a host lost mid-run, with process 0 left waiting for it in that step's collectives."""
    from olmo_train_jax import train

    step = train.JaxTrainModule.train_step

    def die(self, local, n, lr, guard, metrics):
        if n == CHECKPOINT + 1:
            while CHECKPOINT not in [s for s, _ in complete_checkpoints(self.setup.run_dir)]:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, local, n, lr, guard, metrics)

    train.JaxTrainModule.train_step = die


def _trainer(argv: list[str], die: bool) -> int:
    """A forked process's program (``ranks.start_forked``): the trainer's own ``cli.main``,
    what ``python -m olmo_train_jax`` runs; with ``die``, after ``_die_after_checkpoint``."""
    import jax

    from olmo_train_jax.cli import main

    if die:
        _die_after_checkpoint()
    try:
        return main(argv)
    finally:
        # What JAX's atexit hook does at a real process's exit (a forked child leaves with
        # os._exit, past atexit): leave the job, so that no process sees the other's end as a
        # lost heartbeat.
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()


class Job:
    """Two processes of one job, started as ``how`` says: "env" (JAX_* variables), "keys" (the
    recipe keys) or "slurm" (a Slurm-like environment for JAX's own detection). Forked from the
    fork server, each with its own environment and running ``cli.main`` (what ``python -m
    olmo_train_jax`` runs, without paying the imports again); with ``launched`` two real
    ``python -m olmo_train_jax`` processes, and ``wrap`` prefixes a process's command line.
    ``die`` (forked): process 1 dies after the step-CHECKPOINT checkpoint (``_die_after_checkpoint``)."""

    def __init__(self, args, logs: Path, how="env", *, launched=False, die=False, wrap=None, extra=None):
        assert launched or not wrap, "a wrapper needs a real launch"
        port = _free_port()
        self.logs = [logs / f"process{i}.log" for i in range(2)]
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: list = []
        for i in range(2):
            env = _clean_env(4)
            keys: list[str] = []
            if how == "env":
                env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
            elif how == "keys":
                keys = [f"--jax.coordinator_address=127.0.0.1:{port}", "--jax.num_processes=2", f"--jax.process_id={i}"]
            else:  # two "nodes", both this host, one task each: srun --ntasks-per-node=1
                env.update(
                    SLURM_JOB_ID="4242",
                    SLURM_STEP_NODELIST="localhost",
                    SLURM_NTASKS="2",
                    SLURM_STEP_NUM_NODES="2",
                    SLURM_PROCID=str(i),
                    SLURM_LOCALID="0",
                    JAX_COORDINATOR_PORT=str(port),  # JAX's Slurm port is derived from the job id
                )
                keys = ["--jax.distributed=true"]
            argv = [*args, *keys, *(extra or {}).get(i, [])]
            if launched:
                cmd = [*(wrap or {}).get(i, []), sys.executable, "-m", "olmo_train_jax", *argv]
                with open(self.logs[i], "w") as log:
                    self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            else:
                self.procs.append(start_forked(_trainer, argv, die and i == 1, env=env, out=self.logs[i]))

    def wait(self, i: int) -> int:
        p = self.procs[i]
        if isinstance(p, subprocess.Popen):
            return p.wait(timeout=TIMEOUT)
        p.join(TIMEOUT)
        if p.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {i}", TIMEOUT)
        return p.exitcode

    def finish(self) -> list[int]:
        try:
            return [self.wait(i) for i in range(2)]
        finally:
            for p in self.procs:
                if (p.poll() if isinstance(p, subprocess.Popen) else p.exitcode) is None:
                    p.kill()

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- process {i}:\n" + self.log(i)[-2500:] for i in range(2))


def one_process(args: list[str], logs: Path) -> subprocess.CompletedProcess:
    """The same job as 1 process x 8 devices, forked like a Job's processes: the reference."""
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout.log", logs / "stderr.log"
    code = run_forked(_trainer, args, False, env=_clean_env(8), out=out, err=err, timeout=TIMEOUT)
    return subprocess.CompletedProcess(args, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def assert_close(want: dict[int, dict], got: dict[int, dict], steps) -> None:
    """Step s of two runs from the same initial weights (a resumed run's too: its checkpoint
    came from such a run) within ``layout_loss_tolerance`` of the step's 16 x 64 token losses
    (the reordered-sum bound at step 1, plus AdamW's measured drift envelope later); grad norms
    within 1e-3 relative, far below the factor a normalisation or reduction bug moves them by."""
    for s in steps:
        a, b = want[s], got[s]
        assert abs(a["loss"] - b["loss"]) <= layout_loss_tolerance(a["loss"], 16 * 64, s), (s, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (s, a["grad_norm"], b["grad_norm"])
    # The comparison means something only if training moves the loss far more than the bound.
    assert want[1]["loss"] - want[STEPS]["loss"] > 10 * layout_loss_tolerance(want[1]["loss"], 16 * 64, STEPS)


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    for name, n in (("train_a", 60_000), ("train_b", 30_000)):
        _documents(rng, n).tofile(root / f"{name}.bin")
    (root / "mixture.yaml").write_text(
        "name: multihost-test\nsequence_length: 64\nseed: 7\neos_token_id: 0\nvocab_size: 4096\n"
        "sources:\n"
        "  - {name: a, paths: [train_a.bin], format: numpy, dtype: uint16, ratio: 0.6}\n"
        "  - {name: b, paths: [train_b.bin], format: numpy, dtype: uint16, ratio: 0.4}\n"
    )
    return root / "mixture.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(mixture, runs) -> Path:
    run_dir = runs / "one-process"
    done = one_process([*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={run_dir}"], runs / "logs-one")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "process 0 of 1: local devices [0, 1, 2, 3, 4, 5, 6, 7]" in done.stdout
    return run_dir


@pytest.fixture(scope="module")
def two_processes(mixture, runs) -> tuple[Path, Job]:
    run_dir = runs / "two-processes"
    job = Job([*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={run_dir}"], runs / "logs-dp")
    assert job.finish() == [0, 0], job.tails()
    return run_dir, job


# ---- 2 x 4 against 1 x 8 -------------------------------------------------------------------


def test_data_fsdp_over_two_processes_follows_one_process(reference, two_processes):
    run_dir, job = two_processes
    want, got = records(reference), records(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_close(want, got, range(1, STEPS + 1))
    # Each process says where it is, and reads the rows of its own four data-parallel shards.
    mesh = "mesh data=4 x fsdp=2 x tensor=1 over 8 cpu device(s) in 2 process(es)"
    assert f"process 0 of 2: local devices [0, 1, 2, 3], reads data-parallel shard(s) [0, 1, 2, 3] of 8; {mesh}" in (
        job.log(0)
    )
    assert "process 1 of 2: local devices [2048, 2049, 2050, 2051], reads data-parallel shard(s) [4, 5, 6, 7]" in (
        job.log(1)
    )
    # Only process 0 speaks for the run.
    assert "# resolved recipe" in job.log(0) and "# resolved recipe" not in job.log(1)
    assert "step 1/" in job.log(0) and "step 1/" not in job.log(1)
    # The MFU peak was measured on a device each process can address.
    assert got[1]["mfu_peak"].startswith("measured cpu fp32 matmul")


def test_tensor_axis_across_processes_reads_the_same_rows_on_both(mixture, runs, reference):
    run_dir = runs / "tensor"
    job = Job([*DENSE, *TENSOR, f"--data.mixture={mixture}", f"--run_dir={run_dir}"], runs / "logs-tensor", "keys")
    assert job.finish() == [0, 0], job.tails()
    for i in range(2):  # one data-parallel shard, held by devices of both processes
        assert f"process {i} of 2:" in job.log(i) and "reads data-parallel shard(s) [0] of 1" in job.log(i)
    assert "global batch 16 = 8 per device x 1 data-parallel x 2 accumulation" in job.log(0)
    assert_close(records(reference), records(run_dir), range(1, STEPS + 1))


def test_expert_axis_across_processes_under_slurm_detection(mixture, runs):
    one, two = runs / "moe-one", runs / "moe-two"
    done = one_process([*MOE, *EXPERT, f"--data.mixture={mixture}", f"--run_dir={one}"], runs / "logs-moe-one")
    assert done.returncode == 0, done.stderr[-3000:]
    job = Job([*MOE, *EXPERT, f"--data.mixture={mixture}", f"--run_dir={two}"], runs / "logs-moe", "slurm")
    assert job.finish() == [0, 0], job.tails()
    assert "mesh data=1 x fsdp=1 x expert=8 x tensor=1 over 8 cpu device(s) in 2 process(es)" in job.log(1)
    want, got = records(one), records(two)
    assert_close(want, got, range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s]["moe_tokens_per_expert"] == want[s]["moe_tokens_per_expert"], s
        assert got[s]["moe_dropped_tokens"] == 0


# ---- failures ------------------------------------------------------------------------------


def test_a_process_killed_after_a_checkpoint_stops_the_other_then_both_resume(mixture, runs, reference, two_processes):
    straight, _ = two_processes
    run_dir, single = runs / "killed", runs / "killed-then-one-process"
    args = [*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    job = Job(args, runs / "logs-killed", die=True)
    assert job.wait(1) == -signal.SIGKILL, job.tails()
    died = time.monotonic()
    # Process 0 waits in the next step's collectives until the coordination service (which
    # process 0 hosts) misses process 1's heartbeats for jax.heartbeat_timeout_seconds, then
    # aborts; twice that leaves room for the heartbeat interval and a loaded machine.
    assert job.wait(0) != 0, job.tails()
    assert time.monotonic() - died <= 2 * HEARTBEAT, job.tails()
    assert "stopped sending heartbeats" in job.log(0)
    assert [s for s, _ in complete_checkpoints(run_dir)] == [CHECKPOINT]
    shutil.copytree(run_dir, single)

    again = Job(args, runs / "logs-relaunched")
    assert again.finish() == [0, 0], again.tails()
    assert "resumed from" in again.log(0)
    want, got = records(straight), records(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in range(CHECKPOINT + 1, STEPS + 1)] == [
        want[s]["loss"] for s in range(CHECKPOINT + 1, STEPS + 1)
    ]  # bitwise

    # The 2-process checkpoint on 1 process x 8 devices (the process count is no part of the state).
    done = one_process([*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={single}"], runs / "logs-killed-one")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    assert_close(records(reference), records(single), range(CHECKPOINT + 1, STEPS + 1))


def _private_mount_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_run_dir_the_other_process_cannot_see_is_refused_at_start(mixture, runs):
    hosts = runs / "own-disks"
    hosts.mkdir()
    run_dir = hosts / "run"
    args = [*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    if _private_mount_works():
        # Process 1 sees the same path on a disk of its own, as on a TPU pod's hosts.
        mount = f'mount -t tmpfs tmpfs "{hosts}" && exec "$0" "$@"'
        job = Job(args, runs / "logs-own-disks", launched=True, wrap={1: ["unshare", "-rm", "sh", "-c", mount]})
    else:
        own = runs / "own-disk-1" / "run"
        job = Job(args, runs / "logs-own-disks", launched=True, extra={1: [f"--run_dir={own}"]})
    assert job.finish() == [2, 2], job.tails()
    for i in range(2):
        lines = [line for line in job.log(i).splitlines() if line.startswith("olmo-train-jax: error:")]
        assert len(lines) == 1 and "process(es) [1] of 2 do not see the files process 0 writes" in lines[0]
        assert REFUSED in lines[0]
    assert not run_dir.exists()  # the check created it for its marker, and removed both


def test_input_only_one_process_cannot_read_stops_both_before_writing(mixture, runs):
    run_dir = runs / "bad-on-one"
    args = [*DENSE, *DP, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    job = Job(args, runs / "logs-bad-on-one", extra={1: [f"--data.mixture={runs / 'missing.yaml'}"]})
    assert job.finish() == [2, 2], job.tails()
    assert "olmo-train-jax: error: process(es) [1] of 2 stopped at start-up" in job.log(0)
    assert "missing.yaml: mixture file not found" in job.log(1)
    assert not run_dir.exists()


# ---- the pieces, in this process -----------------------------------------------------------


def test_distributed_settings_take_the_recipe_then_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "node0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert parallelize.distributed_settings(load_recipe(None, []), {}) is None  # one process
    got = parallelize.distributed_settings(load_recipe(None, []), env)
    assert got == {
        "coordinator_address": "node0:1234",
        "num_processes": 4,
        "process_id": 3,
        "heartbeat_timeout_seconds": 100,
    }
    keys = load_recipe(None, ["--jax.coordinator_address=head:9", "--jax.num_processes=8", "--jax.process_id=5"])
    assert parallelize.distributed_settings(keys, env) == {
        "coordinator_address": "head:9",
        "num_processes": 8,
        "process_id": 5,
        "heartbeat_timeout_seconds": 100,
    }
    # jax.distributed alone: everything left to JAX's detection (TPU VM, Slurm).
    detected = parallelize.distributed_settings(load_recipe(None, ["--jax.distributed=true"]), {})
    assert detected == {
        "coordinator_address": None,
        "num_processes": None,
        "process_id": None,
        "heartbeat_timeout_seconds": 100,
    }
    with pytest.raises(RecipeError, match=r"\$JAX_NUM_PROCESSES='two' is not an integer"):
        parallelize.distributed_settings(load_recipe(None, []), {**env, "JAX_NUM_PROCESSES": "two"})
    with pytest.raises(RecipeError, match="jax.process_id=4 is outside the 4 processes"):
        parallelize.distributed_settings(load_recipe(None, ["--jax.process_id=4"]), env)


def test_a_slurm_task_takes_all_its_gpus_only_when_it_does_not_share_them():
    task = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert parallelize.slurm_task_owns_its_gpus({**task, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2"})
    per_gpu = {**task, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2"}
    assert not parallelize.slurm_task_owns_its_gpus(per_gpu)  # JAX's own choice: GPU SLURM_LOCALID
    assert parallelize.slurm_task_owns_its_gpus({**per_gpu, "CUDA_VISIBLE_DEVICES": "5"})  # Slurm bound one
    assert not parallelize.slurm_task_owns_its_gpus({**per_gpu, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert not parallelize.slurm_task_owns_its_gpus({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2"})  # no step
    explicit = {**task, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert not parallelize.slurm_task_owns_its_gpus(explicit)


def test_shared_run_dir_check_names_the_blind_process_and_leaves_nothing(tmp_path):
    """Process 0's side, with process 1 played by the all-gather: it reports what it saw."""
    run_dir = tmp_path / "new" / "run"

    def gather(sees: bool):
        def all_gather(text: str) -> list[str]:
            if text and text != "seen":  # the token
                assert (run_dir / SHARED_CHECK_FILE).read_text() == text
                return [text, ""]
            return [text, "seen" if sees else ""]

        return all_gather

    check_shared_run_dir(run_dir, 0, 2, gather(True))
    assert not (tmp_path / "new").exists()  # the check created both folders, and removed both
    with pytest.raises(RecipeError, match=r"process\(es\) \[1\] of 2 do not see") as err:
        check_shared_run_dir(run_dir, 0, 2, gather(False))
    assert REFUSED in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "new").exists()
    run_dir.mkdir(parents=True)  # an existing run dir stays; only the marker goes
    check_shared_run_dir(run_dir, 0, 2, gather(True))
    assert run_dir.is_dir() and not any(run_dir.iterdir())
    check_shared_run_dir(tmp_path / "never", 0, 1, lambda text: pytest.fail("one process gathers nothing"))


def test_a_loader_of_several_ranks_reads_their_rows_in_order(mixture):
    mix = load_mixture(mixture)
    both = MixtureLoader(mix, 16, dp_rank=[3, 1], dp_size=4, prefetch=0).batch_at(5)
    three, one = (MixtureLoader(mix, 16, dp_rank=r, dp_size=4, prefetch=0).batch_at(5) for r in (3, 1))
    for key in both:
        assert np.array_equal(both[key], np.concatenate([three[key], one[key]]))


def test_global_batch_array_places_each_shard_rows_on_its_devices():
    import jax

    mesh = parallelize.build_mesh({"data": -1})
    n = jax.device_count()
    rows = np.arange(4 * n)[:, None] * np.ones((1, 3), np.int32)  # row i holds i
    batch = parallelize.global_batch_array(rows, mesh, accumulation=2, global_rows=4 * n)
    assert parallelize.process_batch_shards(mesh) == tuple(range(n))
    assert np.array_equal(np.asarray(batch), parallelize.to_micro_batches(rows, n, 2))
