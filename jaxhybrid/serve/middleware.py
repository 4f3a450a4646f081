"""The server's middleware: request-id headers, the root path, Bearer keys on /v1/*, and vLLM's server load."""

from __future__ import annotations

import functools
import hashlib
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

if TYPE_CHECKING:
    from jaxhybrid.serve.app import ServerState


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own or a fresh
    one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
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
