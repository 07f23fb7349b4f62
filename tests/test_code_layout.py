"""The layout rules of docs/design.md, checked on the source (issue 34's acceptance):

- no function over 60 lines and no source file over 500 lines in ``packages/*/src`` and
  ``tools/src`` (a def's length counts its decorators and docstring: ``end_lineno - lineno + 1``);
- ``import olmo_model`` loads neither yaml, rich, fsspec nor matplotlib (the model, not the run);
- neither trainer package (src, tests, bench) imports the other; code that runs both frameworks
  lives in ``tools/`` and the root ``tests/``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def _sources() -> list[Path]:
    return sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("tools/src/**/*.py")])


def test_no_function_or_source_file_over_the_size_limits():
    too_long = []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - start + 1} lines")
    assert len(_sources()) > 100  # the globs found the sources
    assert too_long == []


def test_import_olmo_model_loads_no_run_or_storage_library():
    code = (
        "import sys, olmo_model; print(sorted(m for m in ('yaml', 'rich', 'fsspec', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "other"), [("olmo-train-jax", "olmo_train_torch"), ("olmo-train-torch", "olmo_train_jax")]
)
def test_neither_trainer_package_imports_the_other(package, other):
    files = sorted((ROOT / "packages" / package).rglob("*.py"))
    assert len(files) > 10
    assert [str(f.relative_to(ROOT)) for f in files if other in _imported_modules(f)] == []
