"""olmo_train_jax: the Olmo 3 model in JAX / Flax NNX and its sharded trainer (``olmo-train-jax``)."""

import importlib.util
import os


def _nvidia_gpus_present() -> bool:
    """Whether this host has an NVIDIA GPU: the device nodes the driver makes, which is also what
    a CUDA runtime needs before it can start."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def _leave_out_accelerator_backends_without_chips() -> None:
    """The dev group installs libtpu and JAX's CUDA plugin (``tpu`` and ``gpu-aot`` extras) for
    ahead-of-time compilation (``--dry-run``) on machines that have neither chip. There JAX would
    still start the TPU runtime, which prints a page of errors, and the CUDA plugin, which logs
    its failed driver start and missing cuDNN, before JAX falls back to the CPU. On a host with
    no TPU chips and no NVIDIA GPU, and only there, run on the CPU backend: the chip count is the
    PCI scan JAX itself uses to decide whether a host has TPUs, compiling for a TPU or GPU target
    loads its plugin on its own (``dry_run``), and an explicit ``JAX_PLATFORMS`` (or
    ``JAX_FORCE_TPU_INIT``) always wins."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    has_tpu_runtime = importlib.util.find_spec("libtpu") is not None
    has_cuda_plugin = any(importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    if not (has_tpu_runtime or has_cuda_plugin):
        return
    if has_cuda_plugin and _nvidia_gpus_present():
        return
    if has_tpu_runtime:
        from jax._src import hardware_utils  # JAX's own TPU chip scan (cloud_tpu_init uses it)

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return
    import jax

    jax.config.update("jax_platforms", "cpu")


_leave_out_accelerator_backends_without_chips()

from .hf_adapter import CheckpointMismatchError, load_hf, model_from_hf, to_hf  # noqa: E402
from .model import OlmoModel, build_model  # noqa: E402

__all__ = ["CheckpointMismatchError", "OlmoModel", "build_model", "load_hf", "model_from_hf", "to_hf"]

__version__ = "0.1.0"
