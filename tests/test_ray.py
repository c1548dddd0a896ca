"""Ray Data: ``batchspec generate --ray`` writes what the single-process run writes, and ``BatchspecPredictor``
samples what a single process samples and survives an actor that dies in the middle of a batch.

A local cluster of 2 CPUs, the ``smollm2`` preset in float32, five short prompts and six new tokens keep this
quick. The references are the single-process ``batchspec generate`` runs of the same prompts. The tests that start
a cluster (about 20 s, then 25-40 s of actors) run with ``BATCHSPEC_LARGE_TESTS=1`` (CI's 8 minutes); in CI the
predictor runs in the test's own process, batch by batch, as an actor calls it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import cached_or_skip
from typer.testing import CliRunner

import batchspec
from batchspec.cli import app
from batchspec.engine.sampling import derive_row_seeds
from batchspec.ray import STATS_COLUMN, BatchspecPredictor, merge_batch_stats

PROMPTS = [
    "Write a Python function that adds two numbers.",
    "What is a KV cache?",
    "Name three prime numbers.",
    "Say hello in French.",
    "What is 2+2?",
]
MAX_NEW_TOKENS = 6
TEMPERATURE = 0.9
SEED = 7
COMMON = ["generate", "--preset", "smollm2", "--dtype", "float32", "--quantize", "none", "--batch-size", "2",
          "--max-new-tokens", str(MAX_NEW_TOKENS)]
SAMPLING = ["--temperature", str(TEMPERATURE), "--seed", str(SEED)]


def run_cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return path


def single_process(prompts_file: Path, name: str, *extra: str) -> Path:
    """The single-process JSONL of a run over the prompts (``name``: greedy or sampled), made once per module."""
    cached_or_skip("smollm2")
    output = prompts_file.with_name(f"single-{name}.jsonl")
    if not output.exists():
        result = run_cli(*COMMON, *extra, "--prompts", prompts_file, "--output", output)
        assert result.exit_code == 0, result.output
    return output


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of 2 CPUs whose workers import this batchspec and this test module."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    paths = [str(Path(batchspec.__file__).parents[1]), str(Path(__file__).parent)]
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}})
    yield ray
    ray.shutdown()


def recording(function, threads: set[int]):
    """``function``, noting in ``threads`` every thread that calls it."""

    def recorded(*args, **kwargs):
        threads.add(threading.get_ident())
        return function(*args, **kwargs)

    return recorded


LARGE = pytest.mark.skipif(not os.environ.get("BATCHSPEC_LARGE_TESTS"),
                           reason="starts a local Ray cluster and its actors (about 60 s); set BATCHSPEC_LARGE_TESTS=1")


def test_the_predictor_batch_by_batch_writes_what_one_process_writes(prompts_file, monkeypatch):
    """The predictor as an actor runs it, in this process: built on this thread and called from another (as Ray
    Data calls it), batches of 2 and 3 rows with their seeds give the rows, texts and finish reasons of the
    single-process sampled run, each batch's stats count its own tokens, and the models generate on the thread that
    loaded them (one OpenMP pool: see ``BatchspecPredictor.__call__``)."""
    expected = read_rows(single_process(prompts_file, "sampled", *SAMPLING))
    seeds = derive_row_seeds(SEED, len(PROMPTS))
    threads = {"load": set(), "generate": set()}
    for name, stage in (("load_run", "load"), ("generate_with", "generate")):
        monkeypatch.setattr(batchspec.ray, name, recording(getattr(batchspec.ray, name), threads[stage]))
    predictor = BatchspecPredictor(preset="smollm2", dtype="float32", quantize="none", num_threads=1,
                                   batch_size=2, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    rows = []
    with ThreadPoolExecutor(1) as ray_data:
        for start, stop in ((0, 2), (2, 5)):
            batch = {"index": list(range(start, stop)), "prompt": PROMPTS[start:stop], "seed": seeds[start:stop]}
            out = ray_data.submit(predictor, batch).result()
            rows += [dict(zip(out, values, strict=True)) for values in zip(*out.values(), strict=True)]
    assert len(threads["load"]) == 1 and threads["generate"] == threads["load"]
    assert [list(row["token_ids"]) for row in rows] == [row["token_ids"] for row in expected]
    assert [row["text"] for row in rows] == [row["text"] for row in expected]
    assert [row["finish_reason"] for row in rows] == [row["finish_reason"] for row in expected]
    stats, _ = merge_batch_stats(row[STATS_COLUMN] for row in rows)
    assert stats.generated_tokens == sum(row["num_tokens"] for row in expected)


@LARGE
def test_generate_on_ray_writes_what_one_process_writes(cluster, prompts_file, tmp_path):
    out = tmp_path / "ray.jsonl"
    result = run_cli(*COMMON, "--prompts", prompts_file, "--output", out, "--ray", "--actors", 1)
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8") == single_process(prompts_file, "greedy").read_text(encoding="utf-8")
    assert [row["index"] for row in read_rows(out)] == list(range(len(PROMPTS)))
    assert "1 actor(s) x 1 thread(s)" in result.stdout
    assert f"{sum(r['num_tokens'] for r in read_rows(out))} tokens in" in result.stdout


class CrashOncePredictor(BatchspecPredictor):
    """Kills its own actor process in the first batch any actor is handed (``marker`` records that it did)."""

    def __init__(self, marker: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker = Path(marker)

    def __call__(self, batch):
        if not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        return super().__call__(batch)


@LARGE
def test_predictor_samples_like_one_process_and_survives_a_dead_actor(cluster, prompts_file, tmp_path):
    seeds = derive_row_seeds(SEED, len(PROMPTS))
    items = [{"index": i, "prompt": p, "seed": s} for i, (p, s) in enumerate(zip(PROMPTS, seeds, strict=True))]
    marker = tmp_path / "crashed"
    settings = dict(preset="smollm2", dtype="float32", quantize="none", num_threads=1, batch_size=2,
                    max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    predicted = cluster.data.from_items(items).map_batches(
        CrashOncePredictor, fn_constructor_kwargs=dict(marker=str(marker), **settings), batch_size=2,
        concurrency=1, num_cpus=1,
    )
    rows = sorted(predicted.take_all(), key=lambda row: row["index"])
    assert marker.exists(), "an actor died and its batch was retried"
    expected = read_rows(single_process(prompts_file, "sampled", *SAMPLING))
    assert [list(row["token_ids"]) for row in rows] == [row["token_ids"] for row in expected]
    assert [row["text"] for row in rows] == [row["text"] for row in expected]
    assert [row["finish_reason"] for row in rows] == [row["finish_reason"] for row in expected]
    assert [row["prompt"] for row in rows] == PROMPTS
    stats, span = merge_batch_stats(row[STATS_COLUMN] for row in rows)
    assert stats.generated_tokens == sum(row["num_tokens"] for row in rows) == sum(r["num_tokens"] for r in expected)
    assert sum(stats.rows_per_round_histogram.values()) == stats.rounds > 0
    assert span > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--actors", "2"], "Error: --actors applies only with --ray"),
        (["--ray-address", "auto", "--threads-per-actor", "2"],
         "Error: --ray-address, --threads-per-actor apply only with --ray"),
    ],
)
def test_ray_options_need_ray(prompts_file, args, message):
    result = run_cli(*COMMON, "--prompts", prompts_file, *args)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [message]


def test_ray_missing_is_one_error_line(prompts_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    result = run_cli(*COMMON, "--prompts", prompts_file, "--ray")
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error: --ray needs Ray Data (")
    assert result.output.strip().endswith("pip install 'batchspec[ray]'")
