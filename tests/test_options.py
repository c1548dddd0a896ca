"""Every option of ``generate``, ``generate --ray``, ``serve``, ``bench``, ``audit`` and ``costs`` reaches what the
command hands on, or is refused.

Each option is given a value other than its default, one at a time; the command runs with the model loading, the
generation and the serving replaced by recorders, and what they were handed (the model choice, the ``generate``
keywords, the server's config and HTTP options, the prompts) must differ from what the defaults hand on, unless
the command refuses the value with a one-line error. A new option without a value here fails the walk, so none
can be dropped silently.
"""

from __future__ import annotations

import ast
import json
import pickle
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

import batchspec
import batchspec.server
from batchspec.cli import app, bench, costs, generate, ray_generate, serve
from batchspec.config import RequestOptions, SamplingParams, SpecConfig
from batchspec.models.choice import ModelChoice
from batchspec.ray import JobPredictor
from batchspec.server.hosting import HttpOptions
from batchspec.server.limits import RequestLimits
from batchspec.server.settings import ServerConfig

PROMPTS = ["first prompt", "second prompt", "third prompt"]
CATEGORIES = ["coding", "writing", "coding"]

GENERATION = {
    "--method": "exspec", "--proposer": "ngram", "--batch-size": "3", "--max-new-tokens": "7",
    "--num-draft-tokens": "3", "--temperature": "0.7", "--top-k": "4", "--top-p": "0.5", "--seed": "11",
    "--cuda-graphs": "off", "--prefix-cache-size": "1MiB", "--draft-vocabulary": "4096",
}
MODELS = {
    "--preset": "smollm2", "--target": "other-target", "--dtype": "bfloat16",
    "--draft": ["--target", "other-target", "--draft", "other-draft"],  # a draft alone is refused
    "--kernels": "default", "--quantize": "none", "--draft-quantize": "int4", "--cache-dir": "{tmp}/cache",
    "--device": "cpu",
    "--batch-invariant": None,
}
PROMPT_OPTIONS = {"--limit": "2", "--category": "coding", "--no-chat-template": None}
# sampling in every run of the walk: --top-k, --top-p and --seed apply only to it
SAMPLING = ["--temperature", "0.5"]
RAY = {"--ray-address": "auto", "--actors": "2", "--threads-per-actor": "2"}
SERVE = {
    "--host": "0.0.0.0", "--port": "8123", "--max-batch-size": "3", "--max-queue": "5", "--window-size": "12",
    "--prefill-chunk": "16", "--no-timing": None, "--served-model-name": "named", "--log-level": "debug",
    "--api-key": "key", "--allowed-origins": "https://a.example", "--allowed-hosts": "a.example",
    "--ssl-keyfile": ["--ssl-keyfile", "{tmp}/key.pem", "--ssl-certfile", "{tmp}/cert.pem"],
    "--ssl-certfile": ["--ssl-certfile", "{tmp}/cert.pem", "--ssl-keyfile", "{tmp}/key.pem"],
    "--max-body-bytes": "1000",
    "--head-timeout": "2", "--read-timeout": "2", "--keep-alive-timeout": "3", "--max-connections": "3",
    "--max-idle-connections": "3", "--max-messages": "3", "--max-content-parts": "3", "--request-timeout": "9",
    "--default-max-tokens": "9", "--shutdown-timeout": "3",
}
BENCH = {
    "--methods": "eqspec", "--batch-sizes": "2", "--proposers": "ngram", "--max-new-tokens": "7",
    "--num-draft-tokens": "3", "--prefix-cache-size": "1MiB", "--no-compare": None, "--rate": "2",
    "--requests": "3",
}
AUDIT = {k: v for k, v in BENCH.items() if k not in {"--no-compare", "--rate", "--requests"}} | {"--near-tie-ulps": "2"}
COSTS = {"--batch-sizes": "2", "--draft-lengths": "4", "--context": "16", "--repeats": "1",
         "--mean-accepted-length": "2.5", "--draft-vocabulary": "0"}
# What the walk leaves out, and why: the prompt file itself (every run needs one), --output (written after
# generation; test_cli checks the file), --ray and --online (the switches between two walks).
NOT_WALKED = {"--prompts", "--output", "--ray", "--online", "--help"}


