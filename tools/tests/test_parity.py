"""olmo-parity logits: our torch and JAX models match transformers' Olmo3 on the same weights,
the metrics are right on hand-derived cases, and the exit status follows the thresholds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.torch import save_file

from olmo_model import get_preset, hf_config
from olmo_tools.checkpoint import CheckpointError
from olmo_tools.parity import Side, compare, main, read_tokens
from olmo_train_torch import initial_model, to_hf

KEYS = {"kl_mean", "kl_max", "top1_agreement", "max_abs_logit_diff", "n_positions", "passed", "a", "b"}


def _hf_dir(path, spec, seed):
    """An HF folder of our torch model's random weights, written with safetensors' own writer."""
    path.mkdir()
    tensors = {k: v.contiguous() for k, v in to_hf(initial_model(spec, seed=seed), spec).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(spec)))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    spec = get_preset("tiny")
    root = tmp_path_factory.mktemp("parity")
    return _hf_dir(root / "a", spec, seed=1), _hf_dir(root / "b", spec, seed=2)


def _run(capsys, *argv) -> tuple[int, dict]:
    code = main(["logits", *argv, "--json"])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else {})


@pytest.mark.parametrize("impl", ["torch", "jax"])
def test_ours_match_transformers_fp32(folders, capsys, impl):
    a, _ = folders
    # seq 96 > window 32: sliding and global layers both differ from plain causal attention.
    code, report = _run(
        capsys, f"hf:{a}", f"hf-ref:{a}", "--impl-a", impl, "--seq-len", "96", "--batch", "2",
        "--max-kl", "1e-9", "--min-top1", "1.0",
    )  # fmt: skip
    assert code == 0, report
    assert KEYS <= set(report)
    assert (report["impl_a"], report["impl_b"]) == (impl, "transformers")
    assert report["n_positions"] == 192
    assert report["kl_max"] <= 1e-9 and report["top1_agreement"] == 1.0
    assert report["max_abs_logit_diff"] <= 1e-4


def test_thresholds_set_the_exit_status(folders, capsys):
    a, b = folders
    # Two differently seeded models: far apart, so both thresholds must fail ...
    code, report = _run(capsys, f"hf:{a}", f"hf:{b}", "--seq-len", "40", "--max-kl", "1e-9", "--min-top1", "0.99")
    assert code == 1
    assert report["passed"] is False and len(report["failures"]) == 2
    assert report["kl_mean"] > 1e-3 and report["top1_agreement"] < 0.5
    # ... while thresholds they meet pass with the same numbers.
    code, again = _run(capsys, f"hf:{a}", f"hf:{b}", "--seq-len", "40", "--max-kl", "100", "--min-top1", "0")
    assert code == 0 and again["kl_mean"] == report["kl_mean"]
    # Without --json: the table, with the verdict.
    assert main(["logits", f"hf:{a}", f"hf:{b}", "--seq-len", "40", "--min-top1", "0.99"]) == 1
    table = capsys.readouterr().out
    assert "top-1 agreement" in table and "FAIL: top1_agreement" in table
    # Bad input: exit 2 with a one-line error naming the problem.
    assert main(["logits", f"hf:{a}", f"nope:{b}"]) == 2
    assert "expected KIND:PATH" in capsys.readouterr().err
    assert main(["logits", f"hf:{a}", f"hf-ref:{a / 'missing'}"]) == 2
    assert "config.json: not found" in capsys.readouterr().err


def test_per_side_dtype(folders, capsys):
    import torch
    from transformers import Olmo3ForCausalLM

    a, _ = folders
    # transformers itself in bf16 (A) and fp32 (B) on the CLI's seeded ids; KL computed here.
    ids = np.random.default_rng(0).integers(0, 4096, (1, 40))
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = Olmo3ForCausalLM.from_pretrained(a, dtype=dtype).eval()
        with torch.no_grad():
            logits[dtype] = model(torch.from_numpy(ids)).logits.double().numpy()[0]
    la, lb = logits[torch.bfloat16], logits[torch.float32]
    pa = la - la.max(-1, keepdims=True)
    pa -= np.log(np.exp(pa).sum(-1, keepdims=True))
    pb = lb - lb.max(-1, keepdims=True)
    pb -= np.log(np.exp(pb).sum(-1, keepdims=True))
    kl = (np.exp(pa) * (pa - pb)).sum(-1)
    code, report = _run(
        capsys, f"hf-ref:{a}", f"hf-ref:{a}", "--dtype", "float32", "--dtype-a", "bfloat16",
        "--seq-len", "40", "--batch", "1",
    )  # fmt: skip
    assert code == 0
    assert (report["dtype_a"], report["dtype_b"]) == ("bfloat16", "float32")
    assert kl.mean() > 1e-8  # bf16 really ran on one side only
    assert report["kl_mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert report["max_abs_logit_diff"] == pytest.approx(np.abs(la - lb).max(), rel=1e-9)
    # --dtype-b alone: A keeps --dtype; equal dtypes give identical logits.
    code, report = _run(capsys, f"hf-ref:{a}", f"hf-ref:{a}", "--dtype-b", "float32", "--seq-len", "40", "--batch", "1")
    assert (report["dtype_a"], report["dtype_b"]) == ("float32", "float32") and report["kl_max"] == 0.0


def _side(logits: np.ndarray) -> Side:
    spec = get_preset("tiny").replace(vocab_size=logits.shape[-1], padded_vocab_size=logits.shape[-1])
    return Side("synthetic", "numpy", spec, lambda ids: logits[ids[:, 0]])


def test_metrics_against_hand_computed_values():
    # Row r of the batch picks logits[r]; position-independent for simplicity.
    # Row 0: A uniform over 2, B = softmax(ln 3, 0) = (3/4, 1/4):
    #   KL = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3); argmax ties go to index 0 on both.
    # Row 1: identical logits: KL 0, agreement. Row 2: A = (0, 2), B = (2, 0): disagree,
    #   KL = p ln(p/q) + q ln(q/p) = (p - q) ln(p/q) with p = e^2/(1+e^2), q = 1 - p; |diff| = 2.
    a = np.array([[[0.0, 0.0]], [[1.0, -1.0]], [[0.0, 2.0]]], dtype=np.float32)
    b = np.array([[[math.log(3), 0.0]], [[1.0, -1.0]], [[2.0, 0.0]]], dtype=np.float32)
    p = math.exp(2) / (1 + math.exp(2))
    kl = [0.5 * math.log(4 / 3), 0.0, (p - (1 - p)) * math.log(p / (1 - p))]
    seq = 5
    ids = np.repeat(np.arange(3)[:, None], seq, axis=1)
    side_a, side_b = _side(np.repeat(a, seq, axis=1)), _side(np.repeat(b, seq, axis=1))
    for chunk in (10**9, 1):  # everything at once, then one sequence per chunk
        m = compare(side_a, side_b, ids, chunk_elements=chunk)
        assert m["n_positions"] == 15
        assert m["kl_mean"] == pytest.approx(sum(kl) / 3, rel=1e-6)
        assert m["kl_max"] == pytest.approx(max(kl), rel=1e-6)
        assert m["top1_agreement"] == pytest.approx(2 / 3)
        assert m["max_abs_logit_diff"] == pytest.approx(2.0)


def test_read_tokens(tmp_path):
    rows = np.arange(24, dtype=np.int32).reshape(4, 6)
    np.save(tmp_path / "rows.npy", rows)
    np.testing.assert_array_equal(read_tokens(tmp_path / "rows.npy", 2, 3, 100, "uint32"), rows[:2, :3])
    # A raw OLMo token file: a headerless stream of uint32 ids, cut into batch x seq.
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "part-0.bin")
    np.testing.assert_array_equal(read_tokens(tmp_path / "part-0.bin", 2, 4, 100, "uint32"), np.arange(8).reshape(2, 4))
    with pytest.raises(CheckpointError, match=r"holds 10 tokens .* need batch x seq_len = 12"):
        read_tokens(tmp_path / "part-0.bin", 3, 4, 100, "uint32")
    with pytest.raises(CheckpointError, match=r"outside the vocabulary \[0, 5\)"):
        read_tokens(tmp_path / "part-0.bin", 2, 4, 5, "uint32")
