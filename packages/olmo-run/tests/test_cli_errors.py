"""Bad input through the trainers' shared command line (`run_cli`): every way a recipe, a command
line override or a mixture file can be wrong ends in exactly one line on stderr naming the file
(or the command line) and the fix, with exit status 2, never a traceback.

Recipe cases stop at ``--print-recipe``; mixture cases run the driver's real start-up checks
(`read_inputs` and `resolve_run`, where a trainer opens its mixture) with a numpy stand-in for the trainer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixture_support import two_source_mixture

from olmo_run import read_inputs, resolve_run
from olmo_run.cli import INPUT_ERRORS, run_cli

PROG = "olmo-train-test"


def _train():
    return lambda recipe: resolve_run(read_inputs(recipe), "numpy")


def cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    status = run_cli(PROG, None, argv, _train, INPUT_ERRORS)
    return status, capsys.readouterr().err.splitlines()


def one_line_error(argv: list[str], capsys, *named: str) -> str:
    status, lines = cli(argv, capsys)
    assert status == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"{PROG}: error: "), line
    for text in named:
        assert text in line, f"{text!r} not in {line!r}"
    return line


def refuse_reads(monkeypatch, path: Path) -> None:
    """Reading ``path`` fails as it does for a file without read permission (the tests run as
    root in CI, where chmod 000 does not stop a read)."""
    read_bytes = Path.read_bytes

    def denied(self: Path) -> bytes:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", denied)


# ---- the recipe file --------------------------------------------------------------------------

# (case, recipe bytes, what the line must say besides the file's path)
RECIPES: list[tuple[str, bytes, tuple[str, ...]]] = [
    (
        "syntax error",
        b"model: small\ntrain:\n  steps: 3\n   bad: [\n",
        ("not valid YAML at line 4, column 7", "fix the file there"),
    ),
    ("tab indentation", b"train:\n\tsteps: 3\n", ("not valid YAML at line 2, column 1", "'\\t'")),
    ("undefined alias", b"train:\n  steps: *n\n", ("not valid YAML at line 2", "undefined alias 'n'")),
    ("python tag", b"model: !!python/object:os.system {}\n", ("not valid YAML at line 1", "constructor")),
    ("not UTF-8", b"model: small\nname: caf\xe9\n", ("not UTF-8 text (byte 0xe9 on line 2)", "save the recipe")),
    ("utf-16", "model: small\n".encode("utf-16"), ("not UTF-8 text", "save the recipe file as UTF-8")),
    ("empty", b"", ("holds no keys", "name no recipe to run the defaults")),
    ("comments only", b"# train:\n#   steps: 3\n", ("holds no keys",)),
    ("a list", b"- model\n- data\n", ("must be a mapping of sections", "not a list")),
    ("a scalar", b"small\n", ("must be a mapping of sections", "not a str")),
    (
        "duplicate section",
        b"train:\n  steps: 3\ntrain:\n  tokens: 4096\n",
        ("line 3, column 1: key 'train' is given twice (first on line 1); keep one",),
    ),
    ("duplicate key", b"optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", ("line 3, column 3: key 'lr' is given twice",)),
    ("wrong type", b"train:\n  steps: many\n", ("key 'train.steps'", "valid integer", "'many'")),
    ("section as a scalar", b"train: 5\n", ("key 'train'", "TrainSection")),
    ("unknown key", b"trian:\n  steps: 3\n", ("unknown recipe key 'trian'", "did you mean 'train'")),
]


@pytest.mark.parametrize("content,named", [pytest.param(c, n, id=case) for case, c, n in RECIPES])
def test_a_bad_recipe_file_is_one_line_naming_it(tmp_path, capsys, content, named):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    one_line_error([str(recipe), "--print-recipe"], capsys, f"{recipe}: ", *named)


def test_a_recipe_path_that_is_missing_a_folder_or_unreadable(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope.yaml"
    one_line_error([str(missing), "--print-recipe"], capsys, f"{missing}: recipe file not found; check the path")
    one_line_error([str(tmp_path), "--print-recipe"], capsys, f"{tmp_path}: is a folder, not a recipe file")
    locked = tmp_path / "locked.yaml"
    locked.write_text("model: small\n")
    refuse_reads(monkeypatch, locked)
    one_line_error([str(locked), "--print-recipe"], capsys, f"{locked}: permission denied", "fix its permissions")


@pytest.mark.parametrize(
    "content,named",
    [
        pytest.param(b"d_model: [\n", ("not valid YAML at line 2",), id="syntax error"),
        pytest.param(b"n_layers: 2\nn_layers: 3\n", ("line 2, column 1: key 'n_layers' is given twice",), id="dup"),
        pytest.param(b"\xff\xfe", ("not UTF-8 text (byte 0xff on line 1)",), id="not UTF-8"),
    ],
)
def test_a_bad_model_spec_file_named_by_a_recipe_is_one_line_naming_it(tmp_path, capsys, content, named):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    one_line_error(["--print-recipe", f"--model={spec}"], capsys, f"{spec}: ", *named)


def test_a_model_spec_path_that_is_a_folder(tmp_path, capsys):
    one_line_error(["--print-recipe", f"--model={tmp_path}"], capsys, f"{tmp_path}: is a folder, not a spec file")


# ---- command line overrides --------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,named",
    [
        pytest.param(
            ["--train.steps"], ("override '--train.steps' has no value; write --train.steps=VALUE",), id="last"
        ),
        # the next argument is another override, not this one's value (run_dir would be "--train.steps=3")
        pytest.param(["--run_dir", "--train.steps=3"], ("override '--run_dir' has no value",), id="before-another"),
        pytest.param(["--train.steps=["], ("override --train.steps=[: not valid YAML", "YAML quotes"), id="syntax"),
        pytest.param(["--optim.lr=@x"], ("override --optim.lr=@x: not valid YAML", "'@'"), id="bad-char"),
        pytest.param(["--jax.mesh={data: 1, data: 2}"], ("key 'data' is given twice",), id="duplicate"),
        pytest.param(["--train.steps=many"], ("key 'train.steps'", "valid integer", "'many'"), id="wrong-type"),
        pytest.param(["--train.stpes=3"], ("unknown recipe key 'train.stpes'; did you mean 'train.steps'",), id="typo"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_command_line(tmp_path, capsys, args, named):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  steps: 3\n")
    # the error is the command line's, not the recipe file's, though a file was given
    one_line_error([str(recipe), "--print-recipe", *args], capsys, f"{PROG}: error: command line", *named)


# ---- the mixture file (the driver's start-up checks) ------------------------------------------


@pytest.fixture
def mixture(tmp_path) -> Path:
    return two_source_mixture(tmp_path / "data")


def run_args(tmp_path: Path, mixture: Path | str) -> list[str]:
    return [f"--data.mixture={mixture}", f"--run_dir={tmp_path / 'run'}", "--train.global_batch_tokens=256"]


def test_the_good_mixture_passes_the_start_up_checks(tmp_path, capsys, mixture):
    status, lines = cli(run_args(tmp_path, mixture), capsys)
    assert status == 0 and lines == []


# (case, edit of the good mixture's text -> bytes, what the line must say besides the file's path)
MIXTURES: list[tuple[str, Callable[[str], bytes], tuple[str, ...]]] = [
    (
        "syntax error",
        lambda text: text.replace("seed: 1234\n", "seed: 1234\n  bad: [\n").encode(),
        ("not valid YAML at line 4", "fix the file there"),
    ),
    ("not UTF-8", lambda text: b"\xff" + text.encode(), ("not UTF-8 text (byte 0xff on line 1)", "as UTF-8 YAML")),
    ("empty", lambda text: b"", ("must be a YAML mapping", "got nothing (an empty file)")),
    ("a list", lambda text: b"- code\n- prose\n", ("must be a YAML mapping", "got a list")),
    (
        "duplicate key",
        lambda text: (text + "seed: 7\n").encode(),
        ("key 'seed' is given twice (first on line 3); keep one",),
    ),
    ("wrong type", lambda text: text.replace("seed: 1234", "seed: many").encode(), ("seed: ", "valid integer")),
]


@pytest.mark.parametrize("edit,named", [pytest.param(e, n, id=case) for case, e, n in MIXTURES])
def test_a_bad_mixture_file_is_one_line_naming_it(tmp_path, capsys, mixture, edit, named):
    mixture.write_bytes(edit(mixture.read_text()))
    one_line_error(run_args(tmp_path, mixture), capsys, f"{mixture}: ", *named)


def test_a_mixture_path_that_is_a_folder_names_the_yaml_inside(tmp_path, capsys, mixture):
    folder = mixture.parent
    one_line_error(
        run_args(tmp_path, folder),
        capsys,
        f"{folder}: is a folder, not a mixture file; name the mixture YAML in it (mixture.yaml there)",
    )


def test_a_mixture_named_by_a_recipe_that_is_a_folder(tmp_path, capsys, mixture):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  mixture: data\n")  # relative to the recipe: the folder, not the YAML
    args = [str(recipe), *run_args(tmp_path, mixture)[1:]]
    one_line_error(args, capsys, f"{mixture.parent}: is a folder, not a mixture file")


def test_an_unreadable_mixture_file(tmp_path, capsys, mixture, monkeypatch):
    refuse_reads(monkeypatch, mixture)
    one_line_error(run_args(tmp_path, mixture), capsys, f"{mixture}: permission denied", "fix the file's permissions")


def test_a_missing_mixture_file(tmp_path, capsys, mixture):
    missing = mixture.parent / "nope.yaml"
    one_line_error(run_args(tmp_path, missing), capsys, f"{missing}: mixture file not found; check the path")


@pytest.mark.parametrize(
    "paths,named",
    [
        pytest.param("[empty]", ("empty: directory holds no *.npy file",), id="empty folder"),
        pytest.param("[nowhere/*.npy]", ("nowhere/*.npy: glob matches no file",), id="glob matches nothing"),
        pytest.param("[gone.npy]", ("gone.npy: file not found",), id="missing file"),
    ],
)
def test_a_bad_source_path_is_one_line_naming_the_mixture_and_the_field(tmp_path, capsys, mixture, paths, named):
    (mixture.parent / "empty").mkdir()
    mixture.write_text(mixture.read_text().replace("- code/a.npy", f"- {paths[1:-1]}"))
    one_line_error(run_args(tmp_path, mixture), capsys, f"{mixture}: sources.0.paths (code): ", *named)


def test_a_source_path_that_is_a_folder_of_token_files_is_read(tmp_path, capsys, mixture):
    # not an error: a folder names the token files in it
    mixture.write_text(mixture.read_text().replace("- code/a.npy", "- code"))
    status, lines = cli(run_args(tmp_path, mixture), capsys)
    assert status == 0 and lines == []


def test_help_lists_every_exit_status_the_cli_returns(capsys):
    """--help's table (olmo_run.cli.EXIT_STATUSES) names each status run_cli can return: the
    statuses written in the code, not a copy of the table."""
    import re

    from olmo_run.cli import EXIT_STATUSES, EXIT_WRITE_FAILED, run_cli
    from olmo_run.preempt import EXIT_PREEMPTED

    listed = {int(n) for n in re.findall(r"^  (\d+)  ", EXIT_STATUSES, re.M)}
    assert listed == {0, 1, 2, 3, EXIT_PREEMPTED, EXIT_WRITE_FAILED}
    assert run_cli("olmo-train-x", "doc", ["--help"], lambda: lambda recipe: None, ()) == 0
    assert EXIT_STATUSES in capsys.readouterr().out


def test_help_lists_print_recipe_and_dry_run_with_the_device_kinds(capsys):
    """--help names the flags run_cli reads besides the recipe keys, each device kind a dry run
    takes (olmo_model.PEAKS), and comes before the exit statuses; --print-recipe does what it says."""
    from olmo_model import PEAKS
    from olmo_run.cli import run_cli

    assert run_cli("olmo-train-x", "doc", ["--help"], lambda: lambda recipe: None, ()) == 0
    out = capsys.readouterr().out
    assert "\n  --print-recipe    print the resolved recipe" in out
    assert "\n  --dry-run --devices KIND:COUNT [--json]\n" in out
    assert "KIND: h100, h200, b200, b300, a100, v5p, v6e, tpu7x (olmo_model.PEAKS" in out
    assert len(PEAKS) == 8
    assert out.index("Options:") < out.index("Exit statuses:") < out.index("--train.steps")
    assert run_cli("olmo-train-x", "doc", ["--print-recipe", "--train.steps=7"], lambda: lambda recipe: None, ()) == 0
    assert "\n  steps: 7\n" in capsys.readouterr().out
