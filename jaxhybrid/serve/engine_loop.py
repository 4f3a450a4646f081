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

import llguidance

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.stat_logger import RequestLogger, StatLogger
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve.metrics import ServerMetrics

log = logging.getLogger("jaxhybrid.serve")


class QueueFull(Exception):
    """More sequences or prompt tokens than the queue's bounds would be in the engine (a 429)."""


class EngineUnavailable(Exception):
    """The server is draining for shutdown, or the engine thread died (a 503)."""


@dataclass
class _Submission:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str | None
    group: str | None
    admitted: concurrent.futures.Future
    stream: RequestStream
    grammar: llguidance.LLMatcher | None = None  # compiled off the engine's thread
    grammar_after_reasoning: bool = True


class RequestStream:
    """One request's outputs, in order, up to its final one; `close()` before the end aborts it."""

    def __init__(self, owner: EngineLoop, request_id: str, params: SamplingParams, num_tokens: int):
        self.request_id, self.params, self._owner = request_id, params, owner
        self._num_sequences, self._num_tokens = params.n, num_tokens
        self._outputs: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.put = self._outputs.put_nowait  # on the event loop's thread only
        self.done = False
        owner._num_sequences += params.n
        owner._num_tokens += num_tokens

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
        self._owner._num_tokens -= self._num_tokens


