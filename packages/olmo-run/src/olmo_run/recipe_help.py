"""Every recipe key with its type, default and meaning, for ``--help`` (torchtitan's habit of a
help that lists each option).

The meaning is the one-line comment written beside each field in ``recipe.py`` (or the comment
block just above it): the schema stays the single place a default and its reason are written,
and this module reads them from the source rather than keeping a second copy.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import textwrap
import tokenize
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel

from .recipe import Recipe


@dataclass(frozen=True)
class RecipeKey:
    key: str  # dotted, as an override writes it
    type: str
    default: Any
    comment: str


@cache
def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its trailing comment, or the comment lines directly above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line -> comment text
    standalone: set[int] = set()  # lines that hold only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                standalone.add(tok.start[0])
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        if end in comments:
            out[node.target.id] = comments[end]
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in standalone:
            above.insert(0, comments[line])
            line -= 1
        out[node.target.id] = " ".join(above)
    return out


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def recipe_keys(section: BaseModel | None = None, prefix: str = "") -> list[RecipeKey]:
    """Every leaf key of the recipe schema with the default recipe's value, in schema order. A
    section is expanded by the class of its default, so the schedule lists the default kind's keys."""
    section = Recipe() if section is None else section
    comments: dict[str, str] = {}
    for cls in reversed(type(section).__mro__):  # a field inherited from a base class keeps its comment
        if cls.__module__.startswith(("olmo_model.", "olmo_run.")) and issubclass(cls, BaseModel):
            comments.update(_field_comments(cls))
    dumped = section.model_dump(mode="json")  # defaults as a recipe file or override writes them
    keys: list[RecipeKey] = []
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            keys.extend(recipe_keys(value, f"{prefix}{name}."))
            continue
        keys.append(RecipeKey(f"{prefix}{name}", _type_name(info.annotation), dumped[name], comments.get(name, "")))
    return keys


def recipe_help() -> str:
    """The keys as text lines: ``--key=DEFAULT  (type)  meaning``."""
    lines = ["recipe keys (override any with --key=value; defaults shown):"]
    for k in recipe_keys():
        default = k.default if isinstance(k.default, str) else json.dumps(k.default)
        lines.append(f"  --{k.key}={default}  ({k.type})" + (f"  {k.comment}" if k.comment else ""))
    return "\n".join(lines)
