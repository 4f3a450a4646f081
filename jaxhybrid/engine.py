"""The engine: requests in, `RequestOutput`s out, one `step()` at a time (DESIGN "One engine step").

A step is `schedule -> runner.dispatch -> update`. By default the engine runs one step ahead of the
device (`async_scheduling`, scheduler/resolve.py): it schedules and dispatches step N+1 before it reads
step N's tokens, so the host's work hides behind the device's; the serial loop is a debugging switch.
Around it the host turns a request into scheduler requests (one per completion, `n` of them, each with
its packed sampling record and checkpoint), and the step's tokens into outputs: incremental text, stop
strings, logprobs and metrics. One step ahead, that output processing runs on a thread of its own while
the engine's thread waits for the device: step N-1's outputs are processed during the wait for step N
and handed out when `step()` returns, or, if they take longer than that, when the next `step()` does (the
engine's thread waits for them only before it hands the thread the next step's), so the engine's thread
only schedules, dispatches and updates. A request that a stop string (or a failure of its own) ended
there is released by the scheduler on the engine's thread after; tokens its later steps computed are
dropped. The output side owns the request tables: the engine's thread only adds requests and marks them
scheduled, and `abort` waits for the output thread (the lock). The scheduler preempts under
memory pressure by itself (recompute); an abort frees everything at once, or, for a request whose step
is in flight, when that step's update has run. (Steps run on the device in dispatch order, each on the
pools the one before returned, so a block or slot freed while a step is in flight may go to a request of
the next step.)

Failures stay as small as they can: a request whose output cannot be processed (its detokenizer
raises, say) ends alone, with finish_reason "error". A step that raises (schedule, the device, update)
may have consumed the donated pools and left hashes over states that were never written, so the
engine starts over: fresh pools, a fresh scheduler (an empty prefix cache), the requests it had
started end with "error", and those still waiting are queued again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from jax.sharding import Mesh

import scheduler
from jaxhybrid.detokenize import IncrementalDetokenizer
from jaxhybrid.model import Model
from jaxhybrid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from jaxhybrid.runner import Runner, StepOutput, to_host
from jaxhybrid.sampling import Logprobs, batch_constraints, constraint_entries
from jaxhybrid.sampling_params import SamplingParams
from jaxhybrid.tokenizer import Tokenizer
from scheduler import BatchPlan, FinishReason, RowKind, SchedulerConfig

log = logging.getLogger("jaxhybrid")

OUTPUT_THREAD = "jaxhybrid-outputs"
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class Prompt(NamedTuple):
    """A prompt as the scheduler takes it: the marker already stripped, its position recorded."""

    token_ids: tuple[int, ...]
    checkpoint_position: int | None = None
    text: str | None = None


@dataclass
class EngineStats:
    """Running totals since start (the server's metrics read them)."""

    steps: int = 0
    prefill_tokens: int = 0      # prompt tokens computed (prefix hits excluded, recomputation included)
    prefix_cache_queries: int = 0  # prompt tokens of requests scheduled for the first time
    cached_tokens: int = 0       # ... of them served from the prefix cache or a checkpoint (the hits)
    checkpoint_queries: int = 0  # requests with a checkpoint marker scheduled for the first time
    checkpoint_hits: int = 0     # ... of them that started at or beyond their checkpoint
    generation_tokens: int = 0
    hit_copies: int = 0          # prefix-cache and checkpoint hits (state pages copied in)
    pair_copies: int = 0         # consumers paired with their producer in one step
    publishes: int = 0
    materializations: int = 0
    draft_tokens: int = 0        # MTP drafts verified
    accepted_tokens: int = 0     # ... and accepted
    failed_steps: int = 0        # steps that raised (the engine started over)
    # each recent step's computed tokens (prompt + generated), for the server's per-step histogram to drain
    step_tokens: deque[int] = field(default_factory=lambda: deque(maxlen=4096))


class EngineLoad(NamedTuple):
    """What the engine holds now; sequences count once per completion (n > 1 counts n)."""

    running: int
    waiting: int
    kv_cache_usage: float    # KV blocks held by requests, of all (blocks only the prefix cache holds are free)
    state_slot_usage: float  # state slots held by requests, the same way
    num_preemptions: int


@dataclass
class _Request:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    sequences: list[str]  # scheduler request ids, one per completion
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    seed: int
    cache_salt: str | None
    prompt_logprobs_from: int = 0
    num_cached_tokens: int = 0


@dataclass
class _Sequence:
    request: _Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    scheduled: bool = False

    @property
    def sequence_id(self) -> str:
        return self.request.sequences[self.index]

    @property
    def output(self) -> CompletionOutput:
        return self.request.outputs[self.index]


class Engine:
    """A model, its device pools and the scheduler state, serving requests step by step."""

    def __init__(self, model: Model, config: SchedulerConfig, tokenizer: Tokenizer | None = None, *, seed: int = 0,
                 max_logprobs: int = 20, mesh: Mesh | None = None, async_scheduling: bool = True):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[BatchPlan, StepOutput, scheduler.StepOutputs] | None = None
        # one step ahead: the last resolved step, whose outputs are processed while the next one runs
        self._unprocessed: tuple[BatchPlan, StepOutput, scheduler.StepResult, scheduler.StepOutputs] | None = None
        self._processing: Future | None = None
        self._output_thread = ThreadPoolExecutor(1, thread_name_prefix=OUTPUT_THREAD)
        self._outputs_lock = threading.Lock()  # held while outputs are processed, and by abort
        self._ended: deque[str] = deque()  # sequences the output side ended; the scheduler may still hold them
        self.runner = Runner(model, config, max_logprobs=max_logprobs, mesh=mesh)
        self.max_logprobs = self.runner.num_logprobs
        self.scheduler = scheduler.init_state(config)
        self._requests: dict[str, _Request] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)
        self.stats = EngineStats()
        self._logprob_sequences: set[str] = set()  # running sequences that report logprobs
        self._constraints: dict[str, np.ndarray] = {}  # running sequences' constraint entries, if they have any

    def precompile(self, progress: bool = True) -> int:
        """Compile every bucket (`Runner.precompile`); then freeze what start-up allocated, so that the
        collections between steps walk only what serving allocates. Returns the number of buckets."""
        count = self.runner.precompile(progress)
        gc.collect()
        gc.freeze()
        return count

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, prompt_logprobs_from: int = 0) -> None:
        """Queue a request; raises ValueError naming the problem (nothing is queued then).

        `prompt_logprobs_from` > 0 reports prompt logprobs from that prompt position on only (the earlier
        ones are None): the scorer's candidates after a checkpoint, which a request can read only if it needs
        no logits before it. With the default every prompt position is reported, as vLLM does."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = self._checked_params(params)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        seed = int(self._seeds.integers(2**63)) if params.seed is None else params.seed
        request = _Request(request_id, prompt, params, [], [], None if params.prompt_logprobs is None else [None],
                           RequestMetrics(time.time()), seed, cache_salt, prompt_logprobs_from)
        entries = self._constraint_entries(params) if params.has_constraints() else None
        for index in range(params.n):
            sequence_id = str(next(self._ids))
            try:
                self.scheduler = scheduler.add_request(self.scheduler, self._scheduler_request(
                    sequence_id, request, seed + index))
            except ValueError as error:
                for queued in request.sequences:
                    self.scheduler = scheduler.abort_request(self.scheduler, queued)
                    del self._sequences[queued]
                    self._logprob_sequences.discard(queued)
                    self._constraints.pop(queued, None)
                message = str(error).replace(f"request {sequence_id!r}", f"request {request_id!r}")
                raise type(error)(message if request_id in message else f"request {request_id!r}: {message}") from error
            request.sequences.append(sequence_id)
            request.outputs.append(CompletionOutput(index, "", [], 0.0 if params.logprobs is not None else None,
                                                    [] if params.logprobs is not None else None))
            self._sequences[sequence_id] = _Sequence(request, index, self._detokenizer(prompt, params))
            if params.logprobs is not None or params.prompt_logprobs is not None:
                self._logprob_sequences.add(sequence_id)
            if entries is not None:
                self._constraints[sequence_id] = entries
        self._requests[request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish_reason "abort"), None if it is unknown."""
        with self._outputs_lock:
            request = self._requests.get(request_id)
            if request is None:
                return None
            for sequence_id, output in zip(request.sequences, request.outputs, strict=True):
                if not output.finished():
                    self._end(self._sequences[sequence_id], "abort", None)
            final = self._snapshot(request)
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
        return bool(self._requests) or self.scheduler.has_work() or self._in_flight is not None

    def load(self) -> EngineLoad:
        state, config = self.scheduler, self.config
        return EngineLoad(len(state.running), len(state.waiting), 1 - state.blocks.num_free / (config.num_blocks - 1),
                          1 - state.slots.num_free_or_cached / (config.num_state_slots - 1), state.num_preemptions)

    # -- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that gained tokens or finished in it (one step
        ahead: the step before's, while this one runs)."""
        try:
            if self.async_scheduling or self._in_flight is not None:  # switched to serial: drain the ahead loop
                return self._step_ahead()
            if not self.scheduler.has_work():
                return []
            plan = self._schedule()
            out = self.runner.dispatch(plan, self._plan_constraints(plan))
            result = self.runner.fetch(out)
            self.scheduler, outputs = scheduler.update(self.scheduler, plan, result)
            request_outputs = self._finish_step(plan, out, result, outputs)
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
        ahead, request_outputs = None, []
        if self.scheduler.has_work():
            plan = self._schedule()
            ahead = (plan, self.runner.dispatch(plan, self._plan_constraints(plan)))
            gc.collect(0)  # while the device is busy: the cyclic collector stays off the critical path
        if self._unprocessed is not None:
            request_outputs = self._processed()  # one step at a time: N-2's, done unless it outlasted a step
            self._processing = self._output_thread.submit(self._finish_step, *self._unprocessed)
            self._unprocessed = None
        if self._in_flight is not None:
            (plan, out, placeholder_outputs), self._in_flight = self._in_flight, None
            result = self.runner.fetch(out)  # releases the GIL: the output thread runs meanwhile
            self.scheduler, outputs = scheduler.resolve(self.scheduler, placeholder_outputs, result)
            self._unprocessed = (plan, out, result, outputs)
        if ahead is not None:
            plan, out = ahead
            placeholders = scheduler.placeholder_result(plan, self.config.num_spec_tokens)
            self.scheduler, placeholder_outputs = scheduler.update(self.scheduler, plan, placeholders)
            self._in_flight = (plan, out, placeholder_outputs)
        if self._in_flight is None:  # nothing runs to hide output processing behind: finish it now
            request_outputs += self._processed()
            if self._unprocessed is not None:
                unprocessed, self._unprocessed = self._unprocessed, None
                request_outputs += self._finish_step(*unprocessed)
        elif self._processing is not None and self._processing.done():
            request_outputs += self._processed()
        self._release_ended()
        return request_outputs

    def _processed(self) -> list[RequestOutput]:
        """The output thread's results (waits for them). A snapshot taken before an abort that has ended its
        request since is dropped: the abort returned the request's final output."""
        processing, self._processing = self._processing, None
        if processing is None:
            return []
        return [output for output in processing.result() if output.finished or output.request_id in self._requests]

    def _release_ended(self) -> None:
        """Free in the scheduler the sequences the output side ended that it still runs (a stop string)."""
        while self._ended:
            sequence_id = self._ended.popleft()
            if sequence_id in self.scheduler.requests:
                self.scheduler = scheduler.abort_request(self.scheduler, sequence_id)

    def _schedule(self) -> BatchPlan:
        self.scheduler, plan = scheduler.schedule(self.scheduler)
        self._note_scheduled(plan)
        return plan

    def _finish_step(self, plan: BatchPlan, out: StepOutput, result: scheduler.StepResult,
                     outputs: scheduler.StepOutputs) -> list[RequestOutput]:
        """A step's outputs: tokens, text, stop strings and logprobs, request by request."""
        with self._outputs_lock:
            return self._process(plan, out, result, outputs)

    def _process(self, plan: BatchPlan, out: StepOutput, result: scheduler.StepResult,
                 outputs: scheduler.StepOutputs) -> list[RequestOutput]:
        reported = to_host(out.logprobs) if self._wants_logprobs(plan) else None
        self._count(plan, result, outputs)
        touched = {}
        if reported is not None:
            self._record_prompt_logprobs(plan, reported, touched)
            rows = {sequence_id: row for row, sequence_id in enumerate(plan.request_ids)}
        for i, sequence_id in enumerate(outputs.request_ids):
            sequence = self._sequences.get(sequence_id)
            if sequence is None:
                continue  # ended by a stop string or an abort while its step ran
            tokens = outputs.token_ids[i, :outputs.num_new_tokens[i]].tolist()
            entries = None
            if reported is not None and sequence.request.params.logprobs is not None:
                entries = _token_entries(plan, rows[sequence_id], len(tokens))
            try:
                self._emit(sequence, tokens, scheduler.request.FINISH_REASONS[outputs.finish_codes[i]], entries,
                           reported)
            except Exception:
                log.exception("request %r failed while its output was processed", sequence.request.request_id)
                if sequence.sequence_id in self._sequences:
                    self._end(sequence, "error", None)
            touched[sequence.request.request_id] = sequence.request
        return [self._snapshot(request) for request in touched.values()]

    def _start_over(self) -> list[RequestOutput]:
        """After a failed step: fresh pools and scheduler; started requests end with "error", the rest requeue."""
        self.stats.failed_steps += 1
        with contextlib.suppress(Exception):  # the output thread must be idle before the requests are ended
            self._processed()
        self._in_flight = self._unprocessed = None
        self.runner.reset_state()
        self.scheduler = scheduler.init_state(self.config)
        failed = []
        for request in list(self._requests.values()):
            if request.metrics.first_scheduled_time is None:
                for index, sequence_id in enumerate(request.sequences):
                    self.scheduler = scheduler.add_request(self.scheduler, self._scheduler_request(
                        sequence_id, request, request.seed + index))
                continue
            for sequence_id, output in zip(request.sequences, request.outputs, strict=True):
                if not output.finished():
                    self._end(self._sequences[sequence_id], "error", None)
            failed.append(self._snapshot(request))
        return failed

    # -- helpers ----------------------------------------------------------------------------------------------

    def _checked_params(self, params: SamplingParams) -> SamplingParams:
        """`params` checked against this engine, with logprobs counts of -1 resolved to the vocabulary's."""
        vocab = self.model.config.vocab_size
        counts = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            counts[name] = vocab if value == -1 else value
            if value is not None and counts[name] > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name} must be at most max_logprobs={self.max_logprobs}, "
                                 f"got {value}")
        token_lists = {"stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias or ()),
                       "allowed_token_ids": params.allowed_token_ids or ()}
        for name, tokens in token_lists.items():
            if any(not 0 <= t < vocab for t in tokens):
                raise ValueError(f"SamplingParams.{name} must hold token ids in [0, {vocab}), got {list(tokens)}")
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"SamplingParams.{name} needs a tokenizer (this engine runs with "
                                 "skip_tokenizer_init)")
        return dataclasses.replace(params, **counts)

    def _constraint_entries(self, params: SamplingParams) -> np.ndarray:
        """The device's constraint entries of a request (`sampling.Constraint`)."""
        eos = () if params.ignore_eos else self.model.config.eos_token_id
        return constraint_entries(params.logit_bias or {}, params.allowed_token_ids or (),
                                  self._bad_word_ids(params.bad_words or ()),
                                  tuple(params.stop_token_ids) + tuple(eos) if params.min_tokens else ())

    def _bad_word_ids(self, bad_words: tuple[str, ...]) -> list[tuple[int, ...]]:
        """vLLM's: each word as it starts the text, and after a space where that is a different token of the
        same length (a word inside the text)."""
        words = []
        for word in bad_words:
            alone = tuple(self.tokenizer.encode(word.lstrip()))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip()))
            words.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        vocab = self.model.config.vocab_size
        if any(t >= vocab for word in words for t in word):
            raise ValueError(f"SamplingParams.bad_words must tokenize to ids below the model's vocabulary "
                             f"size {vocab}, got {list(bad_words)}")
        return words

    def _plan_constraints(self, plan: BatchPlan) -> np.ndarray | None:
        """The plan's rows' constraint entries, [R, E, 4]; None when no row has any."""
        constraints = self._constraints  # the output thread may end sequences meanwhile: lookups only
        if not any(sequence_id in constraints for sequence_id in plan.request_ids):
            return None
        return batch_constraints([constraints.get(sequence_id) for sequence_id in plan.request_ids],
                                 plan.row_kind.shape[0])

    def _scheduler_request(self, sequence_id: str, request: _Request, seed: int) -> scheduler.Request:
        prompt, params = request.prompt, request.params
        eos = self.model.config.eos_token_id
        room = self.config.max_model_len - len(prompt.token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        limits = params.scheduler_params(max(max_tokens, 0), eos[0] if eos else None)
        if not params.ignore_eos:  # the checkpoint's other eos ids stop it too, unless eos is ignored
            limits = scheduler.SamplingParams(limits.max_tokens, limits.eos_token_id,
                                              limits.stop_token_ids + tuple(eos[1:]), limits.ignore_eos)
        return scheduler.Request(sequence_id, prompt.token_ids, limits, _readable_checkpoint(request),
                                 request.cache_salt, _logits_from(request),
                                 params.row_data(seed, len(prompt.token_ids)))

    def _detokenizer(self, prompt: Prompt, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, list(prompt.token_ids), params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)

    def _count(self, plan: BatchPlan, result: scheduler.StepResult, outputs: scheduler.StepOutputs) -> None:
        stats, rows = self.stats, plan.num_rows
        prefill = plan.row_kind[:rows] == RowKind.PREFILL
        verify = plan.row_kind[:rows] == RowKind.VERIFY
        stats.steps += 1
        prefill_tokens, generated = int(plan.query_lens[:rows][prefill].sum()), int(outputs.num_new_tokens.sum())
        stats.prefill_tokens += prefill_tokens
        stats.generation_tokens += generated
        stats.step_tokens.append(prefill_tokens + generated)
        stats.hit_copies += plan.num_hit_copies
        stats.pair_copies += plan.num_pair_copies
        stats.publishes += plan.num_publishes
        stats.materializations += plan.num_materializations
        stats.draft_tokens += int(verify.sum()) * self.config.num_spec_tokens
        stats.accepted_tokens += int(result.num_accepted[:rows][verify].sum())

    def _note_scheduled(self, plan: BatchPlan) -> None:
        now = time.time()
        # a sequence is first scheduled with a prefill row: decode rows need no look
        for row in np.flatnonzero(plan.row_kind[:plan.num_rows] == RowKind.PREFILL).tolist():
            sequence = self._sequences.get(plan.request_ids[row])
            if sequence is not None and not sequence.scheduled:
                sequence.scheduled = True
                request = sequence.request
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = int(plan.context_lens[row])
                    self._count_cache_query(request)

    def _count_cache_query(self, request: _Request) -> None:
        stats, checkpoint = self.stats, _readable_checkpoint(request)
        stats.prefix_cache_queries += len(request.prompt.token_ids)
        stats.cached_tokens += request.num_cached_tokens
        if checkpoint:
            stats.checkpoint_queries += 1
            stats.checkpoint_hits += request.num_cached_tokens >= checkpoint

    def _wants_logprobs(self, plan: BatchPlan) -> bool:
        return not self._logprob_sequences.isdisjoint(plan.request_ids)

    def _position(self, reported: Logprobs, entry: int, token: int, num_top: int) -> PositionLogprobs:
        """One position's logprobs: its top `num_top` and the token that is there."""
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (
            lambda t: None)
        top_ids, top = reported.top_ids[entry], reported.top[entry]
        position = {int(t): Logprob(float(lp), rank + 1, decode(int(t)))
                    for rank, (t, lp) in enumerate(zip(top_ids[:num_top], top[:num_top], strict=True))}
        sampled = Logprob(float(reported.sampled[entry]), int(reported.sampled_rank[entry]), decode(token))
        return {token: sampled, **position}  # vLLM's order: the token first, a top entry's rank wins

    def _record_prompt_logprobs(self, plan: BatchPlan, reported: Logprobs, touched: dict) -> None:
        """Prefill rows' logits at prompt positions p give the logprob of prompt token p + 1."""
        for row, sequence_id in enumerate(plan.request_ids):
            sequence = self._sequences.get(sequence_id)
            if (sequence is None or sequence.index or plan.row_kind[row] != RowKind.PREFILL
                    or sequence.request.prompt_logprobs is None):
                continue
            request, prompt = sequence.request, sequence.request.prompt.token_ids
            for entry in range(plan.cu_logits[row], plan.cu_logits[row + 1]):
                position = int(plan.positions[plan.logits_indices[entry]]) + 1
                if position < len(prompt):
                    request.prompt_logprobs.extend([None] * (position + 1 - len(request.prompt_logprobs)))
                    request.prompt_logprobs[position] = self._position(
                        reported, entry, prompt[position], request.params.prompt_logprobs)
            touched[request.request_id] = request

    def _emit(self, sequence: _Sequence, tokens: list[int], reason: FinishReason | None, entries: list[int] | None,
              reported: Logprobs | None) -> None:
        output, detokenizer, request = sequence.output, sequence.detokenizer, sequence.request
        if tokens:
            request.metrics.last_token_time = time.time()
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = request.metrics.last_token_time
        # vLLM: the text of a token that stopped the request (eos or a stop token id) is left out
        texts = len(tokens) - (reason is FinishReason.STOP and not request.params.include_stop_str_in_output)
        for j, token in enumerate(tokens):
            output.token_ids.append(token)
            if entries is not None:
                position = self._position(reported, entries[j], token, request.params.logprobs)
                output.logprobs.append(position)
                output.cumulative_logprob += position[token].logprob
            if detokenizer is not None and j < texts:
                delta = detokenizer.push([token])
                output.text = detokenizer.text
                if delta.stop is not None:  # later tokens of the step are dropped with the rest of the text
                    self._end(sequence, "stop", delta.stop)
                    return
        if reason is not None:
            stop_reason = self._stop_reason(request.params, tokens[-1]) if reason is FinishReason.STOP else None
            self._end(sequence, _FINISH[reason], stop_reason)

    def _stop_reason(self, params: SamplingParams, token: int) -> int | None:
        """vLLM's: None for the eos token, else the stop token id (the checkpoint's other eos ids count as
        stop token ids, unless eos is ignored)."""
        eos = self.model.config.eos_token_id
        if eos and token == eos[0] and not params.ignore_eos:
            return None
        return token if token in params.stop_token_ids or (token in eos and not params.ignore_eos) else None

    def _end(self, sequence: _Sequence, reason: str, stop_reason) -> None:
        """End a sequence's output (the scheduler lets it go in `_release_ended`, on the engine's thread)."""
        output, detokenizer = sequence.output, sequence.detokenizer
        output.finish_reason, output.stop_reason = reason, stop_reason
        if detokenizer is not None:
            detokenizer.flush()
            output.text = detokenizer.text
        sequence_id = sequence.sequence_id
        self._ended.append(sequence_id)
        del self._sequences[sequence_id]
        self._logprob_sequences.discard(sequence_id)
        self._constraints.pop(sequence_id, None)
        request = sequence.request
        if all(o.finished() for o in request.outputs):
            request.metrics.finished_time = time.time()
            del self._requests[request.request_id]

    def _snapshot(self, request: _Request) -> RequestOutput:
        outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                    None if o.logprobs is None else list(o.logprobs), o.finish_reason, o.stop_reason)
                   for o in request.outputs]
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = request.prompt_logprobs + [None] * (len(request.prompt.token_ids)
                                                                  - len(request.prompt_logprobs))
        return RequestOutput(request.request_id, request.prompt.text, list(request.prompt.token_ids), prompt_logprobs,
                             outputs, all(o.finished() for o in outputs), request.metrics, request.num_cached_tokens)


def _logits_from(request: _Request) -> int | None:
    """The first prompt position whose logits the request needs: prompt token p's logprob comes from the
    logits at p - 1 (None: the sampling position only)."""
    if request.params.prompt_logprobs is None:
        return None
    return max(request.prompt_logprobs_from - 1, 0)


def _readable_checkpoint(request: _Request) -> int | None:
    """The checkpoint the scheduler may start the request from. A request that needs logits before its
    checkpoint cannot start there, so it computes its whole prompt, as vLLM computes a prompt_logprobs
    request without reading the prefix cache: it neither waits for its checkpoint nor produces it."""
    checkpoint, logits_from = request.prompt.checkpoint_position, _logits_from(request)
    if checkpoint is not None and logits_from is not None and checkpoint > logits_from:
        return None
    return checkpoint


def _token_entries(plan: BatchPlan, row: int, num_tokens: int) -> list[int]:
    """The logit entries of a row's emitted tokens: a verify row's first ones, else its last one."""
    if plan.row_kind[row] == RowKind.VERIFY:
        return list(range(plan.cu_logits[row], plan.cu_logits[row] + num_tokens))
    return [int(plan.cu_logits[row + 1]) - 1] * num_tokens
