"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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
    return f"{where}: {error.get('msg')}", where


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        messages = [_describe(e) for e in error.errors()]
        return error_response(400, "; ".join(m for m, _ in messages), param=messages[0][1] if messages else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), "invalid_request_error" if error.status_code < 500 else "server_error")
