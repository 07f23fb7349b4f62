"""Reading the YAML files a run is configured by (a recipe, a model spec): whatever is wrong with
the file (missing, a folder, unreadable, not UTF-8, a syntax error, a key given twice) is one
line naming the file, the line and the fix, raised as the caller's error type.

(olmo_data reads mixture files the same way, through its own storage layer: the two packages
do not depend on each other.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """Safe YAML that refuses a mapping key given twice: PyYAML keeps the last one silently,
    so a second ``train:`` section would drop the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a non-scalar key is refused by SafeLoader itself; `<<` merges may repeat
            key = self.construct_object(key_node)
            if key in first_line:
                raise _DuplicateKey(
                    None, None, f"key {key!r} is given twice (first on line {first_line[key] + 1})", key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, source: str, error: type[Exception], fix: str = "fix the file there") -> Any:
    """``text`` parsed as safe YAML with unique keys; a syntax error is ``error``:
    ``SOURCE: not valid YAML at line L, column C (what is wrong); FIX``."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if isinstance(err, _DuplicateKey):
            raise error(f"{source}{where.replace(' at', ':', 1)}: {problem}; keep one of them") from None
        raise error(f"{source}: not valid YAML{where} ({problem}); {fix}") from None


def read_yaml(path: str | Path, error: type[Exception], what: str) -> Any:
    """The parsed YAML file ``path`` (``what`` names it in messages: "recipe file"); any problem
    reading or parsing it is ``error`` with one line."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{p}: {what} not found; check the path") from None
    except IsADirectoryError:
        raise error(f"{p}: is a folder, not a {what}; name the YAML file inside it") from None
    except PermissionError:
        raise error(f"{p}: permission denied reading the {what}; fix its permissions (chmod a+r) or the path") from None
    except OSError as err:
        raise error(f"{p}: cannot read the {what} ({err.strerror or err}); check the file and the disk") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise error(
            f"{p}: not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); save the {what} as UTF-8 YAML"
        ) from None
    return parse_yaml(text, str(p), error)
