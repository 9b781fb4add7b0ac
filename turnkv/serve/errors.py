"""Errors as the OpenAI API writes them: {"error": {"message", "type", "param", "code"}} with the
status a client's retry logic expects (400 bad input, 401 key, 404 model, 413 body, 429 busy, 503 memory)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnkv.errors import ContextLengthError, InvalidRequestError, KVCacheFullError, ParallelError, TurnkvError

log = logging.getLogger("turnkv.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_engine(error: Exception, retry_after_s: int = 1, param: str | None = None) -> APIError:
    """The API error for an exception the engine raised while serving a request. param: the request's
    field that bad input found while serving it comes from, unless the error names its own (`param`
    attribute): the prompt's ("messages" or "prompt"), which the worker encodes and checks."""
    if isinstance(error, APIError):
        return error
    param = getattr(error, "param", None) or param
    if isinstance(error, ContextLengthError):
        return APIError(400, str(error), param=param, code="context_length_exceeded")
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=param)
    if isinstance(error, KVCacheFullError):
        return APIError(503, f"{error}; retry later", type="server_error", code="kv_cache_full",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(error, ParallelError):  # a rank of a tensor-parallel engine failed: no request can run
        return APIError(503, str(error), type="server_error", code="engine_unavailable")
    if isinstance(error, TurnkvError):
        return APIError(500, str(error), type="server_error")
    log.exception("internal error while serving a request", exc_info=error)
    return APIError(500, "internal server error", type="server_error")


def validation_error(exc: RequestValidationError | Exception) -> APIError:
    """A pydantic error list as one readable message; `param` names the top-level field at fault (a
    check across fields names the one it faults: protocol.FieldError)."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, str(exc))
    fields = [[str(p) for p in e.get("loc", ()) if p != "body"] or _faulted(e) for e in errors]
    message = "; ".join(f"{'.'.join(loc) or 'body'}: {_reason(e)}" for loc, e in list(zip(fields, errors))[:5])
    return APIError(400, message, param=fields[0][0] if fields[0] else None)


def _faulted(error: dict) -> list[str]:
    """The field a located-nowhere error (a model validator's) names, as a location."""
    param = getattr((error.get("ctx") or {}).get("error"), "param", None)
    return [param] if param else []


def _reason(error: dict) -> str:
    message = str(error.get("msg"))
    return message.removeprefix("Value error, ") if error.get("type") == "value_error" else message


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        return from_engine(exc).response()
