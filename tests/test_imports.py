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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports (at its top or in a function): a
    ``from package import name`` counts as an import of ``package.name`` where that is a module. A package's face
    (its ``__init__``) is left out of its own modules' imports: Python runs it first whatever they import."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update(
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                )
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph``: each a path that starts and ends at one module (depth-first search)."""
    found, done, path = [], set(), []

    def visit(module: str) -> None:
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return found


def test_no_module_of_the_package_imports_itself_round_a_circle():
    graph = import_graph()
    assert len(graph) > 100 and graph["batchspec.api"], "the graph was not read"
    assert circles(graph) == []


def test_the_circle_search_finds_a_loop():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def call_sites(name: str) -> list[str]:
    """``module:line`` of every call of a function called ``name`` in the package (``f(...)`` or ``x.f(...)``)."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called == name:
                    sites.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return sites


def call_files(name: str) -> list[str]:
    """The files (within the package) of :func:`call_sites`, in order, one per call."""
    return [site.split(":")[0] for site in call_sites(name)]


def test_each_load_setting_is_worked_out_in_one_place():
    """The device, the dtype, the quantize mode and the batch-invariant mode are resolved and checked in one place,
    ``load_settings``, which ``load_model``, ``load_pair`` and ``ModelChoice.load_settings`` call (the last for the
    run's one entry, ``batchspec.run.resolve_run``); the loaders below it take its record whole (issue 64)."""
    for name in ("resolve_device", "resolve_dtype", "check_quantize_for", "check_batch_invariant_for"):
        sites = call_sites(name)
        assert len(sites) == 1 and sites[0].startswith("models/loading.py"), (name, sites)
    assert call_files("load_settings") == ["models/choice.py", "models/loading.py", "models/loading.py", "run.py"]


def test_a_run_is_resolved_once_at_its_entry():
    """Every entry makes its run's record once (``batchspec.run``): the commands and Ray's actors from a model
    choice (``resolve_run``), ``batchspec.generate``, ``hf_generate`` and a server handed a pair from loaded models
    (``resolve_loaded``); the models load from it (``load_run``) and the engine is built from it (``build_run``),
    nowhere else (issue 64)."""
    assert call_files("resolve_run") == ["cli/bench.py", "cli/generate.py", "cli/serve.py", "ray.py"]
    assert call_files("resolve_loaded") == ["api.py", "hf.py", "server/app.py"]
    assert call_files("load_run") == ["cli/bench.py", "cli/generate.py", "cli/serve.py", "ray.py"]
    assert call_files("load_models") == ["run.py"]
    assert call_files("build_engine") == ["run.py"]
    assert call_files("build_run") == ["api.py", "server/app.py"]


def test_the_graph_mode_is_worked_out_in_one_place():
    """Whether the runner captures CUDA graphs is ``graph_mode``'s answer, asked only by ``runner_graphs``, which the
    run's entry calls once, before anything loads (a ``--cuda-graphs on`` the device cannot run fails first); the
    engine takes the answer and checks its models against it (issue 64)."""
    assert call_files("graph_mode") == ["engine/core.py"]
    assert call_files("runner_graphs") == ["run.py"]
    assert call_files("check_graphed") == ["engine/core.py", "engine/graphs.py"]


def test_whether_a_draft_model_drafts_is_answered_in_one_place():
    """``config.uses_draft_model`` answers it; the run's record (through ``SpecConfig.uses_draft_model``), the model
    choice (the target alone loads where none drafts) and the bench's plan ask it, and nothing else works it out."""
    assert call_files("uses_draft_model") == ["bench/runners.py", "config.py", "models/choice.py"]


def test_no_record_is_taken_apart_into_keywords_to_be_built_again():
    """No ``asdict`` or ``**`` of a settings record rebuilt into one (record -> dict -> record), inside the package:
    Ray's actors are handed their job whole (issue 64)."""
    own = ("self", "reference")  # a record writing itself out as JSON (cli/output.py, bench/reference.py, ...)
    taken_apart = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "asdict"
        and not (isinstance(node.args[0], ast.Name) and node.args[0].id in own)
    ]
    assert taken_apart == []
    assert call_files("options") == []
