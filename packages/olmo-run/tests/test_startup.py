"""The one start-up order (``olmo_run.startup.start``) with a numpy trainer: its hooks are called
in that order, a recipe check that needs no process group stops the run before distributed init,
and an input that cannot be read is raised after it (where processes stop together), with
nothing written either way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from olmo_data import DataError
from olmo_run import Processes, RunSetup, Trainer, start
from olmo_run.recipe import RecipeError
from olmo_run.startup import Inputs

# test_driver.py's numpy module, mixture and recipe (importlib mode puts no test folder on sys.path).
_spec = importlib.util.spec_from_file_location("olmo_run_test_driver", Path(__file__).with_name("test_driver.py"))
assert _spec is not None and _spec.loader is not None
driver_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver_tests)


class NumpyTrainer(Trainer):
    framework = "numpy"
    prog = "olmo-train-numpy"

    def __init__(self, refuse: bool = False):
        self.calls: list[str] = []
        self.refuse = refuse

    def check(self, inputs: Inputs) -> None:
        self.calls.append("check")
        if self.refuse:
            raise RecipeError("the launched world cannot run this layout")

    def init_distributed(self) -> Processes:
        self.calls.append("init_distributed")
        return Processes(0, 1, lambda text: [text], line="process 0 of 1")

    def data_parallel(self, inputs: Inputs) -> tuple[tuple[int, ...], int]:
        self.calls.append("data_parallel")
        return (0, 1), 2

    def load_init(self, setup: RunSetup) -> None:
        self.calls.append("load_init")

    def build_module(self, setup: RunSetup):
        self.calls.append("build_module")
        return driver_tests.NumpyModule(setup, [])


@pytest.fixture
def mixture(tmp_path) -> Path:
    (tmp_path / "mix").mkdir()
    return driver_tests.write_mixture(tmp_path / "mix")


def test_the_hooks_in_one_order_then_already_complete(mixture, tmp_path, capsys, monkeypatch):
    from olmo_run import loop

    monkeypatch.setattr(loop, "device_peak", lambda kind, matmul: (1e12, "test peak"))
    recipe = driver_tests.recipe_for(mixture, tmp_path / "run")
    trainer = NumpyTrainer()
    assert start(recipe, trainer) == tmp_path / "run"
    assert trainer.calls == ["check", "init_distributed", "data_parallel", "load_init", "build_module"]
    out = capsys.readouterr().out
    assert out.startswith("# resolved recipe\n") and "\nprocess 0 of 1\n" in out
    again = NumpyTrainer()
    start(recipe, again)
    assert again.calls == ["check", "init_distributed", "data_parallel", "load_init"]
    assert "already complete (checkpoint at step 6 of 6); nothing to do" in capsys.readouterr().out


def test_a_check_stops_before_init_and_an_unreadable_input_after_it(mixture, tmp_path):
    trainer = NumpyTrainer(refuse=True)
    with pytest.raises(RecipeError, match="launched world"):
        start(driver_tests.recipe_for(mixture, tmp_path / "run"), trainer)
    assert trainer.calls == ["check"]
    trainer = NumpyTrainer()
    with pytest.raises(DataError, match="missing.yaml"):
        start(driver_tests.recipe_for(tmp_path / "missing.yaml", tmp_path / "run"), trainer)
    assert trainer.calls == ["init_distributed"]  # no check without inputs; raised once joined
    assert not (tmp_path / "run").exists()
