"""A complete hf: export (issue 22, items 4 and 8): a JAX trainer checkpoint converts to hf: in one
step, with the tokenizer of the mixture it trained on and a generation config, and transformers
(the independent reference) reproduces the JAX model: logits, tokenizer and greedy generation.
Conversions between torch and hf run with jax, flax, orbax and optax unimportable.

The run: model "tiny" (4 layers, window 32 on layers 0-2, layer 3 global) on the embedded sample
mixture (its tokenizer: byte-level BPE, 4096 tokens, eos 0, pad 1), sequence 64, 4 steps at LR
1e-2 after 1 warmup step, fp32. That few steps already make greedy continuations differ from
prompt to prompt, so the generation comparison is not one of a constant token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_checks import refused

from olmo_model import get_preset
from olmo_tools.convert import main as convert_main

STEPS = 4
RECIPE = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    f"--checkpoint.every={STEPS}",
    "--eval.every=1000",
    "--log.progress=false",
    "--checkpoint.async_save=false",
    "--optim.lr=1e-2",
    "--schedule.warmup_steps=1",
]
SEQ = 96  # > window 32: sliding and global layers both matter
PROMPTS = ["x = ", "def ", "for i in range("]
NEW_TOKENS = 12
EXPORT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The fixtures (one_torch_thread, run_helpers) live in the workspace's root conftest.py.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # DCP notes on every call that it runs without a process group, which is intended here.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, run_helpers) -> Path:
    path = tmp_path_factory.mktemp("hf-export") / "run"
    run_helpers.train("jax", [*RECIPE, f"--run_dir={path}"])
    return path


@pytest.fixture(scope="module")
def checkpoint(run) -> Path:
    return run / "checkpoints" / f"step_{STEPS:08d}"


@pytest.fixture(scope="module")
def export(checkpoint, tmp_path_factory) -> Path:
    """The trainer checkpoint -> hf: in one step, as a user runs it."""
    out = tmp_path_factory.mktemp("export") / "hf"
    assert convert_main([f"jax:{checkpoint}", f"hf:{out}"]) == 0
    return out


@pytest.fixture(scope="module")
def sample_tokenizer() -> Path:
    from olmo_data import load_mixture

    mixture = load_mixture("sample")
    assert mixture.config.tokenizer is not None and mixture.config.eos_token_id == 0
    return mixture.root / mixture.config.tokenizer


@pytest.fixture(scope="module")
def jax_logits(checkpoint):
    """ids -> float32 logits of the JAX model with the checkpoint's parameters, read with Orbax
    directly (not through olmo_tools); jitted once, compiled once per input shape."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from olmo_train_jax import build_model

    params = ocp.StandardCheckpointer().restore((checkpoint / "state").absolute())["params"]
    graphdef, state = nnx.split(build_model(get_preset("tiny")))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    forward = nnx.jit(lambda m, x: m(x).logits)
    return lambda ids: np.asarray(forward(model, jnp.asarray(ids)))


def test_a_jax_trainer_checkpoint_exports_in_one_step_with_the_jax_models_logits(
    run, export, jax_logits, run_helpers, tmp_path
):
    from transformers import Olmo3ForCausalLM

    ids = run_helpers.sample_batch(SEQ, 2)["input_ids"].astype(np.int64)
    want = jax_logits(ids)
    hf = Olmo3ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.from_numpy(ids)).logits.numpy()
    gap = float(np.abs(got - want).max())
    print(f"max |transformers - jax| logit: {gap:.2e}; max |logit| {np.abs(want).max():.2f}")
    # fp32 on both sides: XLA and ATen sum in different orders (matmul blocking, the RMSNorm,
    # softmax and attention reductions), ~1e-7 relative per op, so logits of magnitude ~1 differ
    # by ~1e-6 after the 4 blocks and the head; 1e-5 leaves a tenfold margin.
    assert gap <= 1e-5
    # A misplaced tensor would not hide under that bound: layers 0 and 1 swapped miss it by far.
    swapped = {k: v.clone() for k, v in hf.state_dict().items()}
    for name in [n for n in swapped if n.startswith("model.layers.0.")]:
        other = name.replace("layers.0.", "layers.1.")
        swapped[name], swapped[other] = swapped[other], swapped[name]
    hf.load_state_dict(swapped)
    with torch.no_grad():
        assert np.abs(hf(torch.from_numpy(ids)).logits.numpy() - want).max() > 100 * 1e-5

    # A run dir names its latest complete checkpoint, under jax: as under jax-run:.
    for i, src in enumerate([f"jax:{run}", f"jax-run:{run}"]):
        assert convert_main([src, f"hf:{tmp_path / str(i)}"]) == 0
        for name in EXPORT_FILES:
            assert (tmp_path / str(i) / name).read_bytes() == (export / name).read_bytes(), (src, name)


def test_the_export_carries_the_mixtures_tokenizer_and_consistent_special_tokens(export, sample_tokenizer):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reference = Tokenizer.from_file(str(sample_tokenizer))  # what the sample's data was tokenized with
    tokenizer = AutoTokenizer.from_pretrained(export)
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox. <|endoftext|>", "  tabs\tand ünïcödé"]
    for text in texts:
        assert tokenizer(text).input_ids == reference.encode(text).ids, text
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    config, generation = AutoConfig.from_pretrained(export), GenerationConfig.from_pretrained(export)
    # eos: the mixture's eos_token_id; pad and bos: the spec's (tiny: pad 1, no bos).
    for field, want in (("eos_token_id", 0), ("pad_token_id", 1), ("bos_token_id", None)):
        assert getattr(tokenizer, field) == getattr(config, field) == getattr(generation, field) == want, field
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"


