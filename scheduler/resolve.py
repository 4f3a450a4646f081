"""One step ahead of the device: `update` on placeholders now, `resolve` with the real tokens later.

The overlapped engine schedules step N+1 before it has read step N's tokens (docs/engine.md#one-step).
Right after dispatching N it applies `update(state, plan, placeholder_result(plan, K))`: everything a step
changes that does not depend on which tokens came out (computed counts, ReplaySSM trackers, prefill ends,
materialization asks, READY slots and checkpoints, the end at max_len) happens then. Row r of step N emits
one token, the placeholder P(r, 0) = -(1 + r * (1 + K)), accepts no draft and drafts P(r, 1..K). The next
plan carries these placeholders wherever N's tokens are inputs; the device replaces P(r, 0) with the last
token row r emitted and P(r, j) with its draft j, both kept on device.

With drafts (K > 0) the host also does not know how many of them N accepted: it counts none, so its view
is always a true prefix of the request (never a token that may be rejected), and the device adds the
accepted count a to the positions, context length and committed ring entries of the request's next verify
row (whose first token is P(r, 0), which names the row). `schedule` reserves KV blocks and flushes the ring
as if all K drafts were accepted, so any a fits.

When N's tokens arrive, `resolve(state, outputs, result)` writes them where the placeholders are (row tail,
token log and its keys), adds the a accepted tokens (cut at a stop token and at max_len), advances the
computed count and trackers by a, asks for the Mamba boundary states the accepted tokens crossed (a step
late: valid only while the ring has not been flushed since, schedule.py), ends the requests that stopped
(a request the step in flight still runs is released by that step's update, like an abort) and returns
the outputs `update` would have returned. A request aborted while step N+1 is in flight gets the same
bookkeeping but emits nothing: N+1 computes its last token, so that token must be real.

A placeholder is never part of a published key: blocks are published only once computed, a placeholder
is the token after the computed ones until `resolve`, and a row whose request is aborting (aborted, or
ended by `resolve`, while its step runs) commits no token in `update`, so none lands below the count.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from scheduler.history import append_tokens
from scheduler.journal import frozen
from scheduler.lifecycle import end_request, max_len
from scheduler.plan import BatchPlan, StepResult, check_result_rows
from scheduler.request import STOP_CODE, StepOutputs
from scheduler.state import SchedulerState, num_logged
from scheduler.transaction import StateEdit
from scheduler.update import aborting_mask, cut_at_stops, materialize_crossed_boundaries


def placeholder_result(plan: BatchPlan, num_spec_tokens: int) -> StepResult:
    """A StepResult for `plan` before its tokens are known: row r emits P(r, 0), accepts no draft and
    drafts P(r, 1..K), with P(r, j) = -(1 + r * (1 + K) + j)."""
    width = 1 + num_spec_tokens
    codes = (-1 - np.arange(plan.row_bucket * width, dtype=np.int32)).reshape(-1, width)
    return StepResult(codes, np.zeros(plan.row_bucket, np.int32), codes[:, 1:].copy())


def resolve(state: SchedulerState, outputs: StepOutputs, result: StepResult) -> tuple[SchedulerState, StepOutputs]:
    """Put step N's real tokens (`result`) where `outputs`, from `update` on `placeholder_result`, left
    placeholders. Raises ValueError (state unchanged) if a placeholder has no row in `result`, or `result`
    does not fit the config as `update` checks it."""
    num_spec_tokens = state.config.num_spec_tokens
    width = 1 + num_spec_tokens
    placeholders = outputs.token_ids[:, 0]
    emitted = (outputs.num_new_tokens > 0) & (placeholders < 0)
    plan_rows = np.where(emitted, (-1 - placeholders) // width, 0)
    if emitted.any() and plan_rows.max() >= len(result.sampled_token_ids):
        raise ValueError(f"resolve: placeholders name rows up to {int(plan_rows.max())}, the result has "
                         f"{len(result.sampled_token_ids)}")
    check_result_rows(result, int(plan_rows.max(initial=-1)) + 1, num_spec_tokens)
    tokens, accepted = outputs.token_ids.copy(), np.zeros(len(placeholders), np.int32)
    drafts = np.zeros((len(placeholders), width - 1), np.int32)
    if emitted.any():
        tokens[emitted] = result.sampled_token_ids[plan_rows[emitted]]
        accepted[emitted] = result.num_accepted[plan_rows[emitted]]
        drafts[emitted] = result.draft_token_ids[plan_rows[emitted]]
    codes, keep = outputs.finish_codes.copy(), outputs.num_new_tokens.copy()
    with StateEdit(state) as edit:
        rows = np.fromiter(map(edit.row_of.get, outputs.request_ids, repeat(-1)), np.int64, len(codes))
        ending = emitted & (codes == 0)  # rows that went on: they may stop now
        fast = _in_tails(edit, rows, ending & (rows >= 0))
        _cut_fast(edit, rows[fast], tokens[fast], accepted[fast], keep, codes, fast)
        tail = edit.rows.edit("tail")
        tail.put(rows[fast] * tail.view.shape[1] + (edit.rows.num_tokens[rows[fast]] - 1) % edit.cfg.log_unit,
                 tokens[fast, 0])
        gone = np.zeros(len(codes), bool)
        for i in (ending & ~fast).nonzero()[0].tolist():  # the rest, one by one: log-resident, parked, stop ids
            rid = outputs.request_ids[i]
            if rid not in edit.requests:
                gone[i] = True  # aborted since: nothing of it is left
                continue
            keep[i], codes[i] = _cut_one(edit, rid, tokens[i], accepted[i])
            _write_token(edit, rid, tokens[i, 0])
        running = ending & ~gone & (rows >= 0)
        _commit_running(edit, outputs, running, rows, placeholders, tokens, keep, codes, accepted, drafts)
        for i in (ending & ~gone & (rows < 0) & (keep > 1)).nonzero()[0].tolist():  # parked: the log alone
            rid = outputs.request_ids[i]
            edit.writable_log(rid).extend(frozen(tokens[i, 1:keep[i]].copy()), edit.cfg.hash_unit)
            edit.parked[rid] += int(keep[i]) - 1
        for i in (outputs.finish_codes != 0).nonzero()[0].tolist():  # ended in the step (max_len)
            stops = edit.unresolved_ends.pop(outputs.request_ids[i], frozenset())
            codes[i] = STOP_CODE if emitted[i] and int(tokens[i, 0]) in stops else codes[i]
        kept = (~gone & ~aborting_mask(edit.aborting, outputs.request_ids)).nonzero()[0]  # before those ending now
        for i in (ending & ~gone & (codes != 0)).nonzero()[0].tolist():
            end_request(edit, outputs.request_ids[i])
        return edit.freeze(), StepOutputs(tuple(outputs.request_ids[i] for i in kept.tolist()), frozen(tokens[kept]),
                                          frozen(keep[kept]), frozen(codes[kept]))


def _in_tails(edit: StateEdit, rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Entries whose placeholder sits in their running row's tail and that stop at eos alone: the usual case."""
    table, safe = edit.rows, np.maximum(rows, 0)
    position = table.num_tokens[safe] - 1  # where each placeholder is: the last committed token
    return candidates & (position >= num_logged(table, safe, edit.cfg.log_unit)) & ~table.has_stop[safe]


