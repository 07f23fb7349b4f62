"""What olmo_data tells a user about their input: the dtype hint of a token file whose size no
dtype fits, the warning of a resume onto a changed mixture (and that what it says happens), a
mixture path that is a folder, and a quiet `import olmo_data` where jax is not installed."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
from test_mixture_support import EOS, two_source_mixture

from olmo_data import DataError, MixtureLoader, load_mixture, open_source
from olmo_data.cli import main

B = 8  # global batch


NO_DTYPE_FITS = "no token dtype divides it: a truncated or foreign file; re-write it or remove it from the mixture"


@pytest.mark.parametrize(
    "size,dtype,hint",
    [
        (6, "uint32", "wrong dtype (try dtype: uint16) or a truncated file"),  # 6 bytes: 3 uint16 ids
        (5, "uint16", NO_DTYPE_FITS),  # not "try dtype: uint32": 5 is no multiple of 4 either
        (7, "uint32", NO_DTYPE_FITS),
    ],
)
def test_the_size_hint_suggests_only_a_dtype_that_fits_the_file(tmp_path, size, dtype, hint):
    path = tmp_path / "tokens.npy"
    path.write_bytes(bytes(size))
    with pytest.raises(DataError) as err:
        open_source(str(path), "numpy", dtype=dtype, eos_token_id=EOS)
    itemsize = np.dtype(dtype).itemsize
    assert str(err.value) == f"{path}: size {size} bytes is not a multiple of {itemsize} ({dtype}): {hint}"


def test_a_resume_onto_a_changed_mixture_warns_that_the_remaining_order_is_reshuffled(tmp_path, caplog):
    path = two_source_mixture(tmp_path)
    before = MixtureLoader(load_mixture(path), B)
    state = {**before.state_dict(), "step": 3, "tokens_consumed": 3 * before.tokens_per_global_batch}
    # a one-token edit of the raw source (same size, same documents)
    tokens = np.fromfile(tmp_path / "code" / "a.npy", dtype=np.uint16)
    tokens[1] = 2 if tokens[1] != 2 else 3
    tokens.tofile(tmp_path / "code" / "a.npy")
    after = MixtureLoader(load_mixture(path), B)
    assert after.mixture.fingerprint() != before.mixture.fingerprint()
    with caplog.at_level(logging.WARNING, logger="olmo_data.loader"):
        after.load_state_dict(state, allow_fingerprint_mismatch=True)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("!!! ") and warning.endswith(" !!!")
    assert "continuing at step 3 anyway because data.allow_fingerprint_mismatch=true" in warning
    assert "the whole remaining order is reshuffled" in warning
    assert "batches from step 3 on are drawn from the new mixture's order and differ from the original run's" in warning
    # ... which is what happens: not one batch from step 3 on is the original run's
    for step in range(3, 8):
        assert after.batch_at(step)["input_ids"].tobytes() != before.batch_at(step)["input_ids"].tobytes()


def test_inspect_on_a_folder_is_one_line_naming_the_yaml_inside(tmp_path, capsys):
    two_source_mixture(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err == f"error {tmp_path}: is a folder, not a mixture file; name the mixture YAML in it (mixture.yaml there)"


def test_importing_olmo_data_without_jax_prints_nothing():
    # sys.modules["jax"] = None makes `import jax` fail as it does where jax is not installed;
    # grain then logs "Failed to load jax profiler" through absl unless olmo_data quiets it.
    code = (
        "import logging, sys; sys.modules['jax'] = None\n"
        "import olmo_data\n"
        "assert 'grain' in sys.modules\n"
        # nor has absl installed a root handler that would reformat every later warning
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
