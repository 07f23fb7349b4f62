"""The interface every weight format olmo-convert and olmo-parity read is seen through.

A ``Checkpoint`` knows its ``ModelSpec`` and what it stores (name -> shape, dtype) under
the interchange names (transformers' Olmo3 names, ``olmo_model.hf_param_shapes``), and
hands out one tensor at a time. ``KIND:PATH`` strings name one (``parse_location``); the
readers are in ``olmo_tools.formats`` (hf:, olmo-core:, and ``open_checkpoint`` for any kind)
and ``olmo_tools.native`` (torch:, jax:). Here too: the checks every reader shares (the
spec against ``--spec``, the tensors against the spec, a trainer checkpoint's integrity).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from olmo_model import HFLayoutError, ModelSpec, hf_param_shapes, load_spec, validate_hf_tensors
from olmo_run.checkpoints import read_verified_meta
from olmo_run.errors import CheckpointDamagedError

KINDS = ("hf", "olmo-core", "torch", "jax")


class CheckpointError(ValueError):
    """A checkpoint or destination that cannot be used; the message names the file, the tensor and the fix."""


@dataclass(frozen=True)
class Location:
    kind: str
    path: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def parse_location(text: str, kinds: tuple[str, ...] = KINDS) -> Location:
    """``KIND:PATH`` -> Location; an unknown kind is an error listing the known ones."""
    kind, sep, path = text.partition(":")
    if not sep or kind not in kinds or not path:
        raise CheckpointError(f"'{text}': expected KIND:PATH with KIND one of {', '.join(kinds)} (e.g. hf:out/model)")
    return Location(kind, Path(path))


class Checkpoint:
    """A readable checkpoint: ``spec``, ``stored`` (interchange name -> (shape, dtype)) and ``tensor(name)``;
    where it knows its tokenizer, ``mixture`` (a trainer checkpoint: the mixture its recipe trained
    on) or ``tokenizer_dir`` (an HF folder holding a tokenizer.json)."""

    origin: str
    spec: ModelSpec
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
    mixture: str | None = None
    tokenizer_dir: Path | None = None

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter in spec order, one at a time."""
        for name in hf_param_shapes(self.spec):
            yield name, self.tensor(name)

    def close(self) -> None:
        """Release open files; the default reader holds none."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spec_disagreement(stored: ModelSpec, given: ModelSpec) -> list[str]:
    """Fields on which two specs differ (the display ``name`` aside)."""
    a, b = stored.model_dump(exclude={"name"}), given.model_dump(exclude={"name"})
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]


def resolve_spec(stored: ModelSpec | None, given: str | ModelSpec | None, origin: str, stored_in: str) -> ModelSpec:
    """The checkpoint's own spec, checked against ``--spec`` when both exist."""
    given_spec = load_spec(given) if isinstance(given, (str, Path)) else given
    if stored is None:
        if given_spec is None:
            raise CheckpointError(f"{origin}: the checkpoint carries no config; pass --spec PRESET_OR_FILE")
        return given_spec
    if given_spec is not None:
        diff = spec_disagreement(stored, given_spec)
        if diff:
            raise CheckpointError(
                f"{origin}: {stored_in} disagrees with --spec ({'; '.join(diff[:3])}); "
                "drop --spec to use the checkpoint's own config, or fix the spec"
            )
    return stored


def require_jax(use: str) -> None:
    """A one-line CheckpointError unless the JAX trainer (jax, flax, orbax) can be imported: the
    olmo-tools[jax] extra, which conversions between torch/OLMo-core and hf do not need."""
    try:
        import olmo_train_jax  # noqa: F401 - imported for the check; its users import what they need
    except ImportError as err:
        raise CheckpointError(
            f"{use}: needs the JAX trainer, which is not installed ({err}); install olmo-tools[jax] "
            "(in this workspace: uv sync --package olmo-tools --extra jax, or uv sync --all-packages)"
        ) from None


def verified_trainer_meta(ckpt: Path) -> dict:
    """The meta.json of a trainer checkpoint folder, once its files match the sizes and sha256
    recorded in it (olmo_run.checkpoints.verify_checkpoint)."""
    try:
        return read_verified_meta(ckpt)
    except CheckpointDamagedError as err:
        raise CheckpointError(
            f"{err}; convert an intact checkpoint (an older step of that run) or restore it from a copy"
        ) from None


def validate(ckpt: Checkpoint) -> None:
    """Every expected tensor present with its shape, nothing unexpected, a float dtype
    (``olmo_model.validate_hf_tensors``, its error raised as a CheckpointError)."""
    try:
        validate_hf_tensors(
            ckpt.spec,
            {name: shape for name, (shape, _) in ckpt.stored.items()},
            ckpt.origin,
            dtypes={name: dtype for name, (_, dtype) in ckpt.stored.items()},
        )
    except HFLayoutError as err:
        raise CheckpointError(str(err)) from None


def checked_tensor(ckpt: Checkpoint, name: str, t: torch.Tensor) -> torch.Tensor:
    # A file can lie in its header only by corruption; still, never pass on a wrong tensor.
    if tuple(t.shape) != ckpt.stored[name][0]:
        raise CheckpointError(
            f"{ckpt.origin}: tensor '{name}' read with shape {tuple(t.shape)}, header says {ckpt.stored[name][0]}"
        )
    return t
