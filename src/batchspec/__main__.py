"""``python -m batchspec``: the ``batchspec`` command line."""

from batchspec.cli import app

app(prog_name="batchspec")