class Reached(Exception):
    """Raised by the recorder that stands in for generation: the options have arrived."""


def snapshot(value):
    """A comparable picture of ``value``: dataclasses and namespaces field by field, enums by their value."""
    if is_dataclass(value) and not isinstance(value, type):
        return tuple((f.name, snapshot(getattr(value, f.name))) for f in fields(value))
    if isinstance(value, SimpleNamespace):
        value = vars(value)
    if isinstance(value, dict):
        return tuple(sorted((k, snapshot(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(snapshot(v) for v in value)
    return getattr(value, "value", value)


def fake_models(choice, *args, **kwargs):
    return SimpleNamespace(
        name="fake", precision="float32", seconds=0.0, dtype="float32", target=None, draft=None,
        tokenizer=SimpleNamespace(choice=choice),
    )


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": p, "category": c}) for p, c in zip(PROMPTS, CATEGORIES, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    for pem in ("key.pem", "cert.pem"):
        (tmp_path / pem).write_text("")
    return path


@pytest.fixture
def recorded(monkeypatch):
    """Stand-ins for loading, generating and serving that write down what they were handed."""
    seen: dict[str, object] = {}

    def record(name, result=None, stop=False):
        def recorder(*args, **kwargs):
            seen[name] = snapshot((args, kwargs))
            if stop:
                raise Reached
            return result

        return recorder

    def predict_on_ray(run, records, job, seed, choice):
        predictor = JobPredictor(pickle.loads(pickle.dumps(job)))  # the actors are handed the job whole, pickled
        seen["ray_choice"] = snapshot(choice)
        predictor({"prompt": [r.text for r in records], "seed": [seed or 0] * len(records)})

    # nothing loads, so the load settings' refusal of --batch-invariant on the CPU is not the walk's (tests/test_cli.py)
    monkeypatch.setattr("batchspec.models.loading.check_batch_invariant_for", lambda *args: None)
    monkeypatch.setattr(generate, "load_run", lambda run, *a, **k: (record("models")(run, *a),
                                                                   fake_models(run.choice))[1])
    monkeypatch.setattr(generate, "encode_prompts", lambda records, tokenizer, choice: (
        record("prompts")(records, choice), [[1]] * len(records))[1])
    monkeypatch.setattr(generate, "generate_with", record("generate", stop=True))
    monkeypatch.setattr("batchspec.ray.load_run", lambda run, *a, **k: (record("models")(run, *a),
                                                                        fake_models(run.choice))[1])
    monkeypatch.setattr("batchspec.ray.format_prompts", lambda records, tokenizer, chat_template: (
        record("prompts")(records, chat_template), [[1]] * len(records))[1])
    monkeypatch.setattr("batchspec.ray.generate_with", record("generate", stop=True))
    monkeypatch.setattr(ray_generate, "_reporting_actor_failures", predict_on_ray)
    monkeypatch.setattr(serve, "load_run", lambda run, *a, **k: (record("models")(run, *a),
                                                                fake_models(run.choice))[1])
    def load_workload(models, prompts, methods, cells):
        record("workload")(models, prompts, methods, cells)
        settings = cells.settings
        return None, SimpleNamespace(prompts=((1,),), max_new_tokens=cells.max_new_tokens,
                                     num_draft_tokens=settings.num_draft_tokens,
                                     prefix_cache_size=settings.prefix_cache_size)

    monkeypatch.setattr(bench, "load_workload", load_workload)
    monkeypatch.setattr(bench, "run_sweep", record("sweep", stop=True))
    monkeypatch.setattr(bench, "run_audit", record("audit", stop=True))
    monkeypatch.setattr(costs, "load_for_methods", lambda choice, methods: (record("models")(choice, methods),
                                                                           fake_models(choice))[1])
    monkeypatch.setattr(costs, "measure_forward_costs", record("measure", result=[]))
    monkeypatch.setattr(costs, "speculation_costs", record("speculation", stop=True))
    monkeypatch.setattr("batchspec.bench.online.run_online_benchmark", record("online", stop=True))
    monkeypatch.setattr(batchspec.server, "create_app", record("app", result=object()))
    monkeypatch.setattr(batchspec.server, "serve_forever", record("serve", stop=True))
    return seen


def walk(recorded, base: list[str], option: str, value: str | list[str] | None, tmp_path):
    """What the command hands on with ``option`` set to ``value`` (None: a switch; a list: all the arguments that
    give it, where it needs another option beside it), or None when the command refuses it in one line."""
    recorded.clear()
    given = [option] if value is None else [option, value] if isinstance(value, str) else value
    given = [arg.format(tmp=tmp_path) for arg in given]
    result = CliRunner().invoke(app, base + given)
    if isinstance(result.exception, Reached):
        return dict(recorded)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("Error: "), (option, result.output)
    return None


def unlisted_options(command: str, values: dict) -> list[str]:
    """The options of ``command`` that neither the walk's ``values`` nor :data:`NOT_WALKED` name (by any of their
    names: ``--proposers`` or ``--proposer``, ``--compare`` or ``--no-compare``)."""
    click = typer.main.get_command(app).commands[command]
    covered = set(values) | NOT_WALKED
    return sorted(param.opts[0] for param in click.params
                  if param.opts[0].startswith("--") and not covered & set(param.opts + param.secondary_opts))


def check_every_option(recorded, tmp_path, base, values, command):
    """Each walked option either changes what the command hands on or is refused; none is unlisted."""
    result = CliRunner().invoke(app, base)
    assert isinstance(result.exception, Reached), result.output
    baseline = dict(recorded)
    unlisted = unlisted_options(command, values)
    assert not unlisted, f"options without a value in this walk: {unlisted}"
    refused = []
    for option, value in values.items():
        reached = walk(recorded, base, option, value, tmp_path)
        if reached is None:
            refused.append(option)
        else:
            assert reached != baseline, f"{option} {value} changed nothing the command hands on"
    return refused


def test_every_generate_option_reaches_generation(recorded, prompts_file, tmp_path):
    values = GENERATION | MODELS | PROMPT_OPTIONS | RAY
    base = ["generate", "--prompts", str(prompts_file), *SAMPLING]
    refused = check_every_option(recorded, tmp_path, base, values, "generate")
    assert refused == list(RAY), refused  # "--actors applies only with --ray"


def test_every_generate_option_reaches_the_ray_actors_or_is_refused(recorded, prompts_file, tmp_path):
    values = GENERATION | MODELS | PROMPT_OPTIONS | RAY
    base = ["generate", "--prompts", str(prompts_file), *SAMPLING, "--ray"]
    refused = check_every_option(recorded, tmp_path, base, values, "generate")
    assert refused == [], refused
    assert walk(recorded, base, "--cuda-graphs", "on", tmp_path) is None


def test_every_bench_option_reaches_the_sweep_or_is_refused(recorded, prompts_file, tmp_path):
    values = BENCH | MODELS | PROMPT_OPTIONS
    base = ["bench", "--prompts", str(prompts_file), "--output", str(tmp_path / "out")]
    refused = check_every_option(recorded, tmp_path, base, values, "bench")
    assert refused == ["--rate", "--requests"], refused  # "--rate, --requests apply only with --online"


def test_every_bench_online_option_reaches_the_servers_or_is_refused(recorded, prompts_file, tmp_path):
    values = BENCH | {"--methods": "eqspec"} | MODELS
    base = ["bench", "--prompts", str(prompts_file), "--output", str(tmp_path / "out"), "--online"]
    refused = check_every_option(recorded, tmp_path, base, values | PROMPT_OPTIONS, "bench")
    assert refused == ["--proposers", "--no-compare"], refused  # "... apply only to the sweep, not --online"


def test_every_serve_option_reaches_the_server(recorded, prompts_file, tmp_path):
    values = {k: v for k, v in GENERATION.items() if k in {"--method", "--proposer", "--num-draft-tokens",
                                                          "--draft-vocabulary", "--cuda-graphs", "--prefix-cache-size"}}
    values |= MODELS | SERVE
    refused = check_every_option(recorded, tmp_path, ["serve"], values, "serve")
    assert refused == [], refused


def written_defaults(path: Path) -> list[tuple[str, int]]:
    """``(name, line)`` of every default that ``path`` writes for a setting of the record: a parameter's or a
    field's default other than None or () (which say "not given"), and other than one read from its declaration
    (the record's ``setting_default(name)``, or a named ``DEFAULT_...`` constant)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        pairs = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            given = node.args.posonlyargs + node.args.args
            pairs += zip(given[len(given) - len(node.args.defaults):], node.args.defaults, strict=True)
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True) if d]
            pairs = [(a.arg, d) for a, d in pairs]
        elif isinstance(node, ast.ClassDef):
            pairs = [(st.target.id, st.value) for st in node.body
                     if isinstance(st, ast.AnnAssign) and st.value is not None and isinstance(st.target, ast.Name)]
            if node.name in RESOLVED_RECORDS:
                pairs = [(name, d) for name, d in pairs if not _resolved(name, d)]
        for name, default in pairs:
            if name in SETTING_NAMES and not _reads_the_record(default):
                found.append((name, node.lineno))
    return found


def declared_in(*records: type) -> dict[str, str]:
    """Each option a record declares (a field written with ``option(...)``: it has help text) and the file, relative
    to the package, of the class that declares it."""
    package = Path(batchspec.__file__).resolve().parent
    places = {}
    for record in records:
        for cls in reversed(record.__mro__[:-1]):  # without object
            own = vars(cls).get("__annotations__", {})
            path = Path(sys.modules[cls.__module__].__file__).resolve().relative_to(package)
            places |= {spec.name: str(path) for spec in fields(record) if spec.name in own and "help" in spec.metadata}
    return places


DECLARED = declared_in(
    SpecConfig, SamplingParams, RequestOptions, ModelChoice, RequestLimits, HttpOptions, ServerConfig
)
SETTING_NAMES = set(DECLARED)


# Records of what was loaded or measured: they hold resolved values ("none", "cpu"), never an option's "auto", and
# their defaults say what a pair loaded by hand is (docs/serving.md), not the option's default.
RESOLVED_RECORDS = {"ModelPair", "Workload", "AuditReport"}


def _resolved(name: str, default: ast.expr) -> bool:
    """``default`` is a value the option ``name`` resolves to (a constant, never "auto")."""
    return isinstance(default, ast.Constant) and default.value != "auto"


def _reads_the_record(default: ast.expr) -> bool:
    if isinstance(default, ast.Constant) and default.value is None:
        return True
    if isinstance(default, ast.Tuple) and not default.elts:
        return True
    if isinstance(default, ast.Name) and default.id.startswith("DEFAULT_"):
        return True
    return isinstance(default, ast.Call) and getattr(default.func, "id", None) == "setting_default"


def test_each_setting_has_its_default_written_once():
    """Each option's default is written once, where it is declared (``option(...)``: config.py's records,
    ModelChoice's preset, target and draft, the server's limits, HTTP options and own settings); no entry point,
    adapter or bench holder writes one again."""
    package = Path(batchspec.__file__).resolve().parent
    written = {}
    for path in sorted(package.rglob("*.py")):
        for name, line in written_defaults(path):
            written.setdefault(name, []).append(f"{path.relative_to(package)}:{line}")
    declared = DECLARED
    again = {name: places for name, places in written.items()
             if len(places) != 1 or places[0].split(":")[0] != declared[name]}
    assert not again, again
    assert {"num_draft_tokens", "temperature", "max_new_tokens", "dtype", "max_queue"} <= set(written)  # all read


def test_every_audit_option_reaches_the_audit(recorded, prompts_file, tmp_path):
    base = ["audit", "--prompts", str(prompts_file), "--output", str(tmp_path / "out")]
    refused = check_every_option(recorded, tmp_path, base, AUDIT | MODELS | PROMPT_OPTIONS, "audit")
    assert refused == [], refused


def test_every_costs_option_reaches_the_measurement(recorded, tmp_path):
    base = ["costs", "--output", str(tmp_path / "out")]
    refused = check_every_option(recorded, tmp_path, base, COSTS | MODELS, "costs")
    assert refused == [], refused
