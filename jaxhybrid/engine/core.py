"""The engine: requests in, `RequestOutput`s out, one `step()` at a time (docs/engine.md#one-step).

A step is `schedule -> runner.dispatch -> update`. By default the engine runs one step ahead of the device
(`async_scheduling`, scheduler/resolve.py): it schedules and dispatches step N+1 before it reads step N's
tokens, so the host's work hides behind the device's; the serial loop is a debugging switch. One step ahead,
the output thread processes step N-1's tokens (`OutputProcessor`) while the engine's thread waits for step N.
Its results go out when `step()` returns, or with the next `step()` if they take longer.

The output side owns the request tables (`RequestTable`): the engine's thread adds requests, and lets the
scheduler free the sequences the output side ended (a stop string) in `_release_ended`; tokens their later
steps computed are dropped. An abort frees everything at once, or, for a request whose step is in flight,
when that step's update has run. The scheduler preempts under memory pressure by itself (recompute).

Failures stay small. A request whose output cannot be processed ends alone, with finish_reason "error". A
step that raises (schedule, the device, update) may have consumed the donated pools, so the engine starts
over: fresh pools and scheduler; started requests end with "error"; waiting ones are queued again.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
from jax.sharding import Mesh

import scheduler
from jaxhybrid.engine.output_processor import OutputProcessor
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt, RequestTable
from jaxhybrid.engine.stats import EngineLoad, EngineStats, count_preemptions, num_deferred
from jaxhybrid.engine.structured import StructuredOutputs
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.model import Model
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import DEFAULT_CONSTRAINT_WIDTH
from jaxhybrid.structured_output.grammar import ReasoningEnd
from jaxhybrid.worker.runner import BackgroundCompile, PendingStep, Runner
from jaxhybrid.worker.step import StepOutput
from scheduler import BatchPlan, SchedulerConfig

log = logging.getLogger("jaxhybrid")

OUTPUT_THREAD = "jaxhybrid-outputs"


@dataclass
class _Step:
    """A dispatched step on its way: on the device, then resolved, then processed on the output thread."""

    plan: BatchPlan
    out: StepOutput
    outputs: scheduler.StepOutputs  # on placeholders until the step's tokens are read
    result: scheduler.StepResult | None = None  # the tokens, once read
    processing: Future | None = None  # the output thread's work on it

    def outputs_of(self) -> tuple:
        """`OutputProcessor.process`'s arguments."""
        return self.plan, self.out, self.result, self.outputs


