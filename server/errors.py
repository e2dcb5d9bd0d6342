"""OpenAI-style error bodies and the exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`;
bad input is always a 4xx (never 422, never 5xx).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphserve.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError

logger = logging.getLogger("graphserve.server")


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _default_type(status_code)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else {}
        return JSONResponse(self.body(), status_code=self.status_code, headers={**headers, **self.headers})


def _default_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code == 503:
        return "service_unavailable_error"
    if status_code >= 500:
        return "internal_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model `{name}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def not_ready() -> APIError:
    return APIError(503, "The model is still loading; retry shortly.", code="model_not_ready")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", code="shutting_down")


def engine_dead() -> APIError:
    return APIError(503, "The inference engine has stopped after an internal error.", code="engine_dead")


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )


def queue_full(max_queue_len: int, retry_after_s: int) -> APIError:
    return APIError(
        429,
        f"The server is at capacity ({max_queue_len} requests waiting); retry after {retry_after_s} s.",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def internal_error() -> APIError:
    """What the client sees of a failure on our side: no traceback, path or exception text."""
    return APIError(500, "The server failed while processing the request.", code="internal_error")


def from_engine_error(exc: Exception) -> APIError:
    """Map an exception raised by the engine for one request to an APIError."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.param or "prompt", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    return internal_error()


def from_validation_errors(errors: list[Any]) -> APIError:
    """Turn pydantic's error list into one 400 that names the first bad field."""
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON in request body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(str(part))]
    if not loc and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("The request body must be a JSON object.")
    param = ".".join(loc) or None
    message = str(first.get("msg", "Invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param=param)


_UNION_MEMBER_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member it tried into `loc` (e.g. 'list[int]'); those are not fields."""
    return part in _UNION_MEMBER_NAMES or "[" in part or part.startswith("function-")


def _count_error(request: Request, status_code: int) -> None:
    state = getattr(request.app.state, "graphserve", None)
    if state is not None:
        state.metrics.observe_error(status_code)


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    _count_error(request, exc.status_code)
    return exc.response()


async def _invalid_request_handler(request: Request, exc: InvalidRequestError) -> JSONResponse:
    """The engine's own checks (sampling values, prompt, chat template) raised outside a generation."""
    error = from_engine_error(exc)
    _count_error(request, error.status_code)
    return error.response()


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    _count_error(request, 400)
    return from_validation_errors(list(exc.errors())).response()


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    try:
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
    except ValueError:
        message = "HTTP error"
    _count_error(request, exc.status_code)
    response = APIError(exc.status_code, message).response()
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    _count_error(request, 500)
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error().response()


def install_error_handlers(app: FastAPI) -> None:
    """A pydantic ValidationError gets no handler of its own: parse_body turns the client's
    into 400s, and one raised while building a response is a server bug (500)."""
    app.add_exception_handler(APIError, _api_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidRequestError, _invalid_request_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error_handler)
