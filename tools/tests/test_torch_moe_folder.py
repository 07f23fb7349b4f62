"""olmo-convert reads the MoE torch: folders it writes: the OlmoModel state dict, routed experts
stacked [E, ...] as the torch trainer holds them, mapped by the trainer's own adapter
(``hf_adapter.hf_to_local_names``). Round trips through jax: and olmo-core: give every tensor back
bit for bit (a copy and a reshuffle, no arithmetic), for a plain MoE spec and for OLMo-core 3's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from olmo_model import hf_param_shapes, load_spec
from olmo_model.init import init_values
from olmo_tools.checkpoint import CheckpointError
from olmo_tools.convert import convert
from olmo_tools.dcp import DCPDir, save_dcp
from olmo_tools.formats import atomic_destination
from olmo_tools.native import TorchCheckpoint, write_spec_file
from olmo_train_torch.hf_adapter import initial_model, to_hf

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SPECS = ("tiny-moe", "tiny-olmoe3")


@pytest.fixture(scope="module", params=SPECS)
def torch_folder(request, tmp_path_factory) -> tuple[str, Path, dict[str, torch.Tensor]]:
    """A torch: folder written from the trainer's own initial model (olmo_model.init, seed 3)."""
    spec = load_spec(request.param)
    root = tmp_path_factory.mktemp(request.param)
    src = root / "torch-src"
    model = initial_model(spec, seed=3)
    with atomic_destination(src, overwrite=False) as tmp:
        save_dcp(tmp, {k: v.contiguous() for k, v in model.state_dict().items()})
        write_spec_file(tmp, spec)
    return request.param, src, {k: v.clone() for k, v in to_hf(model, spec).items()}


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with TorchCheckpoint(path) as ckpt:
        return dict(ckpt.tensors())


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_reads_the_trainers_state_dict_as_olmo_model_init(torch_folder):
    """Each expert read from the stacked tensor is olmo_model.init's value of that HF name."""
    name, src, _ = torch_folder
    spec = load_spec(name)
    got = _read_all(src)
    assert list(got) == list(hf_param_shapes(spec))
    experts = [n for n in got if ".mlp.experts." in n]
    assert experts
    for n in (experts[0], experts[-1], "model.embed_tokens.weight"):
        region = tuple(slice(0, s) for s in hf_param_shapes(spec)[n])
        want = torch.from_numpy(init_values(spec, 3, n, region))
        assert torch.equal(got[n], want), n
    # Stored stacked, as the trainer holds them.
    stacked = [k for k, (shape, _) in DCPDir(src).tensors.items() if k.endswith("experts.gate_proj")]
    assert stacked and all(DCPDir(src).tensors[k][0][0] == spec.moe.n_experts for k in stacked)


@pytest.mark.parametrize("via", ["jax", "olmo-core"])
def test_round_trip_is_bitwise(torch_folder, tmp_path, via):
    name, src, want = torch_folder
    mid = tmp_path / via
    convert(f"torch:{src}", f"{via}:{mid}")
    convert(f"{via}:{mid}", f"torch:{tmp_path / 'back'}", spec=name if via == "olmo-core" else None)
    _assert_bitwise(_read_all(tmp_path / "back"), want)
    # The folder written back stores the trainer's own state dict: keys, stacked shapes, bytes.
    back, orig = DCPDir(tmp_path / "back"), DCPDir(src)
    assert back.tensors == orig.tensors
    for key in orig.tensors:
        assert torch.equal(back.load(key), orig.load(key)), key


def test_moe_folder_read_with_a_dense_spec_is_one_line(torch_folder):
    _, src, _ = torch_folder
    with pytest.raises(CheckpointError) as err:
        TorchCheckpoint(src, spec="tiny")
    assert "\n" not in str(err.value) and str(src) in str(err.value) and "--spec" in str(err.value)


def test_a_stack_of_the_wrong_expert_count_is_one_line(tmp_path):
    spec = load_spec("tiny-moe")
    state = {k: v.contiguous() for k, v in initial_model(spec, seed=3).state_dict().items()}
    key = next(k for k in state if k.endswith("mlp.experts.up_proj"))
    state[key] = state[key][1:].contiguous()
    save_dcp(tmp_path, state)
    write_spec_file(tmp_path, spec)
    with pytest.raises(CheckpointError, match=f"'{key}' stacks {spec.moe.n_experts - 1} experts") as err:
        TorchCheckpoint(tmp_path)
    assert "\n" not in str(err.value)