class EngineLoop:
    """Runs `engine` on a daemon thread; `add` streams one request's outputs to an asyncio caller.

    The queue is bounded: at most `max_queued` sequences and `max_queued_tokens` prompt tokens (n counting
    n times) are in the engine at once; past either a request is refused (429), whatever it asks for. The
    thread beats once per iteration (a step, or an idle wait): no beat for `watchdog_timeout` seconds means
    it is stuck, /health answers 503, and `on_stuck` (the server's: exit, so that a supervisor restarts it)
    is called once with the reason. `stat_logger` logs vLLM's periodic stats line from the thread, between
    steps; `request_logger` logs each request as it is taken and as it ends."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_queued: int | None = None,
                 max_queued_tokens: int | None = None, watchdog_timeout: float = 60.0, idle_poll: float = 0.5,
                 on_stuck: Callable[[str], None] | None = None, stat_logger: StatLogger | None = None,
                 request_logger: RequestLogger | None = None):
        self.engine, self.metrics = engine, metrics
        self.stat_logger, self.request_logger = stat_logger, request_logger
        self.max_queued, self.max_queued_tokens = max_queued, max_queued_tokens
        self.watchdog_timeout, self._idle_poll, self._on_stuck = watchdog_timeout, idle_poll, on_stuck
        self.draining = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._token_times: dict[str, tuple[float, int]] = {}  # request id -> (last token time, tokens so far)
        self._num_sequences = 0  # submitted and not yet ended, n counting n (the event loop's count)
        self._num_tokens = 0  # their prompt tokens, likewise
        self._heartbeat = time.monotonic()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxhybrid-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="jaxhybrid-watchdog", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._heartbeat = time.monotonic()
            if self.stat_logger is not None:
                self.stat_logger.reset(self.engine.stats, self.engine.load())
            self._thread.start()
            self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread; requests still in the engine are aborted (finish_reason "abort")."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the event loop's side ----------------------------------------------------------------------------

    async def add(self, request_id: str, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None,
                  group: str | None = None, grammar: llguidance.LLMatcher | None = None,
                  grammar_after_reasoning: bool = True) -> RequestStream:
        """Submit a request (`group`: the client request it is part of, `Engine.add_request`); returns its
        stream once the engine has taken it. Raises ValueError for bad input (nothing is queued then),
        QueueFull, or EngineUnavailable."""
        if self.draining or not self.healthy():
            raise EngineUnavailable("the server is shutting down" if self.draining else "the engine has stopped")
        self.check_room(params.n, params.n * len(prompt.token_ids))
        stream = RequestStream(self, request_id, params, params.n * len(prompt.token_ids))
        admitted = concurrent.futures.Future()
        self._submit(("add", _Submission(request_id, prompt, params, cache_salt, group, admitted, stream,
                                              grammar, grammar_after_reasoning)))
        try:
            await asyncio.wait_for(asyncio.wrap_future(admitted), self.watchdog_timeout)
        except TimeoutError as error:
            stream.close()
            raise EngineUnavailable("the engine did not take the request in time") from error
        except BaseException:
            stream.close()
            raise
        return stream

    @property
    def queued(self) -> tuple[int, int]:
        """(sequences, prompt tokens) submitted and not yet ended, n counting n."""
        return self._num_sequences, self._num_tokens

    def check_room(self, sequences: int, tokens: int) -> None:
        """QueueFull unless `sequences` more sequences with `tokens` prompt tokens fit in the queue now."""
        if self.max_queued is not None and self._num_sequences + sequences > self.max_queued:
            raise QueueFull(f"{self._num_sequences} sequences are queued or running and this request adds "
                            f"{sequences} (--max-num-queued-requests {self.max_queued})")
        if self.max_queued_tokens is not None and self._num_tokens + tokens > self.max_queued_tokens:
            raise QueueFull(f"{self._num_tokens} prompt tokens are queued or running and this request adds {tokens} "
                            f"(--max-num-queued-tokens {self.max_queued_tokens})")

    def healthy(self) -> bool:
        """False when the thread died, or has not come round its loop for `watchdog_timeout` seconds."""
        return self.stuck_reason() is None

    def stuck_reason(self) -> str | None:
        if self._error is not None or (self._thread.ident is not None and not self._thread.is_alive()):
            return f"the engine thread died: {self._error!r}"
        silent = time.monotonic() - self._heartbeat
        if silent > self.watchdog_timeout and not self.engine.runner.step_compiling:  # a compile is no hang
            return f"the engine thread has not completed a step or an idle wait for {silent:.0f} s"
        return None

    def _watch(self) -> None:
        """Report the engine thread turning stuck or dead (within a quarter of the timeout, at most a second
        late), and hand it to `on_stuck`, whose call ends the watch."""
        reported = False
        while not self._stop.wait(min(1.0, self.watchdog_timeout / 4)):
            reason = self.stuck_reason()
            if reason is not None and self._on_stuck is not None:  # it reports (without logging's locks)
                self._on_stuck(reason)
                return
            if reason is not None and not reported:
                log.error("engine unhealthy: %s", reason)
            reported = reason is not None

    def _submit(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                self._wake.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._observe()  # aborts free things too
                    self._wake.wait(self._idle_poll)
                    continue
                outputs = self.engine.step()
                self._observe()
                self._deliver(outputs)
            self._drain_inbox()
            for request_id in list(self._streams):
                self._abort(request_id)
        except BaseException as error:  # a bug outside the engine's own recovery: fail everyone, /health 503
            log.exception("the engine thread died")
            self._error = error
            for stream in self._streams.values():
                stream.deliver(EngineUnavailable("the engine has stopped"))

    def _observe(self) -> None:
        """The engine's load and totals to the metrics, and to the stats line when its interval is up."""
        load = self.engine.load()
        self.metrics.observe_engine(load, self.engine.stats)
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.engine.stats, load)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._abort(item)
                continue
            if not item.admitted.set_running_or_notify_cancel():  # its caller gave up waiting (it left)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params, cache_salt=item.cache_salt,
                                        group=item.group, grammar=item.grammar,
                                        grammar_after_reasoning=item.grammar_after_reasoning)
            except ValueError as error:  # bad input: the caller's 400, without the engine's id; nothing queued
                message = str(error).replace(f"request {item.request_id!r}: ", "")
                item.admitted.set_exception(ValueError(message.replace(f"request {item.request_id!r}", "the request")))
                continue
            except Exception as error:
                item.admitted.set_exception(error)
                continue
            self._streams[item.request_id] = item.stream
            item.admitted.set_result(None)
            if self.request_logger is not None:
                self.request_logger.log_received(item.request_id, item.prompt, item.params)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        output = self.engine.abort(request_id)
        self._token_times.pop(request_id, None)
        if output is not None:
            self._finished(output, stream)
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
            self._finished(output, stream)
            return stream
        if count and (last is None or count > last[1]):
            self._token_times[output.request_id] = (now, count)
        return self._streams.get(output.request_id)


    def _finished(self, output: RequestOutput, stream: RequestStream | None) -> None:
        self.metrics.observe_finished(output, None if stream is None else stream.params)
        if self.request_logger is not None:
            self.request_logger.log_finished(output)


def _put_all(batch: list[tuple[Callable, RequestOutput]]) -> None:
    for put, output in batch:
        put(output)
