"""Every script in the repository runs against the current package: each Python script's imports resolve (batchspec's
modules and the names taken from them; a sibling script; any other package installed, or a peer named below), and
every shell script parses (``bash -n``). Scripts that need a GPU or a peer's venv are checked for their imports only:
none is run here."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("docs/results/**/*.py")])
SHELL_SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("docs/results/**/*.sh"), ROOT / ".ci" / "run"])
# packages of the peers and devices some scripts drive, installed in their own venvs or machines, not in the tests'
PEERS = {"openvino", "openvino_genai", "optimum", "llama_cpp", "vllm"}


def imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names taken from it)`` of every import in the script, at any depth (relative imports excluded)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def unresolved(path: Path, module: str, names: tuple[str, ...]) -> list[str]:
    """What of one import does not resolve, as ``module`` or ``module.name``."""
    top = module.split(".")[0]
    if (path.parent / f"{top}.py").is_file() or top in PEERS:
        return []
    if top != "batchspec":
        return [] if importlib.util.find_spec(top) is not None else [module]
    try:
        loaded = importlib.import_module(module)
    except ImportError:
        return [module]
    package = hasattr(loaded, "__path__")  # a name may be a submodule of a package, not yet imported
    return [f"{module}.{name}" for name in names if name != "*" and not hasattr(loaded, name)
            and not (package and importlib.util.find_spec(f"{module}.{name}") is not None)]


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_script_imports_against_the_current_package(path):
    missing = [name for module, names in imports(path) for name in unresolved(path, module, names)]
    assert not missing, f"{path.relative_to(ROOT)} imports what does not exist: {missing}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this host")
@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_script_parses(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_script_that_imports_a_name_batchspec_lost_is_caught(tmp_path):
    """The check itself: a script importing a moved module, or a name its module no longer has, is named."""
    script = tmp_path / "old.py"
    script.write_text("from batchspec.int8 import Int8Forward\nfrom batchspec.memory import no_such_name\nimport os\n")
    found = [name for module, names in imports(script) for name in unresolved(script, module, names)]
    assert found == ["batchspec.int8", "batchspec.memory.no_such_name"]


def test_integer_peak_streams_build_and_run():
    """scripts/integer_peak.py's microbenchmark (scripts/integer_peak.c) builds with each SIMD x86 build's compiler
    and flags this CPU runs and runs every stream a few iterations on two threads; no timing is checked."""
    from batchspec.exact.integer import native

    spec = importlib.util.spec_from_file_location("integer_peak", ROOT / "scripts" / "integer_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    builds = [build for build in native.host_isas() if build in module.MACROS]
    if not builds or shutil.which(native._build_plan(builds[0])[0]) is None:
        pytest.skip("no SIMD x86 build or no C compiler here")
    for build in builds:
        with tempfile.TemporaryDirectory() as directory:
            library, _ = module.build_streams(build, directory)
            names = [library.peak_name(i).decode() for i in range(library.peak_count())]
            assert {"int8", "int4"} <= set(names)
            for i in range(library.peak_count()):
                assert library.peak_ops(i) > 0 and library.peak_run(i, 10, 2) >= 0.0


def test_draft_agreement_walks_an_answer_round_by_round():
    """scripts/draft_agreement.py's mean accepted length: a chain of k drafts from position t is accepted for the
    run of agreements from t (at most k), and the round gains the target's token too. Answer ``[T, T, F, T]``, k = 2:
    round 1 accepts 2 and gains 3 (positions 0-2), round 2 accepts 1 of the remaining 1 and gains 2: 4 tokens over 2
    rounds; with k = 1 the rounds gain positions 0-1, 2 and 3: 4 tokens over 3 rounds."""
    spec = importlib.util.spec_from_file_location("draft_agreement", ROOT / "scripts" / "draft_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    match = [True, True, False, True]
    assert module.runs(match) == [2, 1, 0, 1, 0]
    assert module.accepted_length([match], 2) == 2.0
    assert module.accepted_length([match], 1) == 4 / 3
    assert module.accepted_length([[False] * 5], 4) == 1.0


def test_planner_calibration_wraps_the_planner_as_the_engine_calls_it(monkeypatch):
    """scripts/planner_calibration.py wraps ``AdaptiveLength.lengths`` and ``observe``: called as the engine calls them
    (with ``draining`` and the round's ``cap``), the wrapped planner plans as before and the calibration keeps each
    tested draft. One row, a lookup of 2 drafts, the first accepted and the second not: two drafts kept, one
    accepted."""
    from batchspec.engine import draft_length
    from batchspec.engine.draft_length import AdaptiveLength, Reach, RoundRecord
    from batchspec.engine.state import Sequence

    monkeypatch.setattr(draft_length.AdaptiveLength, "lengths", draft_length.AdaptiveLength.lengths)
    monkeypatch.setattr(draft_length.AdaptiveLength, "observe", draft_length.AdaptiveLength.observe)
    spec = importlib.util.spec_from_file_location("planner_calibration", ROOT / "scripts" / "planner_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calibration = module.Calibration()
    calibration.install()
    planner = AdaptiveLength(max_k=4, draft_ratio=0.0)
    rows = [Sequence(0, [1, 2, 3], 10**9)]
    reach = Reach([2], uses_draft_model=False, first=[7])
    lengths = planner.lengths(rows, reach, False, draining=False, cap=None)
    assert lengths == [2]
    planner.observe(rows, RoundRecord(lengths, [1], [[True, True, True]], [None], 2, 0, 0.1))
    assert [(source, accepted) for source, _, _, accepted in calibration.drafts] == [("lookup", 1), ("lookup", 0)]


@pytest.mark.parametrize(("right", "rounds"), [(True, 2), (False, 8)], ids=["draft always right", "always wrong"])
def test_one_row_replay_walks_the_engines_rounds(right, rounds, monkeypatch):
    """scripts/one_row_replay.py at a fixed k = 3, a prompt and an 8-token answer that share no token (no lookup
    finds anything): where the draft's choice is always the answer's token, two rounds of 3 drafts and the target's
    token give the 8; where it is never, each round gains the target's token alone. Every forward of the target
    costs 1 s and the draft's nothing: 3 s against plain decoding's 9 (a prompt read and 8 steps), or 9 against 9.
    The default planner replays too, and drafts where the draft is always right."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    module = importlib.import_module("one_row_replay")
    answer = list(range(10, 18))
    cell = {"prompts": [list(range(1, 7))], "answers": [answer], "choices": [answer if right else [0] * 8]}
    widths = (1, 2, 4, 8, 16, 64, 128)
    costs = module.Costs.measured({"target": dict.fromkeys(widths, 1.0), "draft": dict.fromkeys(widths, 0.0)})
    data = {"draft_share": 0.0, "eos": 99, "max_new_tokens": 8}
    fixed = module.replay(cell, 3, costs, data)
    assert (fixed["rounds"], fixed["tokens"]) == (rounds, 8)
    assert fixed["seconds"] == pytest.approx(1 + rounds) and fixed["plain_s"] == pytest.approx(9)
    default = module.replay(cell, "auto", costs, data)
    assert default["tokens"] == 8 and (default["ratio"] > 1.5) == right
