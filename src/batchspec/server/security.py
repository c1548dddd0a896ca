"""Who may use the server: the Host names it answers to, an API key, and the browser origins allowed by CORS.

* Host check: a server bound to loopback answers only requests whose ``Host`` names loopback (``localhost``,
  ``127.0.0.1``, ``[::1]``, any port) or one of the extra allowed names, so that a web page whose name an
  attacker points at 127.0.0.1 (DNS rebinding) cannot reach it through the visitor's browser; others get a 421.
* API key: with a key, every route but ``/health`` needs ``Authorization: Bearer KEY`` (compared in constant
  time); others get a 401.
* CORS (Starlette's ``CORSMiddleware``) for the allowed origins; none by default.

Refusals have OpenAI's error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from batchspec.server.errors import APIError

API_KEY_ENV = "BATCHSPEC_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"
OPEN_PATHS = frozenset({"/health"})

Refuse = Callable[[APIError, Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class SecurityConfig:
    """Access rules of one server.

    Attributes:
        api_key: the bearer token every route but ``/health`` requires (None: no authentication).
        allowed_origins: origins (``https://app.example.com``, or ``*``) whose browser pages may call the API.
        allowed_hosts: ``Host`` header names accepted, any port (None: any). :meth:`for_bind` gives the loopback
            names for a loopback address, and None otherwise unless names are given.
    """

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("the API key must be non-empty, without leading or trailing spaces")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                raise ValueError(f"allowed origins must be '*' or like https://host[:port]; got {origin!r}")

    @classmethod
    def for_bind(
        cls, host: str, *, api_key: str | None = None, allowed_origins: tuple[str, ...] = (),
        allowed_hosts: tuple[str, ...] = (),
    ) -> SecurityConfig:
        """Rules for a server listening on ``host``: the Host check applies to a loopback address, or to any
        address once ``allowed_hosts`` are named (``*`` turns it off)."""
        if ANY_HOST in allowed_hosts or not (allowed_hosts or is_loopback(host)):
            hosts = None
        else:
            hosts = (*LOOPBACK_NAMES, *(h.lower().rstrip(".") for h in allowed_hosts))
        return cls(api_key=api_key, allowed_origins=allowed_origins, allowed_hosts=hosts)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address to listen on) is the loopback interface."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str | None:
    """The name in a ``Host`` header value (``[::1]:8000`` → ``::1``), lower case; None if malformed."""
    try:
        parts = urlsplit(f"//{value}")
        parts.port  # noqa: B018  (raises ValueError for a malformed port)
    except ValueError:
        return None
    return parts.hostname.rstrip(".") if parts.hostname else None


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in ``scope``."""
    return next((value for key, value in scope["headers"] if key == name), None)


class HostCheck:
    """ASGI middleware: a 421 for a ``Host`` header outside ``allowed`` (requests without one pass)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...], refuse: Refuse) -> None:
        self.app = app
        self.allowed = frozenset(allowed)
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = header(scope, b"host") if scope["type"] == "http" else None
        if value is None or host_name(value.decode("latin-1")) in self.allowed:
            await self.app(scope, receive, send)
            return
        message = "this server does not answer to that Host name; use " + ", ".join(sorted(self.allowed))
        await self.refuse(APIError(421, message, code="invalid_host"), scope, receive, send)


class ApiKeyCheck:
    """ASGI middleware: every HTTP route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str, refuse: Refuse) -> None:
        self.app = app
        self.key = api_key.encode()
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
        await self.refuse(error, scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (header(scope, b"authorization") or b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def cache_namespace(scope: Scope, salt: str | None) -> str:
    """Who may share cached prompt prefixes with this request (:mod:`batchspec.engine.prefix_cache`): requests
    sending the same ``Authorization`` header (the same API key, or none) and the same ``cache_salt``. The header is
    hashed, so the key itself is not kept."""
    credential = hashlib.sha256(header(scope, b"authorization") or b"").hexdigest()
    return f"{credential}:{salt or ''}"
