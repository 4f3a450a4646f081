"""The engine's requests: a request fans out into `n` sequences, one scheduler request each.

`RequestTable` checks a request against the engine, builds its scheduler requests (packed sampling record,
readable checkpoint, eos ids), and owns the tables the output side reads and ends sequences in.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import scheduler
from jaxhybrid.engine.detokenize import IncrementalDetokenizer
from jaxhybrid.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.model import Model
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import DEFAULT_CONSTRAINT_WIDTH, batch_constraints, constraint_entries
from scheduler import BatchPlan, RowKind, SchedulerConfig


class Prompt(NamedTuple):
    """A prompt as the scheduler takes it: the marker already stripped, its position recorded."""

    token_ids: tuple[int, ...]
    checkpoint_position: int | None = None
    text: str | None = None


@dataclass
class Request:
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
    group: str | None = None  # the client request it is part of (`scheduler.SequenceSpec.group`); None: its own

    def logits_from(self) -> int | None:
        """The first prompt position whose logits the request needs: prompt token p's logprob comes from the
        logits at p - 1 (None: the sampling position only)."""
        return None if self.params.prompt_logprobs is None else max(self.prompt_logprobs_from - 1, 0)

    def readable_checkpoint(self) -> int | None:
        """The checkpoint the scheduler may start the request from. A request that needs logits before its
        checkpoint cannot start there, so it computes its whole prompt, as vLLM computes a prompt_logprobs
        request without reading the prefix cache: it neither waits for its checkpoint nor produces it."""
        checkpoint, logits_from = self.prompt.checkpoint_position, self.logits_from()
        return None if checkpoint is not None and logits_from is not None and checkpoint > logits_from else checkpoint

    def snapshot(self) -> RequestOutput:
        outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                    None if o.logprobs is None else list(o.logprobs), o.finish_reason, o.stop_reason)
                   for o in self.outputs]
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs + [None] * (len(self.prompt.token_ids) - len(self.prompt_logprobs))
        return RequestOutput(self.request_id, self.prompt.text, list(self.prompt.token_ids), prompt_logprobs,
                             outputs, all(o.finished() for o in outputs), self.metrics, self.num_cached_tokens)


@dataclass
class Sequence:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    scheduled: bool = False

    @property
    def sequence_id(self) -> str:
        return self.request.sequences[self.index]

    @property
    def output(self) -> CompletionOutput:
        return self.request.outputs[self.index]


class RequestTable:
    """The live requests and sequences. The engine's thread adds; the output side ends (`end`), and the
    sequences it ended wait in `ended` until the engine's thread lets the scheduler free them."""

    def __init__(self, model: Model, config: SchedulerConfig, tokenizer: Tokenizer | None, max_logprobs: int,
                 seed: int, constraint_width: int = DEFAULT_CONSTRAINT_WIDTH) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.max_logprobs, self.constraint_width = max_logprobs, constraint_width
        self.requests: dict[str, Request] = {}
        self.sequences: dict[str, Sequence] = {}
        self.logprob_sequences: set[str] = set()  # running sequences that report logprobs
        self.constraints: dict[str, np.ndarray] = {}  # running sequences' constraint entries, if they have any
        self.ended: deque[str] = deque()  # sequences the output side ended; the scheduler may still hold them
        self._seeds = np.random.default_rng(seed)

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams, cache_salt: str | None,
                    prompt_logprobs_from: int, group: str | None = None) -> Request:
        """A request checked against the engine (ValueError naming the problem), with no sequences yet."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = self.checked_params(params)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        seed = int(self._seeds.integers(2**63)) if params.seed is None else params.seed
        return Request(request_id, prompt, params, [], [], None if params.prompt_logprobs is None else [None],
                       RequestMetrics(time.time()), seed, cache_salt, prompt_logprobs_from, group=group or request_id)

    def add_sequence(self, request: Request, sequence_id: str, constraints: np.ndarray | None) -> None:
        params, index = request.params, len(request.sequences)
        request.sequences.append(sequence_id)
        request.outputs.append(CompletionOutput(index, "", [], 0.0 if params.logprobs is not None else None,
                                                [] if params.logprobs is not None else None))
        self.sequences[sequence_id] = Sequence(request, index, self._detokenizer(request.prompt, params))
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.logprob_sequences.add(sequence_id)
        if constraints is not None:
            self.constraints[sequence_id] = constraints

    def drop_sequence(self, sequence_id: str) -> None:
        """Forget a sequence that never ran (its request was refused)."""
        del self.sequences[sequence_id]
        self.logprob_sequences.discard(sequence_id)
        self.constraints.pop(sequence_id, None)

    def end(self, sequence: Sequence, reason: str, stop_reason) -> None:
        """End a sequence's output; its request leaves the table once every completion has ended."""
        output, detokenizer = sequence.output, sequence.detokenizer
        output.finish_reason, output.stop_reason = reason, stop_reason
        if detokenizer is not None:
            detokenizer.flush()
            output.text = detokenizer.text
        sequence_id = sequence.sequence_id
        self.ended.append(sequence_id)
        self.drop_sequence(sequence_id)
        request = sequence.request
        if all(o.finished() for o in request.outputs):
            request.metrics.finished_time = time.time()
            del self.requests[request.request_id]

    def note_scheduled(self, plan: BatchPlan) -> list[Request]:
        """Mark the plan's sequences scheduled; returns the requests scheduled for the first time."""
        now, first = time.time(), []
        # a sequence is first scheduled with a prefill row: decode rows need no look
        for row in np.flatnonzero(plan.row_kind[:plan.num_rows] == RowKind.PREFILL).tolist():
            sequence = self.sequences.get(plan.request_ids[row])
            if sequence is not None and not sequence.scheduled:
                sequence.scheduled = True
                request = sequence.request
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = int(plan.context_lens[row])
                    first.append(request)
        return first

    def scheduler_sequence(self, sequence_id: str, request: Request, seed: int) -> scheduler.SequenceSpec:
        prompt, params = request.prompt, request.params
        eos = self.model.config.eos_token_id
        room = self.config.max_model_len - len(prompt.token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        limits = params.scheduler_params(max(max_tokens, 0), eos[0] if eos else None)
        if not params.ignore_eos:  # the checkpoint's other eos ids stop it too, unless eos is ignored
            limits = scheduler.StopParams(limits.max_tokens, limits.eos_token_id,
                                              limits.stop_token_ids + tuple(eos[1:]), limits.ignore_eos)
        return scheduler.SequenceSpec(sequence_id, prompt.token_ids, limits, request.readable_checkpoint(),
                                 request.cache_salt, request.logits_from(),
                                 params.row_data(seed, len(prompt.token_ids)), request.group)

    def constraint_entries(self, params: SamplingParams) -> np.ndarray | None:
        """The device's constraint entries of a request (`sampling.Constraint`); None without constraints. More
        entries than the steps were compiled for is a ValueError naming max_sampling_constraints."""
        if not params.has_constraints():
            return None
        width, words = self.constraint_width, params.bad_words or ()
        chars = sum(map(len, words))
        # each word takes an entry, and a token's worth of characters more another: refused before tokenizing
        if len(words) > width or (self.tokenizer is not None and chars > self.tokenizer.max_text_chars(width)):
            raise ValueError(f"SamplingParams.bad_words must fit in max_sampling_constraints={width} entries, got "
                             f"{len(words)} words of {chars} characters")
        eos = () if params.ignore_eos else self.model.config.eos_token_id
        entries = constraint_entries(params.logit_bias or {}, params.allowed_token_ids or (),
                                     self._bad_word_ids(params.bad_words or ()),
                                     tuple(params.stop_token_ids) + tuple(eos) if params.min_tokens else ())
        if len(entries) > width:
            raise ValueError(f"SamplingParams.{_largest_constraint(params)} must keep the request's logit_bias, "
                             f"allowed_token_ids, bad_words and min_tokens bans within max_sampling_constraints="
                             f"{width} entries, got {len(entries)}")
        return entries

    def plan_constraints(self, plan: BatchPlan) -> np.ndarray | None:
        """The plan's rows' constraint entries, [R, E, 4]; None when no row has any."""
        constraints = self.constraints  # the output thread may end sequences meanwhile: lookups only
        if not any(sequence_id in constraints for sequence_id in plan.request_ids):
            return None
        return batch_constraints([constraints.get(sequence_id) for sequence_id in plan.request_ids],
                                 plan.row_kind.shape[0], self.constraint_width)

    def checked_params(self, params: SamplingParams) -> SamplingParams:
        """`params` checked against this engine (a ValueError naming the field), with logprobs counts of -1
        resolved to the vocabulary's and a top_k past the vocabulary off. Reads only the engine's settings:
        any thread may call it."""
        vocab = self.model.config.vocab_size
        counts = {"top_k": 0 if params.top_k >= vocab else params.top_k}  # keeping every token is no filter
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            counts[name] = vocab if value == -1 else value
            if value is not None and counts[name] > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name} must be at most max_logprobs={self.max_logprobs}, "
                                 f"got {value}")
        token_lists = {"stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias or ()),
                       "allowed_token_ids": params.allowed_token_ids or ()}
        for name, tokens in token_lists.items():
            outside = next((t for t in tokens if not 0 <= t < vocab), None)
            if outside is not None:
                raise ValueError(f"SamplingParams.{name} must hold token ids in [0, {vocab}), got {outside}")
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"SamplingParams.{name} needs a tokenizer (this engine runs with "
                                 "skip_tokenizer_init)")
        return dataclasses.replace(params, **counts)

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
                             f"size {vocab}")
        return words

    def _detokenizer(self, prompt: Prompt, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, list(prompt.token_ids), params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)


def _largest_constraint(params: SamplingParams) -> str:
    """The field that asks for the most constraint entries (the one a 400 names)."""
    sizes = {"logit_bias": len(params.logit_bias or ()), "allowed_token_ids": len(params.allowed_token_ids or ()),
             "bad_words": len(params.bad_words or ()), "stop_token_ids": len(params.stop_token_ids)}
    return max(sizes, key=sizes.get)
