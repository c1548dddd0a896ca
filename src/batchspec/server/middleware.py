"""The middleware in front of the routes, outermost first: the request cap, the Host check, CORS, the API key, the
body guard.

A request beyond the cap costs nothing but its refusal; a request the Host check refuses never reaches CORS; a
CORS preflight is answered before the API key is asked for (browsers send none with it); an unauthenticated
client cannot make the server read a body. Every refusal is counted in ``batchspec_requests_total`` under its
route template and status.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from batchspec.server.errors import APIError
from batchspec.server.limits import BodyGuard, RequestCap
from batchspec.server.prometheus import ServerMetrics, endpoint_label
from batchspec.server.security import ApiKeyCheck, HostCheck, Refuse
from batchspec.server.settings import ServerConfig

CORS_METHODS = ("GET", "POST")
CORS_HEADERS = ("Authorization", "Content-Type")


def refuser(metrics: ServerMetrics) -> Refuse:
    """Answer ``error`` (OpenAI's shape) from middleware, counting it like the routes' errors."""

    async def refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        metrics.requests.labels(endpoint=endpoint_label(scope), status=str(error.status)).inc()
        await error.response()(scope, receive, send)

    return refuse


def install_middleware(app: FastAPI, config: ServerConfig, metrics: ServerMetrics, expired: asyncio.Event) -> None:
    """Add the guards to ``app`` (Starlette runs the last one added first)."""
    refuse = refuser(metrics)
    security = config.security
    app.add_middleware(BodyGuard, limits=config.limits, expired=expired, refuse=refuse)
    if security.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=security.api_key, refuse=refuse)
    if security.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(security.allowed_origins),
                           allow_methods=CORS_METHODS, allow_headers=CORS_HEADERS)
    if security.allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=security.allowed_hosts, refuse=refuse)
    app.add_middleware(RequestCap, limit=config.limits.max_connections, refuse=refuse)
