"""The engine's one background thread. Handlers only submit and stream; only this thread touches the
`Engine`, so the scheduler and the device state never see two callers.

Handlers put additions and aborts in an inbox; the thread drains it between steps, runs a step while
any request is unfinished, and hands the step's `RequestOutput`s to their requests' asyncio queues in
one call into the event loop (`call_soon_threadsafe`, which wakes the loop through a pipe: once a step,
not once a request). A request leaves the engine when it finishes or when its
stream is closed early (a client disconnect cancels the handler, and closing the stream aborts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve.metrics import ServerMetrics

log = logging.getLogger("jaxhybrid.serve")


class QueueFull(Exception):
    """More sequences than `max_queued` would be in the engine (a 429)."""


class EngineUnavailable(Exception):
    """The server is draining for shutdown, or the engine thread died (a 503)."""


@dataclass
class _Submission:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str | None
    admitted: concurrent.futures.Future
    stream: RequestStream


class RequestStream:
    """One request's outputs, in order, up to its final one; `close()` before the end aborts it."""

    def __init__(self, owner: EngineLoop, request_id: str, params: SamplingParams):
        self.request_id, self.params, self._owner, self._num_sequences = request_id, params, owner, params.n
        self._outputs: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.put = self._outputs.put_nowait  # on the event loop's thread only
        self.done = False
        owner._num_sequences += params.n

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        output = await self._outputs.get()
        if isinstance(output, BaseException):
            self.close()
            raise output
        if output.finished:
            self._release()
        return output

    def deliver(self, output: RequestOutput | BaseException) -> None:
        """From any thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed (shutdown)
            self.loop.call_soon_threadsafe(self.put, output)

    def close(self) -> None:
        if not self.done:
            self._release()
            self._owner._submit(("abort", self.request_id))

    def _release(self) -> None:
        self.done = True
        self._owner._num_sequences -= self._num_sequences


class EngineLoop:
    """Runs `engine` on a daemon thread; `generate` streams one request's outputs to an asyncio caller."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_queued: int | None = None,
                 watchdog_timeout: float = 60.0, idle_poll: float = 0.5):
        self.engine, self.metrics = engine, metrics
        self.max_queued, self.watchdog_timeout, self._idle_poll = max_queued, watchdog_timeout, idle_poll
        self.draining = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._token_times: dict[str, tuple[float, int]] = {}  # request id -> (last token time, tokens so far)
        self._num_sequences = 0  # submitted and not yet ended, n counting n (the event loop's count)
        self._busy = False
        self._last_progress = time.monotonic()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxhybrid-engine", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread; requests still in the engine are aborted (finish_reason "abort")."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the event loop's side ----------------------------------------------------------------------------

    async def add(self, request_id: str, prompt: Prompt, params: SamplingParams,
                  cache_salt: str | None = None) -> RequestStream:
        """Submit a request; returns its stream once the engine has taken it. Raises ValueError for bad
        input (nothing is queued then), QueueFull, or EngineUnavailable."""
        if self.draining or self._error is not None:
            raise EngineUnavailable("the server is shutting down" if self.draining else "the engine has stopped")
        if self.max_queued is not None and self._num_sequences + params.n > self.max_queued:
            raise QueueFull(f"{self._num_sequences} sequences are queued or running (max {self.max_queued})")
        stream = RequestStream(self, request_id, params)
        admitted = concurrent.futures.Future()
        self._submit(("add", _Submission(request_id, prompt, params, cache_salt, admitted, stream)))
        try:
            await asyncio.wrap_future(admitted)
        except BaseException:
            stream.close()
            raise
        return stream

    def healthy(self) -> bool:
        """False when the thread died, or requests wait and no step has completed for `watchdog_timeout`."""
        if self._error is not None or not self._thread.is_alive():
            return False
        return not (self._busy and time.monotonic() - self._last_progress > self.watchdog_timeout)

    def _submit(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain_inbox()
                self._busy = self.engine.has_unfinished_requests()
                if not self._busy:
                    self._last_progress = time.monotonic()
                    self.metrics.observe_engine(self.engine.load(), self.engine.stats)  # aborts free things too
                    self._wake.wait(self._idle_poll)
                    continue
                outputs = self.engine.step()
                self._last_progress = time.monotonic()
                self.metrics.observe_engine(self.engine.load(), self.engine.stats)
                self._deliver(outputs)
            self._drain_inbox()
            for request_id in list(self._streams):
                self._abort(request_id)
        except BaseException as error:  # a bug outside the engine's own recovery: fail everyone, /health 503
            log.exception("the engine thread died")
            self._error = error
            for stream in self._streams.values():
                stream.deliver(EngineUnavailable("the engine has stopped"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._abort(item)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params, cache_salt=item.cache_salt)
            except Exception as error:  # bad input: the caller's 400; nothing was queued
                item.admitted.set_exception(error)
                continue
            self._streams[item.request_id] = item.stream
            item.admitted.set_result(None)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        output = self.engine.abort(request_id)
        self._token_times.pop(request_id, None)
        if output is not None:
            self.metrics.observe_finished(output, None if stream is None else stream.params)
            if stream is not None:
                stream.deliver(output)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams, one call into each event loop (in practice one loop)."""
        batches = defaultdict(list)
        now = time.time()
        for output in outputs:
            stream = self._route(output, now)
            if stream is not None:
                batches[stream.loop].append((stream.put, output))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # the event loop is closed (shutdown)
                loop.call_soon_threadsafe(_put_all, batch)

    def _route(self, output: RequestOutput, now: float) -> RequestStream | None:
        """Its stream (the metrics see it on the way); None once the stream is gone."""
        count = sum(len(c.token_ids) for c in output.outputs)
        last = self._token_times.get(output.request_id)
        if last is not None and count > last[1]:
            self.metrics.itl.observe(now - last[0])
        if output.finished:
            self._token_times.pop(output.request_id, None)
            stream = self._streams.pop(output.request_id, None)
            self.metrics.observe_finished(output, None if stream is None else stream.params)
            return stream
        if count and (last is None or count > last[1]):
            self._token_times[output.request_id] = (now, count)
        return self._streams.get(output.request_id)


def _put_all(batch: list[tuple[Callable, RequestOutput]]) -> None:
    for put, output in batch:
        put(output)
