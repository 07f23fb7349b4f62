"""scripts/launch_tpu.sh and scripts/launch_gpu.sh: what ``--dry-run`` prints, read back the way a
shell reads it (``shlex``), and the refusals, which come before any command runs.

- TPU: the tpu extra is installed on every worker; the trainer gets --jax.distributed=true, the
  run dir and every override as one word each, however they are quoted; the start command, run
  here with a stand-in ``uv``, detaches, writes a PID file and a log per host, and hands the
  trainer exactly those arguments; a relative run dir (each worker's own disk) is refused, and
  so is a launch without one.
- GPU: several nodes get HSDP with one replica per node unless the overrides choose a layout;
  MASTER_ADDR=localhost with several nodes is refused; under Slurm the master, node rank, GPUs
  per node and rendezvous id come from the job; the JAX path starts one olmo-train-jax per
  node with the coordinator keys.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "scripts" / "launch_tpu.sh"
GPU = ROOT / "scripts" / "launch_gpu.sh"
RECIPE = "recipes/olmo3-7b/stage1.yaml"
# Overrides a shell would split or expand if the script joined them unquoted.
AWKWARD = ["--optim.lr=2e-4", "--name=it's $HOME x", '--data.mixture=/data/a "b".yaml']


def launch(script: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _GPU_ENV}
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env={**clean, **env}, timeout=60
    )


_GPU_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RDZV_ID", "RUN_NAME", "REPO_DIR")


def commands(out: str) -> dict[str, list[str]]:
    """The dry run's commands as argument lists, keyed by the comment line above each."""
    lines = out.splitlines()
    return {lines[i]: shlex.split(lines[i + 1]) for i in range(len(lines) - 1) if lines[i].startswith("# ")}


def after(words: list[str], word: str) -> list[str]:
    return words[words.index(word) + 1 :]


# ---- TPU ---------------------------------------------------------------------------------


def tpu_dry_run(run_dir: str, **env: str) -> subprocess.CompletedProcess:
    args = [RECIPE, "--device", "v5p", "--devices", "128", "--tpu-name", "slice", "--zone", "z"]
    return launch(TPU, [*args, "--run-dir", run_dir, "--dry-run", "--", *AWKWARD], **env)


def test_tpu_dry_run_installs_the_tpu_extra_everywhere_and_quotes_every_argument():
    done = tpu_dry_run("/mnt/shared/runs/7b stage1")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    assert cmds["# plan: v5p x 128 JAX devices"] == [
        *"uv run --frozen olmo-plan".split(),
        RECIPE,
        "--devices",
        "v5p:128",
        *AWKWARD,
    ]
    install = cmds["# install on every worker"]
    assert install[:9] == "gcloud compute tpus tpu-vm ssh slice --zone z".split() + ["--worker=all"]
    assert "uv sync --frozen --package olmo-train-jax --no-dev --extra tpu" in after(install, "--command")[0]
    start = cmds["# start on every worker, detached"]
    assert "--worker=all" in start
    remote = shlex.split(after(start, "--command")[0])
    assert remote[remote.index("nohup") - 1] == "setsid"  # its own session: lives on after ssh ends
    inner = shlex.split(after(remote, "-c")[0])
    assert after(inner, "olmo-train-jax") == [
        RECIPE,
        "--jax.distributed=true",
        "--run_dir=/mnt/shared/runs/7b stage1",
        *AWKWARD,
    ]
    follow, stop = cmds["# follow (worker 0; --worker=N for another)"], cmds["# stop"]
    assert "--worker=0" in follow and after(follow, "--command")[0].startswith("tail -f $HOME/olmo-logs/stage1-")
    assert "--worker=all" in stop and after(stop, "--command") == ["kill -- -$(cat $HOME/olmo-logs/stage1.pid)"]


