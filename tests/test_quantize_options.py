"""``quantize`` ("none" | "int8") through loading, :class:`ModelChoice`, the command line, the bench and the audit.

The int8 models themselves (:mod:`batchspec.exact.integer`) are tested beside them; here the option is checked to
reach them, to be refused before loading where it cannot apply, and to be recorded wherever the dtype is.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import pytest
import torch
from fabricated import save_tiny_model
from helpers import make_prompts_for, run_cli

from batchspec.bench import Workload, run_audit, run_sweep
from batchspec.bench.audit import EXACT_RULE, NearTieRule, find_divergences, rule_for
from batchspec.bench.reference import Reference
from batchspec.bench.sweep import SweepPlan
from batchspec.config import QUANTIZE, Method, Quantize
from batchspec.exact.integer import cpu_default, native, quantizable, quantization, quantize_model
from batchspec.exact.integer import model as int8_model
from batchspec.models import ModelChoice, ModelPair, load_models, loading
from batchspec.models import choice as choice_module


def not_loaded(*args, **kwargs):
    raise AssertionError("a model was loaded (or a preset obtained) although the options were refused")


@pytest.fixture(autouse=True)
def auto_is_int8_on_this_cpu(monkeypatch):
    """``--quantize auto``'s CPU choice (:func:`batchspec.exact.integer.cpu_default`, tested on its own below) as on a
    CPU
    with native int8 kernels, so these tests read the same on every host."""
    monkeypatch.setattr(loading.integer, "cpu_default", lambda: "int8")


def test_auto_takes_int8_only_where_native_kernels_run(caplog, monkeypatch):
    """``--quantize auto`` picks int8 where a SIMD build runs, and float32 on the portable build (its int8 forward reads
    prompts slower than float32) and without any build (the int8 forward in torch is exact but slow), in one log line
    naming the choice and why."""
    monkeypatch.setattr(int8_model, "_SAID", set())
    with caplog.at_level("INFO", logger="batchspec.exact.integer.model"):
        with native.using("none"):
            assert cpu_default() == "none"
        for isa in native.host_isas():
            with native.using(isa):
                assert cpu_default() == ("none" if isa in int8_model.FLOAT32_FIRST else "int8"), isa
    assert "--quantize auto: float32 (no native int8 kernels here (none);" in caplog.text
    assert "--quantize auto: float32 (batchspec's portable kernels run here, but" in caplog.text
    for isa in native.host_isas():
        if isa not in int8_model.FLOAT32_FIRST:
            assert f"--quantize auto: int8 (batchspec's {isa} kernels run here)" in caplog.text


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any model or obtaining any preset fails the test: errors must come before."""
    monkeypatch.setattr(loading, "_load_any", not_loaded)
    monkeypatch.setattr(choice_module, "obtain_preset", not_loaded)


@pytest.fixture(scope="module")
def int8_tiny(bundles):
    """The tiny llama pair (perturbed draft), both made the exact int8 models, and a workload of five prompts."""
    bundle = bundles["llama"]
    target = quantize_model(copy.deepcopy(bundle.target))
    draft = quantize_model(copy.deepcopy(bundle.drafts["perturbed"]))
    pair = ModelPair(target, draft, None, "tiny-llama-int8", "float64", quantize="int8", build=native.isa())
    prompts = make_prompts_for(bundle, 5, seed=300, max_len=30)
    workload = Workload(
        model="tiny-llama-int8", dtype="float64", prompt_source="random", prompts=tuple(tuple(p) for p in prompts),
        max_new_tokens=12, num_draft_tokens=3, eos_token_ids=(bundle.eos_id,), pad_token_id=bundle.pad_id,
        quantize="int8",
    )
    return pair, workload


@pytest.fixture(scope="module")
def gelu_dirs(tmp_path_factory):
    """Two tiny Llamas with a GELU MLP (the int8 forward needs SiLU), saved like ``tiny_dirs``' with its tokenizer."""
    root = tmp_path_factory.mktemp("gelu-models")
    save_tiny_model(root / "target", hidden_act="gelu")
    save_tiny_model(root / "draft", layers=2, hidden_act="gelu")
    return root


