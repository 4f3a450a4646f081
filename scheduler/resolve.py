"""One step ahead of the device: `update` on placeholder tokens now, `resolve` with the real ones later.

The overlapped engine schedules step N+1 before it has read step N's tokens (DESIGN "One engine step").
Right after dispatching N it applies `update(state, plan, placeholder_result(plan, K))`: everything a step
changes that does not depend on which tokens came out (computed counts, ReplaySSM trackers, prefill ends,
materialisation asks, READY slots and checkpoints, the end at max_len) happens then, and row r's emitted
token is the placeholder -(1 + r). The next plan carries that placeholder wherever the token is an input;
the device replaces it with the token row r emitted in the step before. When N's tokens arrive,
`resolve(state, outputs, result)` writes them where the placeholders are (row tail, token log and its
keys), ends the requests that sampled a stop token (a request the step in flight still runs is released
by that step's update, like an abort) and returns the outputs `update` would have returned.

A placeholder is never part of a published key: blocks are published only once computed, and a
placeholder is the token after the computed ones until `resolve` replaces it. With drafts (K > 0) the
accepted counts, and so the positions of the next step, are unknown too: only K = 0 runs ahead.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from scheduler.journal import frozen
from scheduler.lifecycle import StateEdit, end_request
from scheduler.plan import BatchPlan, StepResult
from scheduler.request import STOP_CODE, StepOutputs
from scheduler.state import SchedulerState, num_logged


def placeholder_result(plan: BatchPlan, num_spec_tokens: int) -> StepResult:
    """A StepResult for `plan` before its tokens are known: row r emits -(1 + r), accepts no draft."""
    if num_spec_tokens:
        raise ValueError("placeholder results need num_spec_tokens == 0: with drafts the accepted counts are "
                         "unknown too")
    rows = plan.row_bucket
    return StepResult(-1 - np.arange(rows, dtype=np.int32)[:, None], np.zeros(rows, np.int32),
                      np.zeros((rows, 0), np.int32))


def resolve(state: SchedulerState, outputs: StepOutputs, result: StepResult) -> tuple[SchedulerState, StepOutputs]:
    """Put step N's real tokens (`result`) where `outputs`, from `update` on `placeholder_result`, left
    placeholders. Raises ValueError (state unchanged) if a placeholder has no row in `result`."""
    sampled = result.sampled_token_ids[:, 0]
    placeholders = outputs.token_ids[:, 0]
    rows = -1 - placeholders
    if ((placeholders < 0) & (rows >= len(sampled))).any():
        raise ValueError(f"resolve: placeholders name rows up to {int(rows.max())}, the result has {len(sampled)}")
    tokens = np.where(placeholders < 0, sampled[np.clip(rows, 0, len(sampled) - 1)], placeholders).astype(np.int32)
    codes = outputs.finish_codes.copy()
    with StateEdit(state) as edit:
        rows = np.fromiter(map(edit.row_of.get, outputs.request_ids, repeat(-1)), np.int64, len(codes))
        emitted = (outputs.num_new_tokens > 0) & (placeholders < 0)
        fast = _in_tails(edit, rows, emitted & (codes == 0) & (rows >= 0), outputs.request_ids)
        _write_tails(edit, rows[fast], placeholders[fast], tokens[fast])
        eos = edit.rows.eos[rows[fast]]
        hits = (tokens[fast] == eos) & (eos >= 0)
        codes[fast] = np.where(hits, STOP_CODE, 0)
        stopped = [outputs.request_ids[i] for i in fast.nonzero()[0][hits].tolist()]
        keep = fast | (codes != 0)
        for i in (~keep).nonzero()[0].tolist():  # the rest, one by one: log-resident tokens, extra stop ids
            rid = outputs.request_ids[i]
            if rid not in edit.requests or rid in edit.aborting:
                continue  # aborted since: it emits nothing more
            keep[i] = True
            if emitted[i]:
                _write_token(edit, rid, int(placeholders[i]), int(tokens[i]))
                if int(tokens[i]) in edit.requests[rid].sampling_params.stop_ids:
                    codes[i] = STOP_CODE
                    stopped.append(rid)
        for i in (outputs.finish_codes != 0).nonzero()[0].tolist():  # ended in the step (max_len)
            stops = edit.unresolved_ends.pop(outputs.request_ids[i], frozenset())
            codes[i] = STOP_CODE if emitted[i] and int(tokens[i]) in stops else codes[i]
        for rid in stopped:
            end_request(edit, rid)
        token_ids = outputs.token_ids.copy()
        token_ids[:, 0] = tokens
        keep = keep.nonzero()[0]
        return edit.freeze(), StepOutputs(tuple(outputs.request_ids[i] for i in keep.tolist()),
                                          frozen(token_ids[keep]), frozen(outputs.num_new_tokens[keep]),
                                          frozen(codes[keep]))


def _in_tails(edit: StateEdit, rows: np.ndarray, candidates: np.ndarray, request_ids: tuple[str, ...]) -> np.ndarray:
    """Entries whose placeholder sits in their running row's tail and that stop at eos alone: the usual case."""
    table, safe = edit.rows, np.maximum(rows, 0)
    position = table.num_tokens[safe] - 1  # where each placeholder is: the last committed token
    fast = candidates & (position >= num_logged(table, safe, edit.cfg.log_unit)) & ~table.has_stop[safe]
    if edit.aborting:
        fast &= np.array([rid not in edit.aborting for rid in request_ids])
    return fast


def _write_tails(edit: StateEdit, rows: np.ndarray, placeholders: np.ndarray, tokens: np.ndarray) -> None:
    table, tail = edit.rows, edit.rows.edit("tail")
    tail.put(rows * tail.view.shape[1] + (table.num_tokens[rows] - 1) % edit.cfg.log_unit, tokens)
    table.last_token[rows] = np.where(table.last_token[rows] == placeholders, tokens, table.last_token[rows])


def _write_token(edit: StateEdit, rid: str, placeholder: int, token: int) -> None:
    """The request's last committed token is `placeholder`; make it `token` wherever it is kept."""
    position = edit.num_tokens(rid) - 1
    log, row, unit = edit.logs[rid], edit.row_of.get(rid), edit.cfg.log_unit
    if position < log.length:  # its log block filled (or the request was preempted): in the log
        log.replace(position, token, edit.cfg.hash_unit)
    if row is None:
        return
    rows = edit.rows
    start = int(rows.num_tokens[row]) // unit * unit
    if position >= start:
        rows.edit("tail")[row, position - start] = token
    if rows.last_token[row] == placeholder:
        rows.last_token[row] = token
