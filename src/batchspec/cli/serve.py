"""``batchspec serve``: an OpenAI-compatible HTTP server with continuous admission."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated

import typer

from batchspec.cli.common import (
    CacheDirOption,
    DraftOption,
    DType,
    DTypeOption,
    Method,
    ModelChoice,
    NumDraftTokensOption,
    PresetOption,
    ProposerOption,
    TargetOption,
    load_models,
)
from batchspec.cli.errors import user_errors
from batchspec.server.settings import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_PREFILL_CHUNK


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


HostOption = Annotated[
    str, typer.Option("--host", metavar="ADDRESS", help="Address to listen on; the default accepts local clients only.")
]
PortOption = Annotated[int, typer.Option("--port", metavar="PORT", min=1, max=65535, help="TCP port to listen on.")]
ServeMethodOption = Annotated[
    Method,
    typer.Option(
        "--method", "-m",
        help="eqspec: one running batch realigned every round, predictable latency (recommended online); "
        "exspec: a window of requests regrouped by length, more throughput but longer tail latency; "
        "autoregressive: the target alone.",
    ),
]
MaxBatchSizeOption = Annotated[
    int, typer.Option("--max-batch-size", "-b", metavar="B", min=1, help="Requests decoded together per round.")
]
MaxQueueOption = Annotated[
    int,
    typer.Option(
        "--max-queue", metavar="N", min=0,
        help="Requests that may wait for a free row; beyond that the server answers 429 with Retry-After.",
    ),
]
WindowSizeOption = Annotated[
    int | None,
    typer.Option("--window-size", metavar="W", min=1, help="exspec: requests admitted at once (default 4 x B)."),
]
ServedNameOption = Annotated[
    str | None,
    typer.Option("--served-model-name", metavar="NAME", help="The model name clients send (default: the preset)."),
]
LogLevelOption = Annotated[LogLevel, typer.Option("--log-level", help="Server log verbosity.")]
PrefillChunkOption = Annotated[
    int,
    typer.Option(
        "--prefill-chunk", metavar="N", min=1,
        help="Columns of new prompts read per round while other requests decode (chunked prefill): a long prompt "
        "then delays the running streams a bounded amount per round.",
    ),
]
TimingOption = Annotated[
    bool,
    typer.Option("--timing/--no-timing", help="Split round time into stages for /metrics (cheap on the CPU)."),
]


def serve_command(
    preset: PresetOption = None,
    target: TargetOption = None,
    draft: DraftOption = None,
    host: HostOption = DEFAULT_HOST,
    port: PortOption = DEFAULT_PORT,
    method: ServeMethodOption = Method.EQSPEC,
    proposer: ProposerOption = None,
    max_batch_size: MaxBatchSizeOption = 8,
    max_queue: MaxQueueOption = 64,
    num_draft_tokens: NumDraftTokensOption = "auto",
    window_size: WindowSizeOption = None,
    prefill_chunk: PrefillChunkOption = DEFAULT_PREFILL_CHUNK,
    timing: TimingOption = True,
    dtype: DTypeOption = DType.AUTO,
    served_model_name: ServedNameOption = None,
    cache_dir: CacheDirOption = None,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Serve the models over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions (also streaming),
    /v1/models, /health and /metrics (Prometheus).

    Requests that arrive while others decode join the running batch between rounds; with temperature 0 every
    answer is the target's own greedy output for that prompt alone: exactly in float32 (--dtype auto, the default
    on the CPU), up to near-ties (the two best tokens within a few rounding steps) in bfloat16 or float16.
    SIGTERM or Ctrl-C finishes the requests in flight, then exits.
    """
    from batchspec.server import ServedModels, ServerConfig, create_app, serve_forever

    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors():
        choice = ModelChoice(preset=preset, target=target, draft=draft, dtype=dtype, cache_dir=cache_dir)
        choice.check_for(method, proposer)
        resolved = choice.proposer_for(method, proposer)
        config = ServerConfig(
            method=method.value, proposer=None if resolved is None else resolved.value,
            max_batch_size=max_batch_size, max_queue=max_queue, num_draft_tokens=num_draft_tokens,
            window_size=window_size, served_model_name=served_model_name, prefill_chunk=prefill_chunk, timing=timing,
        )
        loaded = load_models(choice, method, proposer)
        typer.echo(f"Loaded {loaded.name} ({loaded.dtype.value}) in {loaded.seconds:.1f} s", err=True)
        models = ServedModels(loaded.target, loaded.draft, loaded.tokenizer, loaded.name)
        app = create_app(models, config)
        served = config.served_model_name or loaded.name
        typer.echo(f"Serving {served} ({loaded.dtype.value}) on http://{host}:{port}/v1", err=True)
        serve_forever(app, host, port, log_level=log_level.value)