def test_pipeline_greedy_generation_equals_the_jax_models(export, jax_logits, sample_tokenizer, monkeypatch):
    from tokenizers import Tokenizer
    from transformers import pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local; never ask the hub
    reference = Tokenizer.from_file(str(sample_tokenizer))
    generate = pipeline("text-generation", model=str(export), device="cpu")
    continuations = []
    for prompt in PROMPTS:
        # Our greedy decoding: the JAX model's argmax, one token at a time, stopping at eos. The
        # model is causal, so one fixed-length padded forward per step serves every length.
        ids = reference.encode(prompt).ids
        prompt_len = len(ids)
        for _ in range(NEW_TOKENS):
            padded = np.zeros((1, prompt_len + NEW_TOKENS), np.int64)
            padded[0, : len(ids)] = ids
            next_id = int(jax_logits(padded)[0, len(ids) - 1].argmax())
            if next_id == 0:
                break
            ids.append(next_id)
        ours = ids[prompt_len:]
        out = generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, return_tensors=True)[0]
        assert list(out["generated_token_ids"])[prompt_len:] == ours, prompt
        text = generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, return_full_text=False)[0]
        assert text["generated_text"] == reference.decode(ours), prompt
        continuations.append(ours)
    print("greedy continuations:", [reference.decode(c) for c in continuations])
    assert len({tuple(c) for c in continuations}) > 1 and len({t for c in continuations for t in c}) >= 3


BLOCKED_RUNNER = """
import json, sys

BLOCKED = ("jax", "jaxlib", "flax", "orbax", "optax")


class NoJax:
    # A finder ahead of the real ones: the JAX stack looks as if it were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, NoJax())
import torch

torch.set_num_threads(1)
from olmo_tools.convert import main

statuses = [main(argv) for argv in json.loads(sys.argv[1])]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"statuses": statuses, "loaded": loaded}))
"""


def test_torch_and_hf_convert_both_ways_without_jax(checkpoint, export, sample_tokenizer, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    torch_dir = tmp_path / "torch"
    assert convert_main([f"jax:{checkpoint}", f"torch:{torch_dir}"]) == 0  # here, with JAX
    hf, back, bf16, refused = (tmp_path / n for n in ("hf", "torch-again", "hf-bf16", "jax"))
    argvs = [
        [f"torch:{torch_dir}", f"hf:{hf}", "--tokenizer", str(sample_tokenizer)],
        [f"hf:{hf}", f"torch:{back}"],
        [f"hf:{hf}", f"hf:{bf16}", "--dtype", "bfloat16"],  # the source's tokenizer comes along
        [f"hf:{hf}", f"jax:{refused}"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUNNER, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"statuses": [0, 0, 0, 2], "loaded": []}, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("olmo-convert: error:")]
    assert len(errors) == 1 and "needs the JAX trainer" in errors[0] and "olmo-tools[jax]" in errors[0], errors
    assert not refused.exists()

    # The same weights, tokenizer and special tokens as the export made with JAX ...
    for name in EXPORT_FILES:
        assert (hf / name).read_bytes() == (export / name).read_bytes(), name
        assert name == "model.safetensors" or (bf16 / name).read_bytes() == (hf / name).read_bytes(), name
    # ... and back in torch: the original DCP's tensors, bit for bit.
    meta = FileSystemReader(str(torch_dir)).read_metadata().state_dict_metadata
    first = {k: torch.empty(tuple(m.size)) for k, m in meta.items()}
    again = {k: torch.empty(tuple(m.size)) for k, m in meta.items()}
    dcp.load(first, checkpoint_id=str(torch_dir), no_dist=True)
    dcp.load(again, checkpoint_id=str(back), no_dist=True)
    assert len(first) == 47 and all(torch.equal(first[k], again[k]) for k in first)


def fails(capsys, argv: list[str], *needles: str) -> None:
    refused(convert_main, capsys, argv, *needles)


def test_wrong_sources_and_tokenizers_are_one_line_errors_and_write_nothing(
    run, checkpoint, export, sample_tokenizer, tmp_path, capsys
):
    out = tmp_path / "out"
    fails(capsys, [f"torch:{checkpoint}", f"hf:{out}"], "jax trainer checkpoint, not a torch one", f"jax:{checkpoint}")
    fails(capsys, [f"jax:{checkpoint / 'state'}", f"hf:{out}"], f"name the checkpoint folder itself: jax:{checkpoint}")
    fails(capsys, [f"jax:{tmp_path / 'nothing'}", f"hf:{out}"], "not found", "run dir")
    fails(capsys, [f"hf:{export}", f"jax-run:{out}"], "holds weights only", "init.checkpoint")
    fails(capsys, [f"jax:{checkpoint}", f"torch:{out}", "--tokenizer", str(sample_tokenizer)], "hf: destinations only")
    fails(capsys, [f"jax:{checkpoint}", f"hf:{out}", "--tokenizer", str(tmp_path)], f"{tmp_path} has no tokenizer.json")
    # OLMo-core's fixture has a 256-token vocabulary: the sample's 4096-token tokenizer cannot be its.
    olmo_core = Path(__file__).parent / "data" / "olmo_core_olmo3"
    argv = [f"olmo-core:{olmo_core / 'model_and_optim'}", f"hf:{out}", "--spec", str(olmo_core / "spec.json")]
    fails(capsys, [*argv, "--tokenizer", str(sample_tokenizer)], "4096 tokens", "vocab_size 256")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # With no tokenizer known the export still happens, and says how to add one.
    assert convert_main(argv) == 0
    assert "has no tokenizer" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