def quantized_nowhere(*args, **kwargs):
    raise AssertionError("a model was quantized although the pair was refused")


def tiny_models(tiny_dirs) -> list[str]:
    return ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft")]


def test_the_choices_check_their_quantize():
    assert ModelChoice().quantize == "auto" and ModelChoice(quantize="int8").quantize == "int8"
    assert type(ModelChoice(quantize=Quantize.INT8).quantize) is str  # the CLI's enum is stored as its value
    assert tuple(q.value for q in Quantize) == QUANTIZE
    with pytest.raises(ValueError, match="Unsupported quantize 'int2'; expected one of auto, none, int8, int4"):
        ModelChoice(quantize="int2")
    with pytest.raises(ValueError, match="Unsupported quantize 'fp8'"):
        ModelPair(None, None, None, "pair", "float32", quantize="fp8")
    with pytest.raises(ValueError, match="not 'auto'"):
        ModelPair(None, None, None, "pair", "float32", quantize="auto")
    with pytest.raises(ValueError, match="Unsupported quantize 'int2'"):
        loading.load_model("/no/such/model", quantize="int2")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "bfloat16"}, "--quantize int8 needs float32 weights .* got bfloat16"),
        ({"dtype": "float16"}, "--quantize int8 needs float32 weights .* got float16"),
        ({"kernels": "packed"}, "--quantize int8 runs its own integer kernels"),
    ],
)
def test_int8_is_refused_before_loading_where_it_cannot_apply(tiny_dirs, no_loading, options, message):
    target, draft = str(tiny_dirs / "target"), str(tiny_dirs / "draft")
    with pytest.raises(ValueError, match=message):
        loading.load_model(target, quantize="int8", **options)
    with pytest.raises(ValueError, match=message):
        loading.load_pair(target=target, draft=draft, quantize="int8", **options)
    with pytest.raises(ValueError, match=message):
        ModelChoice(preset="smollm2", quantize="int8", **options).load_settings()


def load_chosen(choice: ModelChoice, method: Method, **options):
    return load_models(choice, choice.load_settings(), method, **options)


def test_int8_on_a_gpu_is_refused_before_loading(tiny_dirs, no_loading, monkeypatch):
    monkeypatch.setattr(loading, "resolve_device", lambda device="auto": torch.device("cuda", 0))
    target, draft = str(tiny_dirs / "target"), str(tiny_dirs / "draft")
    message = "--quantize int8 runs on the CPU; got device cuda:0"
    with pytest.raises(ValueError, match=message):
        loading.load_model(target, quantize="int8", device="cuda")
    with pytest.raises(ValueError, match=message):
        loading.load_pair(target=target, draft=draft, quantize="int8", device="cuda")


def test_load_pair_and_load_models_quantize_both_models(tiny_dirs):
    target, draft = str(tiny_dirs / "target"), str(tiny_dirs / "draft")
    pair = loading.load_pair(target=target, draft=draft, quantize="int8", progress=False)
    assert pair.quantize == "int8" and pair.dtype == "float32" and pair.seconds > 0
    assert quantization(pair.target) == quantization(pair.draft) == "int8"
    build = native.isa() if native.available() else "torch"  # read once at the load, into the record
    forward = "fused" if native.available() else "transformers' (no native kernels: none)"
    assert pair.build == build and pair.precision == f"float32, int8 exact on {build}, {forward} forward"
    assert pair.served() == {"device": "cpu", "dtype": "float32", "quantize": "int8", "build": build,
                             "forward": forward, "draft_quantize": "int8", "draft_tokenizer": "the target's"}
    alone = load_chosen(ModelChoice(target=target, quantize="int8"), Method.AUTOREGRESSIVE, progress=False)
    assert alone.draft is None and alone.quantize == "int8" and quantization(alone.target) == "int8"
    plain = loading.load_pair(target=target, draft=draft, progress=False, quantize="none")
    assert plain.quantize == "none" and quantization(plain.target) == "none"
    assert plain.precision.startswith("float32, ") and plain.precision.endswith(" kernels")
    default = loading.load_pair(target=target, draft=draft, progress=False)  # auto: int8 on the CPU in float32
    assert default.quantize == "int8" and quantization(default.draft) == "int8"
    packed = loading.load_pair(target=target, draft=draft, progress=False, kernels="packed")  # auto: none
    assert packed.quantize == "none" and packed.precision == "float32, packed kernels"


