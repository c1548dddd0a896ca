"""``batchspec bench-merge``: bench runs of one workload made in pieces, merged into one sweep."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from helpers import run_cli

from batchspec.bench import SweepPlan, run_sweep
from batchspec.bench.merge import merge_runs
from batchspec.bench.plots import _by_method


@pytest.fixture(scope="module")
def pieces(bench_tiny, tmp_path_factory):
    """Three runs sharing one reference: B = 1 at k = 3, B = 2 at k = 3, and eqspec at k = 2."""
    pair, workload = bench_tiny
    root = tmp_path_factory.mktemp("pieces")
    run_sweep(pair, workload, SweepPlan(("eqspec", "hf-assisted"), (1,)), root / "b1", progress=False)
    for name in ("b2", "k2"):
        (root / name).mkdir()
        shutil.copy(root / "b1" / "reference.json", root / name / "reference.json")
    run_sweep(pair, workload, SweepPlan(("eqspec", "exspec", "hf-generate"), (2,)), root / "b2", progress=False)
    shorter = dataclasses.replace(workload, num_draft_tokens=2)
    run_sweep(pair, shorter, SweepPlan(("eqspec",), (1, 2)), root / "k2", progress=False)
    return root


def test_merge_keeps_every_cell_and_the_audit(pieces, tmp_path):
    merged = merge_runs([pieces / "b1", pieces / "b2", pieces / "k2"], tmp_path)
    cells = [(c.method, c.batch_size, c.num_draft_tokens) for c in merged.cells]
    assert cells == [("eqspec", 1, 3), ("hf-assisted", 1, 3), ("eqspec", 2, 3), ("exspec", 2, 3),
                     ("hf-generate", 2, None), ("eqspec", 1, 2), ("eqspec", 2, 2)]
    assert [c["method"] for c in json.loads((tmp_path / "results.json").read_text())] == [c[0] for c in cells]
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["passed"] and [(c["method"], c["batch_size"], c["num_draft_tokens"]) for c in audit["cells"]] == cells
    table = (tmp_path / "results.md").read_text()
    assert "| method | proposer | B | k |" in table
    assert "| eqspec | draft | 1 | 2 |" in table and "| hf-generate | – | 2 | – |" in table
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in merged.plots)
    series = _by_method(merged.cells)
    assert set(series) == {"eqspec k=3", "eqspec k=2", "hf-assisted", "exspec", "hf-generate"}
    assert [c.batch_size for c in series["eqspec k=3"]] == [1, 2]


def test_merge_refuses_a_cell_measured_twice(pieces, tmp_path):
    with pytest.raises(ValueError, match=r"eqspec \(draft\) at batch size 1, k = 3 is in both .*b1 and .*b1"):
        merge_runs([pieces / "b1", pieces / "b1"], tmp_path)


def test_merge_refuses_other_workloads(pieces, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(pieces / "b2", other)
    rows = json.loads((other / "results.json").read_text())
    (other / "results.json").write_text(json.dumps([{**row, "dtype": "float32"} for row in rows]))
    with pytest.raises(ValueError, match="differ in dtype: 'float32' vs 'float64'"):
        merge_runs([pieces / "b1", other], tmp_path / "out")
    shutil.copy(pieces / "b2" / "results.json", other / "results.json")
    (other / "reference.json").write_text(json.dumps({"key": "another workload"}))
    with pytest.raises(ValueError, match="different references"):
        merge_runs([pieces / "b1", other], tmp_path / "out")


def test_merge_without_every_audit_writes_none(pieces, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(pieces / "b2", partial)
    (partial / "audit.json").unlink()
    merged = merge_runs([pieces / "b1", partial], tmp_path / "out")
    assert merged.audit is None and not (tmp_path / "out" / "audit.json").exists()
    assert len(merged.cells) == 5


def test_merge_refuses_audits_judged_differently(pieces, tmp_path):
    for name, change, message in (
        ("lenient", lambda audit: {**audit, "near_tie_ulps": 8.0}, r"different multiples: \[4.0, 8.0\] ulps"),
        ("old", lambda audit: {k: v for k, v in audit.items() if k != "near_tie_ulps"}, "old relative tolerance"),
    ):
        other = tmp_path / name
        shutil.copytree(pieces / "b2", other)
        (other / "audit.json").write_text(json.dumps(change(json.loads((other / "audit.json").read_text()))))
        with pytest.raises(ValueError, match=message):
            merge_runs([pieces / "b1", other], tmp_path / f"{name}-out")
        assert not (tmp_path / f"{name}-out").exists(), "nothing is written before the runs are checked"


def test_bench_merge_command(pieces, tmp_path):
    result = run_cli("bench-merge", str(pieces / "b1"), str(pieces / "k2"), "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "Merged 4 cells from 2 runs" in result.output and "| eqspec | draft | 2 | 2 |" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_cli("bench-merge", str(pieces / "b1"), str(empty), "-o", str(tmp_path / "out"))
    assert bad.exit_code == 1 and "holds no results.json" in bad.output and "Traceback" not in bad.output
    missing = run_cli("bench-merge", str(tmp_path / "nowhere"), "-o", str(tmp_path / "out"))
    assert missing.exit_code == 2 and "does not exist" in missing.output