class Engine:
    """A model, its device pools and the scheduler state, serving requests step by step."""

    def __init__(self, model: Model, config: SchedulerConfig, tokenizer: Tokenizer | None = None, *, seed: int = 0,
                 max_logprobs: int = 20, mesh: Mesh | None = None, async_scheduling: bool = True,
                 max_sampling_constraints: int = DEFAULT_CONSTRAINT_WIDTH, reasoning_end: ReasoningEnd | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.async_scheduling = async_scheduling
        self.runner = Runner(model, config, max_logprobs=max_logprobs, mesh=mesh,
                             constraint_width=max_sampling_constraints)
        self.max_logprobs = self.runner.num_logprobs
        self.scheduler = scheduler.init_state(config)
        self.stats = EngineStats()
        self.table = RequestTable(model, config, tokenizer, self.max_logprobs, seed, max_sampling_constraints)
        self.output_processor = OutputProcessor(self.table, self.stats)
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, model.config.eos_token_id,
                                            config.num_spec_tokens, reasoning_end)
        self._output_thread = ThreadPoolExecutor(1, thread_name_prefix=OUTPUT_THREAD)
        # one step ahead, oldest first: a step whose outputs the output thread processes, a resolved step
        # waiting for it, the step on the device
        self._steps: deque[_Step] = deque()
        self._ids = itertools.count()

    def precompile(self, progress: bool = True) -> int:
        """Compile every bucket (`Runner.precompile`); then freeze what start-up allocated, so that the
        collections between steps walk only what serving allocates. Returns the number of buckets."""
        count = self.runner.precompile(progress)
        gc.collect()
        gc.freeze()
        return count

    def start_background_compile(self) -> BackgroundCompile:
        """Compile every bucket on a worker thread, smallest first, while the engine serves; returns at once
        (`Runner.start_background_compile`). A step whose bucket is not compiled yet compiles that one bucket,
        or waits for the worker's compile of it: nothing is compiled twice, and outputs are those of a
        precompiled engine. What start-up allocated is frozen first, as `precompile` does."""
        gc.collect()
        gc.freeze()
        return self.runner.start_background_compile()

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, prompt_logprobs_from: int = 0, group: str | None = None,
                    grammar: llguidance.LLMatcher | None = None, grammar_after_reasoning: bool = True) -> None:
        """Queue a request; raises ValueError naming the problem (nothing is queued then). Its n sequences
        share `group` (default: the request's own) with the requests a client sent together: while others
        wait, a group is admitted up to its fair share of the batch (`scheduler/admit.py`).

        `prompt_logprobs_from` > 0 reports prompt logprobs from that prompt position on only (the earlier
        ones are None): the scorer's candidates after a checkpoint, which a request can read only if it needs
        no logits before it. With the default every prompt position is reported, as vLLM does.

        `grammar`: the request's `structured_outputs` compiled already (`structured.compile`, off this thread,
        as the server does); else it is compiled here. With a reasoning parser the grammar starts after the
        reasoning, unless `grammar_after_reasoning` is false (a request that turned its reasoning off)."""
        table = self.table
        request = table.new_request(request_id, prompt, params or SamplingParams(), cache_salt, prompt_logprobs_from,
                                    group)
        if request.params.structured_outputs is not None and grammar is None:
            grammar = self.structured.compile(request.params.structured_outputs)
        constraints = table.constraint_entries(request.params)
        for index in range(request.params.n):
            sequence_id = str(next(self._ids))
            try:
                self.scheduler = scheduler.add_request(self.scheduler, table.scheduler_sequence(
                    sequence_id, request, request.seed + index))
            except ValueError as error:
                for queued in request.sequences:
                    self.scheduler = scheduler.abort_request(self.scheduler, queued)
                    table.drop_sequence(queued)
                message = str(error).replace(f"request {sequence_id!r}", f"request {request_id!r}")
                raise type(error)(message if request_id in message else f"request {request_id!r}: {message}") from error
            table.add_sequence(request, sequence_id, constraints)
        if request.params.structured_outputs is not None:
            self.structured.add(request.sequences, grammar, prompt.token_ids, grammar_after_reasoning)
        table.requests[request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish_reason "abort"), None if it is unknown."""
        with self.output_processor.lock:
            request = self.table.requests.get(request_id)
            if request is None:
                return None
            for sequence_id, output in zip(request.sequences, request.outputs, strict=True):
                if not output.finished():
                    self.table.end(self.table.sequences[sequence_id], "abort", None)
            final = request.snapshot()
        self._release_ended()
        return final

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """vLLM's `LLMEngine.abort_request`: `abort` each of them."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix state and checkpoint (vLLM's `reset_prefix_cache`); an idle engine only."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset_prefix_cache needs an idle engine: requests are still running")
        self.scheduler = scheduler.init_state(self.config)

    def has_unfinished_requests(self) -> bool:
        return bool(self.table.requests) or self.scheduler.has_work() or self.on_device

    @property
    def on_device(self) -> bool:
        """A step has been dispatched whose tokens have not been read."""
        return bool(self._steps) and self._steps[-1].result is None

    @property
    def processing(self) -> Future | None:
        """The output thread's work on the oldest step, if it has been handed one."""
        return self._steps[0].processing if self._steps else None

    def load(self) -> EngineLoad:
        state, config = self.scheduler, self.config
        return EngineLoad(len(state.running), len(state.waiting), 1 - state.blocks.num_free / (config.num_blocks - 1),
                          1 - state.slots.num_free_or_cached / (config.num_state_slots - 1), state.num_preemptions,
                          num_deferred(state))

    # -- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that gained tokens or finished in it (one step
        ahead: the step before's, while this one runs)."""
        try:
            if self.async_scheduling or self._steps:  # switched to serial: drain the ahead loop
                return self._step_ahead()
            if not self.scheduler.has_work():
                return []
            plan = self._schedule()
            out = self._sampled(plan, self._launch(plan), None)
            result = self.runner.fetch(out)
            self.scheduler, outputs = scheduler.update(self.scheduler, plan, result)
            self.structured.advance(outputs)
            request_outputs = self.output_processor.process(plan, out, result, outputs)
            self._release_ended()
            return request_outputs
        except Exception:
            log.exception("engine step %d failed; starting over with fresh pools", self.stats.steps)
            return self._start_over()

    def _step_ahead(self) -> list[RequestOutput]:
        """Schedule and dispatch step N+1, then wait for N while N-1's outputs are processed on the output
        thread; N+1 runs while N is resolved, N+1 is updated on placeholders and N+2 is scheduled
        (scheduler/resolve.py). Returns the outputs processed by then: N-1's, else N-2's (and N's too when
        nothing runs after it)."""
        steps, ahead, request_outputs, previous = self._steps, None, [], None
        if self.scheduler.has_work():
            plan = self._schedule()
            ahead = (plan, self._launch(plan))
            gc.collect(0)  # while the device is busy: the cyclic collector stays off the critical path
        waiting = next((step for step in steps if step.result is not None and step.processing is None), None)
        if waiting is not None:
            request_outputs = self._processed()  # one step at a time: N-2's, done unless it outlasted a step
            waiting.processing = self._output_thread.submit(self.output_processor.process, *waiting.outputs_of())
        if self.on_device:
            running = steps[-1]
            running.result = self.runner.fetch(running.out)  # releases the GIL: the output thread runs meanwhile
            self.scheduler, running.outputs = scheduler.resolve(self.scheduler, running.outputs, running.result)
            self.structured.advance(running.outputs)
            previous = running.result
        if ahead is not None:
            plan, out = ahead[0], self._sampled(*ahead, previous)
            placeholders = scheduler.placeholder_result(plan, self.config.num_spec_tokens)
            self.scheduler, outputs = scheduler.update(self.scheduler, plan, placeholders)
            steps.append(_Step(plan, out, outputs))
        if not self.on_device:  # nothing runs to hide output processing behind: finish it now
            request_outputs += self._processed()
            while steps:
                request_outputs += self.output_processor.process(*steps.popleft().outputs_of())
        elif self.processing is not None and self.processing.done():
            request_outputs += self._processed()
        self._release_ended()
        return request_outputs

    def _launch(self, plan: BatchPlan) -> StepOutput | PendingStep:
        """Dispatch `plan`: whole, or, with a constrained row, its first half (its masks are filled later)."""
        constraints = self.table.plan_constraints(plan)
        if self.structured.in_plan(plan):
            return self.runner.forward(plan, constraints)
        return self.runner.dispatch(plan, constraints)

    def _sampled(self, plan: BatchPlan, launched: StepOutput | PendingStep,
                 previous: scheduler.StepResult | None) -> StepOutput:
        """A launched step's output: a half step finished under its rows' masks, once the grammars have
        taken the tokens of the step before (`previous`, which its drafts may name by placeholder)."""
        if not isinstance(launched, PendingStep):
            return launched
        return self.runner.finish(launched, self.structured.token_masks(plan, self.runner.mask_words, previous))

    def _processed(self) -> list[RequestOutput]:
        """The output thread's results for the oldest step (waits for them); the step leaves the pipeline. A
        snapshot taken before an abort that has ended its request since is dropped: the abort returned the
        request's final output."""
        if self.processing is None:
            return []
        outputs = self._steps.popleft().processing.result()
        return [output for output in outputs if output.finished or output.request_id in self.table.requests]

    def _release_ended(self) -> None:
        """Free in the scheduler the sequences the output side ended that it still runs (a stop string)."""
        ended = self.table.ended
        while ended:
            sequence_id = ended.popleft()
            if sequence_id in self.scheduler.requests:
                self.scheduler = scheduler.abort_request(self.scheduler, sequence_id)
            self.structured.drop(sequence_id)

    def _schedule(self) -> BatchPlan:
        running, num_preemptions = self.scheduler.running, self.scheduler.num_preemptions
        self.scheduler, plan = scheduler.schedule(self.scheduler)
        if self.scheduler.num_preemptions != num_preemptions:
            count_preemptions(running, self.scheduler, num_preemptions, self.table)
        for request in self.table.note_scheduled(plan):
            self.stats.count_cache_query(request)
        return plan

    def _start_over(self) -> list[RequestOutput]:
        """After a failed step: fresh pools and scheduler; started requests end with "error", the rest requeue."""
        self.stats.failed_steps += 1
        with contextlib.suppress(Exception):  # the output thread must be idle before the requests are ended
            self._processed()
        self._steps.clear()
        self.runner.reset_state()
        self.scheduler = scheduler.init_state(self.config)
        self.structured.grammars = {sequence_id: grammar for sequence_id, grammar in self.structured.grammars.items()
                                    if sequence_id in self.table.sequences}
        failed = []
        for request in list(self.table.requests.values()):
            if request.metrics.first_scheduled_time is None:
                for index, sequence_id in enumerate(request.sequences):
                    self.scheduler = scheduler.add_request(self.scheduler, self.table.scheduler_sequence(
                        sequence_id, request, request.seed + index))
                continue
            for sequence_id, output in zip(request.sequences, request.outputs, strict=True):
                if not output.finished():
                    self.table.end(self.table.sequences[sequence_id], "error", None)
            failed.append(request.snapshot())
        return failed