def test_auto_loads_a_pair_the_integer_forward_does_not_support_unquantized(gelu_dirs):
    target, draft = str(gelu_dirs / "target"), str(gelu_dirs / "draft")
    pair = loading.load_pair(target=target, draft=draft, progress=False)  # auto: int8 on the CPU in float32 ...
    assert pair.quantize == "none" and pair.dtype == "float32"  # ... but not for GELU MLPs
    assert quantization(pair.target) == quantization(pair.draft) == "none"
    assert not quantizable(pair.target) and not quantizable(pair.draft)
    assert pair.precision.startswith("float32, ") and pair.precision.endswith(" kernels")
    alone, _ = loading.load_model(target, progress=False)
    assert quantization(alone) == "none"
    chosen = load_chosen(ModelChoice(target=target, draft=draft), Method.EQSPEC, progress=False)
    assert chosen.quantize == "none" and quantization(chosen.draft) == "none"


@pytest.mark.parametrize("gelu_role", ["target", "draft"])
def test_auto_loads_a_mixed_pair_unquantized_both(tiny_dirs, gelu_dirs, gelu_role):
    specs = {"target": str(tiny_dirs / "target"), "draft": str(tiny_dirs / "draft")}
    silu = specs[gelu_role]
    specs[gelu_role] = str(gelu_dirs / gelu_role)
    alone, _ = loading.load_model(silu, progress=False)
    assert quantization(alone) == "int8"  # the SiLU model alone is quantized by auto
    pair = loading.load_pair(target=specs["target"], draft=specs["draft"], progress=False)
    assert pair.quantize == "none"
    assert quantization(pair.target) == quantization(pair.draft) == "none"
    chosen = load_chosen(ModelChoice(**specs, quantize="auto"), Method.EQSPEC, progress=False)
    assert chosen.quantize == "none" and quantization(chosen.target) == quantization(chosen.draft) == "none"


@pytest.mark.parametrize("gelu_role", ["target", "draft"])
def test_int8_asked_for_a_model_it_does_not_support_is_refused_before_quantizing(
    tiny_dirs, gelu_dirs, gelu_role, monkeypatch
):
    monkeypatch.setattr(loading.integer, "quantize_model", quantized_nowhere)
    specs = {"target": str(tiny_dirs / "target"), "draft": str(tiny_dirs / "draft")}
    specs[gelu_role] = gelu = str(gelu_dirs / gelu_role)
    message = re.escape(f"{gelu}: --quantize int8 needs an MLP activation among ['gelu_pytorch_tanh', 'silu']; this "
                        "model uses 'gelu' (--quantize auto or none")
    with pytest.raises(ValueError, match=message):
        loading.load_pair(target=specs["target"], draft=specs["draft"], quantize="int8", progress=False)
    with pytest.raises(ValueError, match=message):
        loading.load_model(gelu, quantize="int8", progress=False)


def test_int8_asked_for_a_model_it_does_not_support_is_one_line(tiny_dirs, gelu_dirs):
    result = run_cli(
        "generate", "--target", str(tiny_dirs / "target"), "--draft", str(gelu_dirs / "draft"),
        "--prompts", str(tiny_dirs / "prompts.txt"), "--quantize", "int8",
    )
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "this model uses 'gelu'" in lines[0] and "Traceback" not in result.output


