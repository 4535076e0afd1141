"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure the API reports.

Handlers raise :class:`OpenAIError`; the app's exception handlers (:func:`install_error_handlers`)
turn it, FastAPI's request-validation errors (malformed JSON, wrong types: 400, never 422, with
``param`` naming the field), unknown routes and unexpected exceptions into that shape. Streaming
responses that fail after the first chunk send :func:`sse_error` instead.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("moetier.server")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class OpenAIError(Exception):
    """An API error with its HTTP status; ``param`` names the offending request field."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(message, param=param, code=code)


def context_length_exceeded(prompt_tokens: int, window: int, param: str = "messages") -> OpenAIError:
    """The prompt alone fills the window (one token must stay free to generate)."""
    return OpenAIError(
        f"This model's maximum context length is {window} tokens. However, your prompt has {prompt_tokens} "
        f"tokens, which leaves no room to generate (the prompt must be shorter than {window} tokens). "
        "Please reduce the length of the prompt.",
        param=param,
        code="context_length_exceeded",
    )


def model_not_found(name: str, served: list[str]) -> OpenAIError:
    return OpenAIError(
        f"The model `{name}` does not exist. This server serves: {', '.join(served)}.",
        status=404,
        type=NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def sse_error(error: OpenAIError) -> str:
    """The Server-Sent-Events lines for an error met mid-stream (the stream then ends with ``[DONE]``)."""
    return f"data: {json.dumps(error.body())}\n\n"


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _param_from_location(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; None for the whole body."""
    parts = [p for p in loc if p != "body"]
    # pydantic adds the union member it tried ("str", "list[int]", "function-after[...]"): not a field.
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"}):
            continue
        else:
            text += f".{part}" if text else str(part)
    return text or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """The first pydantic error as a 400, its location as ``param``."""
    if not errors:
        return invalid("The request body is invalid.")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return invalid("We could not parse the JSON body of your request. The request body must be valid JSON.")
    param = _param_from_location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "model_attributes_type" and param is None:
        # Also what a body without ``Content-Type: application/json`` gives: FastAPI does not parse
        # it (a CSRF guard for servers on localhost), so say what to send.
        message = "The request body must be a JSON object, sent with 'Content-Type: application/json'."
    elif param is not None:
        message = f"Invalid value for '{param}': {_clean(message)}"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the request)"
    return invalid(message, param=param, code=_code_for(kind))


def _clean(message: str) -> str:
    # pydantic's custom-validator errors read "Value error, <our message>".
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def _code_for(kind: str) -> str | None:
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return "invalid_type"
    return "invalid_value" if kind else None


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns is OpenAI-shaped."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        kind = NOT_FOUND if status == 404 else INVALID_REQUEST if status < 500 else SERVER_ERROR
        message = str(exc.detail) if exc.detail and exc.detail != phrase else f"{phrase}: {request.url.path}"
        return JSONResponse(error_body(message, kind), status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s", request.url.path)
        return error_response(internal_error(exc))


def internal_error(exc: BaseException) -> OpenAIError:
    return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", status=500, type=SERVER_ERROR)