def _cut_fast(edit: StateEdit, rows: np.ndarray, tokens: np.ndarray, accepted: np.ndarray, keep: np.ndarray,
              codes: np.ndarray, fast: np.ndarray) -> None:
    """Kept tokens and finish codes of the fast entries (running, eos their only stop token), in place."""
    eos = edit.rows.eos[rows][:, None]
    before = edit.rows.num_tokens[rows] - 1  # the placeholder was the step's one token
    keep[fast], codes[fast] = cut_at_stops((tokens == eos) & (eos >= 0), accepted + 1, before, edit.rows.max_len[rows])


def _cut_one(edit: StateEdit, rid: str, tokens: np.ndarray, accepted: int) -> tuple[int, int]:
    request, row = edit.requests[rid], edit.row_of.get(rid)
    limit = max_len(edit.cfg, request) if row is None else int(edit.rows.max_len[row])
    hits = np.isin(tokens, list(request.stop_params.stop_ids))[None]
    keep, codes = cut_at_stops(hits, np.array([accepted + 1]), np.array([edit.num_tokens(rid) - 1]),
                               np.array([limit]))
    return int(keep[0]), int(codes[0])


def _write_token(edit: StateEdit, rid: str, token: int) -> None:
    """The request's last committed token is a placeholder; make it `token` wherever it is kept."""
    position = edit.num_tokens(rid) - 1
    log, row, unit = edit.logs[rid], edit.row_of.get(rid), edit.cfg.log_unit
    if position < log.length:  # its log block filled (or the request was preempted): in the log
        edit.replace_token(rid, position, token)
    if row is not None and position >= int(edit.rows.num_tokens[row]) // unit * unit:
        edit.rows.edit("tail")[row, position % unit] = token


def _commit_running(edit: StateEdit, outputs: StepOutputs, running: np.ndarray, rows: np.ndarray,
                    placeholders: np.ndarray, tokens: np.ndarray, keep: np.ndarray, codes: np.ndarray,
                    accepted: np.ndarray, drafts: np.ndarray) -> None:
    """Running rows: append the accepted tokens after the first, advance the computed count and ring by
    the accepted drafts, swap the placeholders of the last token and the drafts, ask for crossed boundaries."""
    index = running.nonzero()[0]
    if not index.size:
        return
    table, cfg, row_ids = edit.rows, edit.cfg, rows[index]
    rids = tuple(outputs.request_ids[i] for i in index.tolist())
    more = (keep[index] > 1).nonzero()[0]
    if more.size:
        append_tokens(edit.writable_log, table, cfg.log_unit, cfg.hash_unit, tuple(rids[j] for j in more.tolist()),
                      row_ids[more], tokens[index[more], 1:], table.num_tokens[row_ids[more]], keep[index[more]] - 1)
    computed = table.num_computed[row_ids]
    table.num_computed[row_ids] = computed + accepted[index]
    table.committed[row_ids] += accepted[index]
    last = tokens[index, keep[index] - 1]
    table.last_token[row_ids] = np.where(table.last_token[row_ids] == placeholders[index], last,
                                         table.last_token[row_ids])
    if drafts.shape[1]:  # drafts of a row that is not in the step in flight are still N's placeholders
        unresolved = table.drafts[row_ids, 0] == placeholders[index] - 1
        table.drafts[row_ids[unresolved]] = drafts[index[unresolved]]
    going = (codes[index] == 0) & (accepted[index] > 0)
    if going.any():
        materialize_crossed_boundaries(edit, tuple(rids[j] for j in going.nonzero()[0].tolist()), row_ids[going],
                                       computed[going], computed[going] + accepted[index[going]],
                                       table.num_tokens[row_ids[going]])