def test_a_draft_in_int4_beside_an_int8_target_drafts_and_the_output_stays_the_targets(tiny_dirs):
    """``draft_quantize="int4"``: the draft's every linear layer but the output in int4 (the tiny files hold no
    4-bit blocks: each rounded), the target's int8; the load line names both, and the greedy output is still the
    int8 target's own, draft by draft."""
    from batchspec import generate
    from batchspec.exact.integer.linear import Int4Linear

    target, draft = str(tiny_dirs / "target"), str(tiny_dirs / "draft")
    pair = loading.load_pair(target=target, draft=draft, quantize="int8", draft_quantize="int4", progress=False)
    assert quantization(pair.target) == "int8" and quantization(pair.draft) == "int4"
    fours = [name for name, m in pair.draft.named_modules() if isinstance(m, Int4Linear)]
    assert fours and all("lm_head" not in name for name in fours)
    assert pair.draft_quantize == "int4" and ", the draft int4, " in pair.precision
    prompts = [[5, 1, 2, 7], [3, 3, 6], [1, 4, 6, 2, 0, 1]]
    plain = generate(pair.target, None, prompts, method="autoregressive", batch_size=3, max_new_tokens=12)
    drafted = generate(pair.target, pair.draft, prompts, method="eqspec", proposer="draft", num_draft_tokens=3,
                       batch_size=3, max_new_tokens=12)
    assert drafted.sequences == plain.sequences
    assert drafted.stats.draft_tokens_proposed > 0


def test_generate_runs_int8_models_and_names_them(tiny_dirs, tmp_path):
    out = tmp_path / "int8.jsonl"
    result = run_cli(
        "generate", *tiny_models(tiny_dirs), "--prompts", str(tiny_dirs / "prompts.txt"), "--quantize", "int8",
        "--batch-size", "2", "--max-new-tokens", "4", "--output", str(out),
    )
    assert result.exit_code == 0, result.output
    assert "(float32, int8 exact on " in result.stdout
    assert len(out.read_text().splitlines()) == 3
    help_text = " ".join(run_cli("generate", "--help").output.split())
    assert "--quantize" in help_text and "integer-exact attention" in help_text and "CPU only" in help_text


@pytest.mark.parametrize(
    ("extra", "exit_code", "fragments"),
    [
        (["--quantize", "bogus"], 2,
         ("Invalid value for '--quantize'", "'bogus' is not one of 'auto', 'none', 'int8'")),
        (["--quantize", "int8", "--dtype", "bfloat16"], 1, ("--quantize int8 needs float32 weights",)),
        (["--quantize", "int8", "--kernels", "packed"], 1, ("--quantize int8 runs its own integer kernels",)),
    ],
)
def test_bad_quantize_options_are_one_line(tiny_dirs, extra, exit_code, fragments):
    result = run_cli("generate", *tiny_models(tiny_dirs), "--prompts", str(tiny_dirs / "prompts.txt"), *extra)
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), result.stderr
    assert "Traceback" not in result.output


def test_an_int8_audit_has_no_near_ties_and_records_it(int8_tiny, tmp_path):
    pair, workload = int8_tiny
    report = run_audit(pair, workload, ("eqspec", "exspec"), (1, 3), out_dir=tmp_path, progress=False)
    assert report.quantize == "int8" and report.near_tie_ulps == 0 and report.passed
    assert [(c.method, c.batch_size) for c in report.cells] == [(m, b) for b in (1, 3) for m in ("eqspec", "exspec")]
    assert all(c.exact_match == 1.0 and c.divergences == [] for c in report.cells)
    stored = json.loads((tmp_path / "audit.json").read_text())
    assert stored["quantize"] == "int8" and stored["near_tie_ulps"] == 0 and stored["passed"]
    assert "does not apply" in stored["near_tie_rule"]


