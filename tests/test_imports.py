"""Imports go one way: the CLI uses the library, the engine does not load the model loaders."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import batchspec

PACKAGE = Path(batchspec.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """The absolute module names ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_engine_loads_no_model_loading():
    """``batchspec.engine.core`` checks models beside it (``model_checks``); ``batchspec.models`` is loading only."""
    code = ("import sys, batchspec.engine.core; "
            "print(sorted(m for m in sys.modules if m.startswith('batchspec.models')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert run.stdout.strip() == "[]", run.stdout


def test_the_library_imports_nothing_of_the_cli():
    """Not even inside a function, where an import cycle hides from a look at the modules' heads."""
    cli = {"cli", "__main__.py"}
    library = [path for path in PACKAGE.rglob("*.py") if not cli & set(path.relative_to(PACKAGE).parts)]
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path) if m.startswith("batchspec.cli"))
        for path in library
    }
    assert library and not {path: names for path, names in offenders.items() if names}


def test_outside_the_engine_only_its_face_is_imported():
    """``batchspec.engine`` exports what the rest uses; its modules can move and split inside without a change
    outside, because nothing outside names them."""
    engine = PACKAGE / "engine"
    outside = [path for path in PACKAGE.rglob("*.py") if engine not in path.parents]
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path) if m.startswith("batchspec.engine."))
        for path in outside
    }
    assert outside and not {path: names for path, names in offenders.items() if names}
