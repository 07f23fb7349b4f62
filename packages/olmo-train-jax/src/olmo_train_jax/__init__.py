"""olmo_train_jax: the Olmo 3 model in JAX / Flax NNX and its sharded trainer (``olmo-train-jax``)."""

import importlib.util
import os


def _leave_out_tpu_backend_without_chips() -> None:
    """With libtpu installed (the ``tpu`` extra; the dev group has it for ahead-of-time TPU
    compilation, ``--dry-run``) on a host with no TPU chips and no GPU plugin, JAX still starts the
    TPU runtime, which prints a page of errors before JAX falls back to the CPU. There, and only
    there, run on the CPU backend: the chip count is the PCI scan JAX itself uses to decide whether a
    host has TPUs, compiling for a TPU topology loads libtpu on its own, and an explicit
    ``JAX_PLATFORMS`` (or ``JAX_FORCE_TPU_INIT``) always wins."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    if importlib.util.find_spec("libtpu") is None:
        return
    if any(importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    from jax._src import hardware_utils  # JAX's own TPU chip scan (cloud_tpu_init uses it)

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        import jax

        jax.config.update("jax_platforms", "cpu")


_leave_out_tpu_backend_without_chips()

from .hf_adapter import CheckpointMismatchError, load_hf, model_from_hf, to_hf  # noqa: E402
from .model import OlmoModel, build_model  # noqa: E402

__all__ = ["CheckpointMismatchError", "OlmoModel", "build_model", "load_hf", "model_from_hf", "to_hf"]

__version__ = "0.1.0"