def test_every_int8_divergence_is_a_failure(int8_tiny):
    pair, workload = int8_tiny
    assert rule_for(pair, workload, NearTieRule(ulps=1e300)) is EXACT_RULE
    reference = Reference(key="hand-built", sequences=[[5, 6, 7]], margins=[[9.0, 0.0, 9.0]],
                          top_logits=[[30.0, 20.0, 30.0]])
    (tie,) = find_divergences([[5, 8, 7]], reference, EXACT_RULE, torch.float32)
    assert tie.margin == 0.0 and tie.margin_ulps == 0.0 and not tie.near_tie  # even an exact tie fails
    (plain,) = find_divergences([[5, 8, 7]], reference, NearTieRule(), torch.float32)
    assert plain.near_tie
    float_pair = ModelPair(pair.target, pair.draft, None, "pair", "float64")  # its modules are int8 all the same
    assert rule_for(float_pair, workload, NearTieRule()) is EXACT_RULE
    with pytest.raises(ValueError, match="the workload records quantize 'none' but the models are 'int8'"):
        rule_for(pair, replace(workload, quantize="none"), NearTieRule())


def test_the_workload_key_tells_int8_apart(int8_tiny):
    _, workload = int8_tiny
    plain = replace(workload, quantize="none")
    assert plain.key != workload.key
    with pytest.raises(ValueError, match="Unsupported quantize"):
        replace(workload, quantize="int2")


def test_an_int8_sweep_records_the_quantization(int8_tiny, tmp_path):
    pair, workload = int8_tiny
    run_sweep(pair, workload, SweepPlan(("eqspec", "hf-generate"), (3,)), tmp_path, progress=False)
    cells = json.loads((tmp_path / "results.json").read_text())
    assert [c["quantize"] for c in cells] == ["int8", "int8"]
    assert all(c["exact_match"] == 1.0 for c in cells if c["method"] == "eqspec")
    assert "(int8 exact, the target reads " in (tmp_path / "results.md").read_text().splitlines()[0]
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["quantize"] == "int8" and "does not apply" in audit["near_tie_rule"]


def test_bench_audit_and_costs_commands_record_int8(tiny_dirs, tmp_path):
    common = [*tiny_models(tiny_dirs), "--quantize", "int8", "--prompts", str(tiny_dirs / "prompts.txt")]
    budget = ["--max-new-tokens", "4", "-k", "2", "--batch-sizes", "2"]
    bench = run_cli("bench", *common, *budget, "--methods", "eqspec", "-o", str(tmp_path / "bench"))
    assert bench.exit_code == 0, bench.output
    assert "(float32, int8 exact), 3 prompts" in bench.stdout
    assert [c["quantize"] for c in json.loads((tmp_path / "bench" / "results.json").read_text())] == ["int8"]
    audit = run_cli("audit", *common, *budget, "--methods", "eqspec", "-o", str(tmp_path / "audit"))
    assert audit.exit_code == 0, audit.output
    assert "no near-ties" in audit.stdout and "PASSED" in audit.stdout
    assert json.loads((tmp_path / "audit" / "audit.json").read_text())["quantize"] == "int8"
    costs = run_cli(
        *["costs", *tiny_models(tiny_dirs), "--quantize", "int8", "--batch-sizes", "1", "--draft-lengths", "2"],
        *["--context", "4", "--repeats", "1", "-o", str(tmp_path / "costs")],
    )
    assert costs.exit_code == 0, costs.output
    report = json.loads((tmp_path / "costs" / "costs.json").read_text())
    assert report["quantize"] == "int8" and report["precision"].startswith("float32, int8 exact on ")
    assert "(float32, int8 exact on " in costs.stdout


def test_auto_is_int4_for_4_bit_files_where_int4_was_measured_faster(monkeypatch):
    """``--quantize auto``'s width: int4 only for models from files holding 4-bit weights, on the builds where int4
    beat int8 in every measured cell (avx2); int8 on the VNNI builds and for every other model."""
    from batchspec.exact import integer
    from batchspec.exact.integer import native

    for isa, four_bit, want in [("avx2", True, "int4"), ("avx2", False, "int8"), ("avx512vnni", True, "int8"),
                                ("avxvnni", True, "int8")]:
        monkeypatch.setattr(native, "isa", lambda isa=isa: isa)
        assert integer.width_for(four_bit) == want, (isa, four_bit)
