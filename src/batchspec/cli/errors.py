"""One clear line on stderr and a non-zero exit status for every user error, never a traceback.

Two kinds of errors reach the user: command-line errors found by the parser (an unknown option, a
value out of range, a choice not offered), and errors found while working (an unknown preset, a
missing prompt file, models that do not share a vocabulary). :class:`OneLineErrorGroup` prints the
first kind as ``Error: <message> (see '<command> --help')``; :func:`user_errors` prints the second
kind as ``Error: <message>``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

from batchspec.models.obtain.catalogue import PresetError

EXIT_USER_ERROR = 1

# typer 0.12 - 0.15 raise click's exceptions, later versions those of the click copy bundled in typer;
# ``typer.BadParameter`` is public in both, and its base classes include the matching ClickException.
_CLICK_EXCEPTION: type[Exception] = next(
    cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException"
)
_USER_ERRORS = (ValueError, OSError, ImportError, PresetError)


def one_line(message: object) -> str:
    """``message`` on a single line: its non-blank lines joined by ``"; "``."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _parser_error_line(error: Any) -> str:
    line = f"Error: {one_line(error.format_message())}"
    ctx = getattr(error, "ctx", None)
    if ctx is not None:
        line += f" (see '{ctx.command_path} --help')"
    return line


class OneLineErrorGroup(TyperGroup):
    """The command group, reporting parser errors on one line instead of usage text plus the error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _CLICK_EXCEPTION as error:
            typer.echo(_parser_error_line(error), err=True)
            sys.exit(getattr(error, "exit_code", EXIT_USER_ERROR))
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            sys.exit(EXIT_USER_ERROR)
        sys.exit(result if isinstance(result, int) else 0)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into ``Error: <message>`` on stderr and exit status 1."""
    try:
        yield
    except _USER_ERRORS as error:
        typer.echo(f"Error: {one_line(error)}", err=True)
        raise typer.Exit(EXIT_USER_ERROR) from None
