"""An OpenAI-compatible HTTP server with continuous admission (its load generator is :mod:`batchspec.bench.online`).

One engine loop (:mod:`~batchspec.server.loop`) owns the models in a thread of its own; requests arriving while
others decode join the running rows between rounds, and every request's output is what ``batchspec.generate``
gives for it alone.
"""

from batchspec.server.app import create_app
from batchspec.server.hosting import RunningServer, serve_forever, serve_in_thread
from batchspec.server.settings import ServerConfig

__all__ = ["RunningServer", "ServerConfig", "create_app", "serve_forever", "serve_in_thread"]
