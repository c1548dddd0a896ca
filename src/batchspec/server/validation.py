"""Request validation errors (unknown fields, wrong types, values out of range) as 400 responses."""

from __future__ import annotations

from collections.abc import Sequence

from batchspec.server.errors import APIError, bad_request

MAX_REPORTED = 3


def validation_error(problems: Sequence[dict]) -> APIError:
    """A 400 naming the first offending field, with up to ``MAX_REPORTED`` problems in the message (``problems``
    as pydantic's ``ValidationError.errors()`` or FastAPI's ``RequestValidationError.errors()`` lists them)."""
    if not problems:
        return bad_request("invalid request body")
    first = problems[0]
    messages = list(dict.fromkeys(_describe(p) for p in problems))[:MAX_REPORTED]
    return bad_request("; ".join(messages), param=_param(first), code="invalid_value")


def _fields(problem: dict) -> list[str]:
    loc = list(problem.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return [str(part) for part in loc]


def _param(problem: dict) -> str | None:
    fields = _fields(problem)
    return fields[0] if fields else None


def _describe(problem: dict) -> str:
    where = ".".join(_fields(problem))
    message = problem.get("msg", "invalid value")
    if problem.get("type") == "missing":
        message = "this field is required"
    if problem.get("type") == "extra_forbidden":
        message = "unknown field (not supported by this server)"
    return f"{where}: {message}" if where else message
