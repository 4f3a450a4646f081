"""Errors as HTTP responses: an OpenAI error body (`openai.errors`) with its status."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from jaxhybrid.openai.errors import error_body, error_kind

log = logging.getLogger("jaxhybrid.serve")


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """The response of an error: its OpenAI body, and one log line for a client's mistake (a 500 logs its
    own traceback where it is caught)."""
    if status < 500:
        log.info("%d: %s", status, message[:200])
    return JSONResponse(error_body(message, error_kind(status), status, param), status_code=status, headers=headers)
