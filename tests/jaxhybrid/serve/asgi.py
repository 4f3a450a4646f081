"""Driving the app in process: httpx's ASGI transport over a started engine loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI

from jaxhybrid.llm import LLM
from jaxhybrid.serve.engine_loop import EngineLoop


def drive(llm: LLM, loop: EngineLoop, app: FastAPI, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """Run `body(client)` against `app` with `loop` started, then check that nothing is left in the engine
    (no request, slot or block held)."""

    async def main() -> None:
        loop.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test",
                                         timeout=60) as client:
                await body(client)
        finally:
            loop.stop()

    asyncio.run(main())
    assert not any(llm.engine.load()[:4]), llm.engine.load()
