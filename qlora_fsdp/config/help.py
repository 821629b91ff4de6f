"""Help text of every flag, read from the docstring under each config field: `--help`, docs/options.md, the scripts.

Kept out of `config.py`: only `--help` and the docs need the source parsed.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from dataclasses import fields
from typing import Any

from qlora_fsdp.config.options import SECTIONS


def field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a config dataclass: the help text of its flags."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in itertools.pairwise(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            # One line: a wrapped docstring would break the option table of docs/options.md.
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[attr-defined]
    return docs


def option_docs() -> list[tuple[str, str, Any, str]]:
    """(section, flag, default, one-line meaning) for every option, read from the field docstrings."""
    rows = []
    for section_name, cls in SECTIONS.items():
        docs = field_docs(cls)
        defaults = cls()
        for f in fields(cls):
            rows.append((section_name, f.name, getattr(defaults, f.name), docs.get(f.name, "")))
    return rows
