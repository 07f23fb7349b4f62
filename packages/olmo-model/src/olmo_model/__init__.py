"""olmo_model: the one Olmo 3 model spec shared by the JAX and the Torch trainer."""

from .hf import HFLayoutError, hf_config, hf_param_shapes, spec_from_hf_config, validate_hf_tensors
from .maths import (
    PEAKS,
    DevicePeak,
    ParamCounts,
    UnknownDeviceError,
    attention_flops_per_token,
    describe,
    flops_per_token,
    fp32_mean_tolerance,
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
from .spec import FULL, SLIDING, MoESpec, ModelSpec, YarnSpec

__version__ = "0.1.0"
