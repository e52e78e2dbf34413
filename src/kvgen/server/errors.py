"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgen.lora.adapter import UnknownAdapterError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _describe(error: dict) -> tuple[str, str | None]:
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    where = ".".join(location) or "body"
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {error.get('msg')}", None
    return f"{where}: {error.get('msg')}"[:2000], where[:200]


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> (one message naming every bad field, the first field)."""
    messages = [_describe(e) for e in errors[:8]]
    return "; ".join(m for m, _ in messages), messages[0][1] if messages else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param, error.code)

    @app.exception_handler(UnknownAdapterError)
    async def unknown_adapter(_: Request, error: UnknownAdapterError) -> JSONResponse:  # unloaded while the request was prepared
        return error_response(404, str(error), param="model", code="model_not_found")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(list(error.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), "invalid_request_error" if error.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:  # a bug: still OpenAI's shape, logged
        log.exception("unexpected server error", exc_info=error)
        return error_response(500, f"internal server error ({type(error).__name__})", "server_error")
