"""olmo_model: the one Olmo 3 model spec shared by the JAX and the Torch trainer."""

from .hf import HFLayoutError, hf_config, hf_param_shapes, spec_from_hf_config, validate_hf_tensors
from .init import init_values
from .maths import (
    PEAKS,
    DevicePeak,
    ParamCounts,
    UnknownDeviceError,
    attention_flops_per_token,
    describe,
    flops_per_token,
    fp32_mean_tolerance,
    layout_loss_tolerance,
    mean_keys_per_query,
    mfu,
    param_counts,
    resolve_device_kind,
    training_state_bytes,
)
from .presets import PRESETS, SpecError, get_preset, load_spec, spec_from_dict
from .schedules import (
    ConstantSchedule,
    CosineSchedule,
    LinearSchedule,
    Schedule,
    StitchedCosineSchedule,
    WSDSchedule,
)
from .spec import FULL, SLIDING, ModelSpec, MoESpec, YarnSpec

__all__ = [
    "FULL",
    "PEAKS",
    "PRESETS",
    "SLIDING",
    "ConstantSchedule",
    "CosineSchedule",
    "DevicePeak",
    "HFLayoutError",
    "LinearSchedule",
    "ModelSpec",
    "MoESpec",
    "ParamCounts",
    "Schedule",
    "SpecError",
    "StitchedCosineSchedule",
    "UnknownDeviceError",
    "WSDSchedule",
    "YarnSpec",
    "attention_flops_per_token",
    "describe",
    "flops_per_token",
    "fp32_mean_tolerance",
    "get_preset",
    "hf_config",
    "hf_param_shapes",
    "init_values",
    "layout_loss_tolerance",
    "load_spec",
    "mean_keys_per_query",
    "mfu",
    "param_counts",
    "resolve_device_kind",
    "spec_from_dict",
    "spec_from_hf_config",
    "training_state_bytes",
    "validate_hf_tensors",
]

__version__ = "0.1.0"
