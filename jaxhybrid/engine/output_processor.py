"""A step's tokens into `RequestOutput`s: incremental text, stop strings, logprobs, finish reasons, metrics.

One step ahead this runs on the output thread while the engine's thread waits for the device. `lock` is
held while a step is processed and by `Engine.abort`, so the two never end the same sequence at once.
"""

from __future__ import annotations

import logging
import threading
import time

import scheduler
from jaxhybrid.engine.outputs import Logprob, PositionLogprobs, RequestOutput
from jaxhybrid.engine.requests import RequestTable, Sequence
from jaxhybrid.engine.stats import EngineStats
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import Logprobs
from jaxhybrid.worker.runner import to_host
from jaxhybrid.worker.step import StepOutput
from scheduler import BatchPlan, FinishReason, RowKind

log = logging.getLogger("jaxhybrid")

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class OutputProcessor:
    def __init__(self, table: RequestTable, stats: EngineStats) -> None:
        self.table, self.stats, self.tokenizer = table, stats, table.tokenizer
        self.lock = threading.Lock()

    def process(self, plan: BatchPlan, out: StepOutput, result: scheduler.StepResult,
                outputs: scheduler.StepOutputs) -> list[RequestOutput]:
        """A step's outputs, request by request; a request whose output cannot be processed ends alone
        with finish_reason "error"."""
        with self.lock:
            table = self.table
            reported = to_host(out.logprobs) if not table.logprob_sequences.isdisjoint(plan.request_ids) else None
            self.stats.count_step(plan, result, outputs, table.config.num_spec_tokens)
            touched = {}
            if reported is not None:
                self._record_prompt_logprobs(plan, reported, touched)
                rows = {sequence_id: row for row, sequence_id in enumerate(plan.request_ids)}
            for i, sequence_id in enumerate(outputs.request_ids):
                sequence = table.sequences.get(sequence_id)
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
                    if sequence.sequence_id in table.sequences:
                        table.end(sequence, "error", None)
                touched[sequence.request.request_id] = sequence.request
            return [request.snapshot() for request in touched.values()]

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
            sequence = self.table.sequences.get(sequence_id)
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

    def _emit(self, sequence: Sequence, tokens: list[int], reason: FinishReason | None, entries: list[int] | None,
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
                    self.table.end(sequence, "stop", delta.stop)
                    return
        if reason is not None:
            stop_reason = self._stop_reason(request.params, tokens[-1]) if reason is FinishReason.STOP else None
            self.table.end(sequence, FINISH[reason], stop_reason)

    def _stop_reason(self, params: SamplingParams, token: int) -> int | None:
        """vLLM's: None for the eos token, else the stop token id (the checkpoint's other eos ids count as
        stop token ids, unless eos is ignored)."""
        eos = self.table.model.config.eos_token_id
        if eos and token == eos[0] and not params.ignore_eos:
            return None
        return token if token in params.stop_token_ids or (token in eos and not params.ignore_eos) else None


def _token_entries(plan: BatchPlan, row: int, num_tokens: int) -> list[int]:
    """The logit entries of a row's emitted tokens: a verify row's first ones, else its last one."""
    if plan.row_kind[row] == RowKind.VERIFY:
        return list(range(plan.cu_logits[row], plan.cu_logits[row] + num_tokens))
    return [int(plan.cu_logits[row + 1]) - 1] * num_tokens