def test_tpu_start_command_detaches_with_a_log_and_pid_per_host_and_passes_the_arguments(tmp_path):
    """The start command as a worker's shell runs it, with a stand-in ``uv`` that records its
    arguments: what the trainer would receive."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "uv").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$HOME/argv"\n')
    (bin_dir / "uv").chmod(0o755)
    done = tpu_dry_run("gs://bucket/runs/a", REPO_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    start = after(commands(done.stdout)["# start on every worker, detached"], "--command")[0]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}
    subprocess.run(["bash", "-c", start], env=env, check=True, timeout=30)
    argv = home / "argv"
    deadline = time.monotonic() + 30
    while not argv.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert argv.read_text().splitlines() == [
        *"run --frozen --no-sync olmo-train-jax".split(),
        RECIPE,
        "--jax.distributed=true",
        "--run_dir=gs://bucket/runs/a",
        *AWKWARD,
    ]
    assert int((home / "olmo-logs" / "stage1.pid").read_text()) > 0
    assert (home / "olmo-logs" / f"stage1-{socket.gethostname()}.log").exists()


def test_tpu_launch_refuses_a_run_dir_on_each_workers_own_disk():
    relative = tpu_dry_run("runs/7b")
    assert relative.returncode == 2 and "relative, i.e. on each worker's own disk" in relative.stderr
    args = [RECIPE, "--device", "v5p", "--devices", "128", "--tpu-name", "slice", "--zone", "z"]
    missing = launch(TPU, args)  # a real launch: refused before any command runs
    assert missing.returncode == 2 and "set --run-dir to a path on a shared file system" in missing.stderr
    assert "or a URL (gs://...)" in missing.stderr and missing.stdout == ""


# ---- GPU ---------------------------------------------------------------------------------


def test_gpu_several_nodes_default_to_hsdp_one_replica_per_node():
    env = {"NNODES": "16", "NODE_RANK": "3", "MASTER_ADDR": "node0", "GPUS_PER_NODE": "8"}
    done = launch(GPU, [RECIPE, "--device", "h100", "--dry-run", "--", *AWKWARD], **env)
    assert done.returncode == 0, done.stderr
    plan, train = (shlex.split(line) for line in done.stdout.splitlines()[1:3])
    layout = ["--torch.parallel=hsdp", "--torch.replicate=16"]
    assert after(plan, "--devices") == ["h100:128", *AWKWARD, *layout]
    assert after(train, "torchrun") == [
        *"--nnodes 16 --nproc-per-node 8 --node-rank 3 --rdzv-backend c10d --rdzv-endpoint node0:29500".split(),
        *"--rdzv-id olmo-stage1 -m olmo_train_torch".split(),
        RECIPE,
        *AWKWARD,
        *layout,
    ]
    # A layout the overrides choose is theirs alone.
    chosen = launch(GPU, [RECIPE, "--device", "h100", "--dry-run", "--", "--torch.parallel=fsdp"], **env)
    assert shlex.split(chosen.stdout.splitlines()[2])[-2:] == [RECIPE, "--torch.parallel=fsdp"]


def test_gpu_refuses_localhost_as_master_of_several_nodes():
    done = launch(GPU, [RECIPE, "--device", "h100", "--dry-run"], NNODES="2", GPUS_PER_NODE="8")
    assert done.returncode == 2 and done.stdout == ""
    assert "NNODES=2 but MASTER_ADDR=localhost: the other nodes cannot reach it" in done.stderr
    single = launch(GPU, [RECIPE, "--device", "h100", "--dry-run"], GPUS_PER_NODE="8")
    assert single.returncode == 0 and "--rdzv-endpoint localhost:29500" in single.stdout


def test_gpu_under_slurm_takes_the_job_and_the_jax_path_uses_every_gpu(tmp_path):
    # scontrol show hostnames gpu[07-08], the second name late: a reader that stops after the
    # first line (head) would kill it with SIGPIPE, which fails the script under pipefail.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho gpu07\nsleep 0.3\necho gpu08\n")
    scontrol.chmod(0o755)
    slurm = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_GPUS_ON_NODE": "4",
    }
    torch = launch(GPU, [RECIPE, "--device", "h100", "--dry-run"], **slurm)
    assert torch.returncode == 0, torch.stderr
    train = shlex.split(torch.stdout.splitlines()[2])
    assert after(train, "torchrun")[:12] == [
        *"--nnodes 2 --nproc-per-node 4 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint gpu07:29500".split(),
        *"--rdzv-id slurm-77".split(),
    ]
    jax = launch(GPU, [RECIPE, "--device", "h100", "--framework", "jax", "--dry-run", "--", *AWKWARD], **slurm)
    assert jax.returncode == 0, jax.stderr
    lines = jax.stdout.splitlines()
    assert "# plan: h100 x 8 (2 nodes x 4 GPUs), jax" in lines[0]
    assert shlex.split(lines[3]) == ["uv", "run", "--frozen", "--no-sync", "python", "-c", "import jax_cuda12_plugin"]
    assert after(shlex.split(lines[4]), "olmo-train-jax") == [
        RECIPE,
        *AWKWARD,  # no HSDP: a torch layout
        "--jax.coordinator_address=gpu07:29500",
        "--jax.num_processes=2",
        "--jax.process_id=1",
    ]
