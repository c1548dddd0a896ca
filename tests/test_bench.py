"""``batchspec bench`` and ``batchspec audit`` on tiny float64 models: fields, consistency, broken methods."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch
from helpers import run_cli

from batchspec.bench import SweepPlan, Workload, run_audit, run_sweep
from batchspec.bench import runners as bench_runners
from batchspec.bench.audit import NEAR_TIE_ULPS, NearTieRule, spacing
from batchspec.bench.cells import Cell
from batchspec.bench.costs import weight_bytes
from batchspec.bench.reference import first_divergence, match_summary
from batchspec.bench.runners import RunOutput, cut_after_eos
from batchspec.models import ModelPair

FIELDS = {
    "method", "proposer", "batch_size", "model", "dtype", "kernels", "prompts", "max_new_tokens", "num_draft_tokens",
    "torch_threads", "machine", "tokens_per_s", "wall_s", "generated_tokens", "acceptance_rate",
    "mean_accepted_length", "recomputed_columns", "cached_tokens", "prefill_s", "draft_s", "verify_s", "realign_s",
    "other_s",
    "prefill_share", "draft_share", "verify_share", "realign_share", "other_share", "grouping_rate", "exact_match",
    "partial_match", "device", "quantize", "target_gb", "read_gb_per_s",
}


def test_sweep_writes_consistent_cells(bench_tiny, tmp_path, reference):
    pair, workload = bench_tiny
    methods = ("autoregressive", "eqspec", "exspec", "hf-generate", "hf-assisted", "hf-prompt-lookup")
    plan = SweepPlan(methods, (1, 3), proposers=("draft", "ngram"))
    result = run_sweep(pair, workload, plan, tmp_path, progress=False)
    assert result.skipped == [("hf-assisted", None, 3), ("hf-prompt-lookup", None, 3)]
    cells = json.loads((tmp_path / "results.json").read_text())
    assert len(cells) == 2 + 4 + 4 + 2 + 1 + 1 and all(set(c) == FIELDS for c in cells)
    assert {(c["method"], c["proposer"]) for c in cells if c["method"] in ("eqspec", "exspec")} == {
        (m, p) for m in ("eqspec", "exspec") for p in ("draft", "ngram")
    }
    refs = [reference(pair.target, list(p), 12, workload.eos_token_ids[0]) for p in workload.prompts]
    for cell in cells:
        assert cell["exact_match"] == 1.0 and cell["partial_match"] == 1.0, cell
        assert cell["generated_tokens"] == sum(len(r) for r in refs)
        assert cell["tokens_per_s"] == pytest.approx(cell["generated_tokens"] / cell["wall_s"])
        if cell["method"].startswith("hf-"):
            assert cell["draft_s"] is None and cell["acceptance_rate"] is None and cell["grouping_rate"] is None
            continue
        shares = [cell[f"{s}_share"] for s in ("prefill", "draft", "verify", "realign", "other")]
        assert sum(shares) == pytest.approx(1.0, abs=0.1)
        assert cell["target_gb"] == pytest.approx(weight_bytes(pair.target) / 1e9) and cell["read_gb_per_s"] > 0
        assert cell["recomputed_columns"] == 0
        assert (cell["grouping_rate"] is None) == (cell["method"] != "exspec")
        assert (cell["acceptance_rate"] is None) == (cell["method"] == "autoregressive")
    with (tmp_path / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(cells)
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["passed"] and [(c["method"], c["proposer"], c["batch_size"]) for c in audit["cells"]] == [
        (c["method"], c["proposer"], c["batch_size"]) for c in cells
    ]
    assert all(c["exact_match"] == 1.0 and c["divergences"] == [] for c in audit["cells"])
    assert "| eqspec | ngram | 3 | 3 |" in (tmp_path / "results.md").read_text()
    for name in ("throughput.png", "anatomy.png", "grouping.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_interrupted_sweep_keeps_finished_cells(bench_tiny, tmp_path, monkeypatch):
    pair, workload = bench_tiny
    calls = {"n": 0}
    real = bench_runners.RUNNERS["eqspec"]

    def flaky(pair_, workload_, batch_size, progress=False, proposer=None):
        calls["n"] += 1
        if calls["n"] > 2 and len(workload_.prompts) > 1:  # after the warm-up and one measured cell
            raise KeyboardInterrupt
        return real(pair_, workload_, batch_size, progress, proposer)

    monkeypatch.setitem(bench_runners.RUNNERS, "eqspec", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(pair, workload, SweepPlan(("eqspec",), (1, 2, 4), compare=False), tmp_path, progress=False)
    cells = json.loads((tmp_path / "results.json").read_text())
    assert [(c["method"], c["batch_size"]) for c in cells] == [("eqspec", 1)]
    assert not (tmp_path / "audit.json").exists()  # nothing compared


def _right_padded_without_mask(
    pair: ModelPair, workload: Workload, batch_size: int, progress=False, proposer=None
) -> RunOutput:
    """A broken batch method: right padding and no attention mask, the classic ragged-batch bug."""
    sequences = []
    for start in range(0, len(workload.prompts), batch_size):
        chunk = workload.prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), workload.pad_token_id)
        for i, prompt in enumerate(chunk):
            ids[i, : len(prompt)] = torch.tensor(prompt)
        rows = [list(p) for p in chunk]
        for _ in range(workload.max_new_tokens):
            logits = pair.target(ids).logits  # [B, L, V], every row reads its last column, padded or not
            nxt = logits[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            for row, token in zip(rows, nxt.tolist(), strict=True):
                row.append(token)
        sequences += [cut_after_eos(r[len(p) :], workload.eos_token_ids) for r, p in zip(rows, chunk, strict=True)]
    return RunOutput(sequences, None, 1.0)


def test_audit_passes_batchspec_and_catches_a_broken_method(bench_tiny, tmp_path, monkeypatch):
    pair, workload = bench_tiny
    monkeypatch.setitem(bench_runners.RUNNERS, "broken", _right_padded_without_mask)
    report = run_audit(pair, workload, ("eqspec", "exspec", "broken"), (1, 3), out_dir=tmp_path, progress=False)
    cells = {(c.method, c.batch_size): c for c in report.cells}
    for method in ("eqspec", "exspec"):
        for size in (1, 3):
            assert cells[(method, size)].exact_match == 1.0 and not cells[(method, size)].divergences
    broken = cells[("broken", 3)]
    assert broken.exact_match < 1.0 and broken.failures
    assert all(d.margin_ulps > NEAR_TIE_ULPS and not d.near_tie for d in broken.failures)
    assert cells[("broken", 1)].exact_match == 1.0  # a single row has no padding to get wrong
    assert not report.passed
    stored = json.loads((tmp_path / "audit.json").read_text())
    assert stored["passed"] is False and len(stored["cells"]) == 6
    assert stored["dtype"] == "float64" and stored["near_tie_ulps"] == NEAR_TIE_ULPS
    assert "spacing" in stored["near_tie_rule"] and "mantissa bits" in stored["near_tie_rule"]
    divergence = next(c for c in stored["cells"] if c["method"] == "broken" and c["batch_size"] == 3)["divergences"][0]
    assert set(divergence) == {
        "prompt", "position", "expected", "got", "top_logit", "margin", "margin_ulps", "near_tie"
    }
    assert divergence["margin_ulps"] == divergence["margin"] / spacing(divergence["top_logit"], torch.float64)
    lenient = run_audit(pair, workload, ("broken",), (3,), rule=NearTieRule(ulps=1e300), progress=False)
    assert lenient.passed and lenient.cells[0].divergences and lenient.near_tie_ulps == 1e300


def test_match_metrics():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    summary = match_summary([[1, 2, 3, 4], [1, 9, 9, 9], [7]], [[1, 2, 3, 4], [1, 2, 3, 4], [7]])
    assert summary.exact_match == pytest.approx(2 / 3)
    assert summary.partial_match == pytest.approx((1 + 0.25 + 1) / 3)


def test_sweep_plan_validation():
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        SweepPlan(("fast",), (1,))
    with pytest.raises(ValueError, match="batch sizes must be integers >= 1"):
        SweepPlan(("eqspec",), (0,))
    assert Cell.__dataclass_fields__.keys() == FIELDS


def test_bench_and_audit_commands_record_the_resolved_dtype(tiny_dirs, tmp_path):
    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft")]  # --dtype auto
    common = [*models, "--quantize", "none", "--prompts", str(tiny_dirs / "prompts.txt"), "--max-new-tokens", "6",
              "-k", "2"]
    result = run_cli("bench", *common, "--methods", "eqspec,hf-generate", "--batch-sizes", "1,2", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert [cell["dtype"] for cell in json.loads((tmp_path / "results.json").read_text())] == ["float32"] * 4
    assert json.loads((tmp_path / "audit.json").read_text())["dtype"] == "float32"
    assert f"Bench of {tiny_dirs / 'target'} + {tiny_dirs / 'draft'} (float32), 3 prompts" in result.stdout
    result = run_cli("audit", *common, "--methods", "eqspec,exspec", "--batch-sizes", "1,3", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["passed"] and audit["dtype"] == "float32" and audit["near_tie_ulps"] == NEAR_TIE_ULPS
    assert "PASSED" in result.output
    assert "(float32), 3 prompts; near-tie: reference margin at most 4 ulps of float32" in result.output
    assert "eqspec/draft       B=1   k=2    exact 100.0%" in result.output


def test_audit_near_tie_multiple_is_checked(tiny_dirs, tmp_path):
    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft")]
    for value in ("-1", "nan"):
        refused = run_cli("audit", *models, "--near-tie-ulps", value, "-o", str(tmp_path))
        assert refused.exit_code == 2 and "Invalid value for '--near-tie-ulps'" in refused.output
    infinite = run_cli("audit", *models, "--near-tie-ulps", "inf", "-o", str(tmp_path))
    assert infinite.exit_code == 1
    assert "Error: the near-tie multiple must be a finite number >= 0; got inf" in infinite.output
    help_text = " ".join(run_cli("audit", "--help").output.split())
    assert "--near-tie-ulps" in help_text and "mantissa bits" in help_text and "default 4" in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "eqspec,warp"], "--methods: unknown method warp"),
        (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
        (["--batch-sizes", "0"], "--batch-sizes must be integers >= 1"),
        (["--prompts", "/no/such/file.txt"], "neither 'humaneval' nor an existing file"),
    ],
)
@pytest.mark.parametrize("command", ["bench", "audit"])
def test_command_errors_are_one_line(command, args, message, tiny_dirs, tmp_path):
    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft")]
    result = run_cli(command, *models, "--prompts", str(tiny_dirs / "prompts.txt"), *args, "-o", str(tmp_path))
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


def test_bench_online_writes_latency_percentiles(tiny_dirs, tmp_path):
    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"), "--dtype", "float32"]
    result = run_cli(
        "bench", *models, "--prompts", str(tiny_dirs / "prompts.txt"), "--max-new-tokens", "4", "--online",
        "--rate", "50", "--requests", "4", "--methods", "eqspec,exspec", "--batch-sizes", "2", "-o", str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    online = json.loads((tmp_path / "online.json").read_text())
    assert [r["method"] for r in online["results"]] == ["eqspec", "exspec"]
    for run in online["results"]:
        assert run["requests"] == 4 and run["failed"] == 0
        assert run["latency_s"]["p50"] <= run["latency_s"]["p99"]
    bad = run_cli("bench", *models, "--prompts", str(tiny_dirs / "prompts.txt"), "--online", "--methods", "hf-generate",
                  "-o", str(tmp_path))
    assert bad.exit_code == 1 and "--online serves eqspec, exspec, autoregressive only" in bad.output


def test_hf_assisted_drafts_exactly_k_tokens_per_round(bench_tiny):
    """transformers reads the draft length from the assistant's generation config, not from generate()'s
    arguments; left at its defaults it drafts up to 20 tokens per round and adapts, which is another method."""
    pair, workload = bench_tiny
    workload = dataclasses.replace(workload, prompts=tuple(p for p in workload.prompts if len(p) >= 14))
    assert workload.prompts
    before = pair.draft.generation_config.to_dict()
    widths = []
    handle = pair.target.register_forward_hook(
        lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        bench_runners.run_hf_assisted(pair, workload, 1)
    finally:
        handle.remove()
    verify = [w for w in widths if w < 14]  # prefills read a whole prompt (>= 14 tokens); the rest verify
    assert verify and max(verify) == workload.num_draft_tokens + 1
    assert pair.draft.generation_config.to_dict() == before  # the draft's own settings are restored


@pytest.mark.parametrize("method", bench_runners.METHODS)
def test_runners_show_a_bar_over_prompts(bench_tiny, method, capsys):
    pair, workload = bench_tiny
    batch_size = 1 if method in bench_runners.SINGLE_ROW else 2
    out = bench_runners.runner_for(method)(pair, workload, batch_size, progress=True)
    assert len(out.sequences) == len(workload.prompts)
    bar = capsys.readouterr().err
    assert method in bar and f"{len(workload.prompts)}/{len(workload.prompts)}" in bar
    bench_runners.runner_for(method)(pair, workload, batch_size)
    assert capsys.readouterr().err == ""


def test_random_model_ties_a_tied_output_layer_and_draws_the_same_weights_from_the_same_seed():
    """``bench.shapes.random_model`` (scripts/family_floor.py's ~1B models): a config with a tied output layer gets
    one matrix for the embedding and the output, as a checkpoint of that family holds (the step's bytes and the
    parameter count depend on it); the same seed gives the same weights, another seed others."""
    from batchspec.bench.shapes import family_config, random_model

    sizes = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96)
    tied = random_model(family_config("gemma2", **sizes), seed=1, dtype=torch.float32)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = random_model(family_config("llama", **sizes), seed=1, dtype=torch.float32)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    again = random_model(family_config("llama", **sizes), seed=1, dtype=torch.float32)
    other = random_model(family_config("llama", **sizes), seed=2, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(untied.parameters(), again.parameters(), strict=True))
    assert not torch.equal(untied.lm_head.weight, other.lm_head.weight)
