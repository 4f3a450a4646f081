"""The server's middleware: request bodies checked before anything parses them, request-id headers, the root
path, Bearer keys on /v1/*, errors nobody handled, and vLLM's server load."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import Response, StreamingResponse

from jaxhybrid.serve.http_errors import error_response
from jaxhybrid.serve.state import ServerState

log = logging.getLogger("jaxhybrid.serve")

# a JSON escape of half a surrogate pair (\ud800-\udfff): only a body holding one can decode to text that is
# not Unicode, so only such a body is checked further
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_INLINE_BYTES = 1 << 16  # smaller bodies are checked on the event loop, larger ones on a worker thread


class BodyGuard:
    """Every request body, before FastAPI parses it: at most `max_bytes` (a 413 as soon as the declared
    length or the bytes received pass it), UTF-8, one JSON value that Python's parser can nest, with no lone
    surrogate (`\\ud800`) in any string (a 400 each). Tokenizers and logs then never see text that is not
    Unicode, and a large body is read, not held up, while other requests are served."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(int(declared), scope, receive, send)
            return
        body, message = bytearray(), {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(len(body), scope, receive, send)
                return
        problem = check_json(bytes(body)) if len(body) <= _INLINE_BYTES else await asyncio.to_thread(
            check_json, bytes(body))
        if problem is not None:
            await error_response(400, problem, "body")(scope, receive, send)
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, size: int, scope, receive, send) -> None:
        message = f"the request body has {size} bytes, more than --max-request-body-bytes {self.max_bytes}"
        await error_response(413, message, "body")(scope, receive, send)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A `receive` that hands the app the body read already, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def check_json(body: bytes) -> str | None:
    """What is wrong with a request body, or None: not UTF-8, not JSON, nested past the parser's recursion
    limit, a lone surrogate."""
    if not body:
        return None  # FastAPI answers a missing body itself (the field it needs)
    try:
        value = json.loads(body.decode("utf-8"))
        if _SURROGATE_ESCAPE.search(body):  # pairs decode to one character; half a pair cannot be encoded
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeDecodeError as error:
        return f"the body is not valid UTF-8 ({error.reason} at byte {error.start})"
    except UnicodeEncodeError:
        return "the body holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
    except RecursionError:
        return "the body's JSON is nested too deep"
    except ValueError as error:
        return f"malformed JSON: {error}"
    return None


class _HttpOnly:
    """An ASGI middleware for HTTP requests (`http`); lifespan and websocket messages pass through."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await (self.http if scope["type"] == "http" else self.app)(scope, receive, send)

    async def http(self, scope, receive, send) -> None:
        raise NotImplementedError


class InternalErrors(_HttpOnly):
    """An exception no handler took: a 500 with an OpenAI body (no traceback for the client) and one log
    record, instead of Starlette's plain-text 500 that uvicorn logs a second time."""

    async def http(self, scope, receive, send) -> None:
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                await error_response(500, "Internal server error")(scope, receive, send)


class RequestIdHeader(_HttpOnly):
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own or a fresh
    one."""

    async def http(self, scope, receive, send) -> None:
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """FastAPI's (deprecated) `root_path` argument: the scope names the prefix, and routing matches a path
    with the prefix cut off (a path without it matches as is)."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def route_path(scope) -> str:
    """The path routing matches: without the root path where it starts with it (Starlette's rule)."""
    root, path = scope.get("root_path", ""), scope["path"]
    return path[len(root):] if root and (path == root or path.startswith(root + "/")) else path


class ApiKeyGuard:
    """Bearer auth on /v1/* (vLLM's paths); /health, /metrics, /tokenize and /version stay open."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and route_path(scope).startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            digest = hashlib.sha256(header.removeprefix("Bearer ").encode()).digest()
            if not header.startswith("Bearer ") or not any(secrets.compare_digest(digest, d) for d in self._digests):
                unauthorized = "Unauthorized: a valid API key is needed (Authorization: Bearer KEY)"
                await error_response(401, unauthorized)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def load_aware(state: ServerState) -> Callable:
    """vLLM's server load (GET /load): a generation request counts from its arrival until its response is
    out: a plain one when its handler returns, a stream when its last event is sent or its client left."""
    def wrap(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        @functools.wraps(handler)
        async def counted(*args, **kwargs) -> Response:
            state.server_load += 1
            try:
                response = await handler(*args, **kwargs)
            except BaseException:
                state.server_load -= 1
                raise
            if isinstance(response, StreamingResponse):
                response.body_iterator = released_at_end(state, response.body_iterator)
            else:
                state.server_load -= 1
            return response

        return counted

    return wrap


async def released_at_end(state: ServerState, lines: AsyncIterator) -> AsyncIterator:
    try:
        async for line in lines:
            yield line
    finally:
        state.server_load -= 1
