"""Objects a flag names in the user's own code, as `module.path:NAME` or `path/to/file.py:NAME` (reward functions,
objectives): imported from the working directory first, as `python -m` would find it, or from the file."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from qlora_fsdp.errors import UserError


def load_object(entry: str, *, flag: str, kind: str = "object") -> Any:
    """The object `entry` names; any problem finding it is one line naming `flag` and `entry`."""
    where, _, name = entry.rpartition(":")
    if not where or not name:
        raise UserError(f"{flag} {entry}: expected module.path:{kind} or path/to/file.py:{kind}")
    try:
        module = _module(where, flag)
    except UserError:
        raise
    except Exception as exc:  # whatever the module's own code raises while it is imported
        raise UserError(f"{flag} {entry}: {where} does not import ({type(exc).__name__}: {exc})") from None
    found = getattr(module, name, None)
    if found is None:
        raise UserError(f"{flag} {entry}: {where} has no {kind} {name!r}")
    return found


def _module(where: str, flag: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"{flag} {where}: no such file")
        name = f"qlora_fsdp_user_{path.stem}"
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
            return sys.modules[name]  # one module object per file, however often a flag names it
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules[name]
            raise
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise UserError(f"{flag}: no module {where!r} (run from the directory that holds it, or give its file: "
                            "path/to/file.py:NAME)") from None  # fmt: skip
        raise
