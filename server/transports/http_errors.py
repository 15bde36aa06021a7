"""How the HTTP API answers an error: the pool's JSON shape (``{"detail", "error"}``) for its own errors, for a
request that fails validation and for the framework's own, always encodable whatever the client sent."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.errors import KvpoolError, body_for, error_body
from kvpool.protocol import ErrorBody

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 429, 503, 507)
}


class SafeJSONResponse(JSONResponse):
    """JSON escaped to ASCII: error details can quote what a client sent, and a lone surrogate (valid in a JSON
    escape, unencodable as UTF-8) must come back as an escape, not as a 500 from the encoder."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"), default=str).encode()


def error_response(exc: KvpoolError) -> JSONResponse:
    return SafeJSONResponse(body_for(exc), status_code=exc.status)


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field (type, loc, msg, ctx), without echoing the input back, as the fast channel does."""
    errors = [{k: e[k] for k in ("type", "loc", "msg", "ctx") if k in e} for e in exc.errors()]
    return SafeJSONResponse(error_body(errors, "ValidationError"), status_code=422)


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    """The framework's own errors (unparsable body, unknown path, wrong method) in the pool's error shape.

    FastAPI answers a body it cannot parse (bad UTF-8, nesting too deep, an integer with thousands of digits)
    with a bare "There was an error parsing the body"; the cause it chains says what was wrong, so say it.
    """
    detail = exc.detail
    cause = exc.__cause__
    if cause is not None and exc.status_code == 400:
        detail = f"{detail}: {type(cause).__name__}: {str(cause)[:200]}"
    name = "InvalidRequest" if exc.status_code == 400 else "HTTPError"
    return SafeJSONResponse(error_body(detail, name), status_code=exc.status_code, headers=exc.headers)
