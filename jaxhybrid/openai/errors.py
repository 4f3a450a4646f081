"""Errors as OpenAI error bodies: a 400 (or 404) that names the field, and every other status the server
answers with (the server's HTTP responses of them: `serve.http_errors`)."""

from __future__ import annotations

import re

# OpenAI's Python client names its exceptions after these
KINDS = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
         429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class BadRequest(ValueError):
    """An input problem: a 400 whose body names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_kind(status: int) -> str:
    """The error body's `type` for an HTTP status."""
    return KINDS.get(status, "ClientError" if status < 500 else "ServerError")


def as_bad_request(error: Exception) -> BadRequest:
    """A ValueError from the engine or `SamplingParams` as a 400 naming its field where the message does."""
    message = re.sub(r"^request '[^']*': ", "", str(error))  # the engine's ids are no business of the client
    param = None
    if message.startswith("SamplingParams."):
        param = message.split()[0].removeprefix("SamplingParams.")
    elif message.startswith("cache_salt"):
        param = "cache_salt"
    elif "token id" in message or "prompt" in message:
        param = "prompt"
    elif "checkpoint" in message or "marker" in message:
        param = "prompt"
    return BadRequest(message, param)
