"""Request lifecycle outside the step: add, abort, and freeing everything a request holds.

`StateEdit` is the private working copy that every transition (add, abort, schedule, update)
changes and then freezes into the next `SchedulerState`; the input state is never touched.
"""

from __future__ import annotations

import numpy as np

from scheduler.checkpoints import CheckpointEvent, CheckpointStatus, advance
from scheduler.config import SchedulerConfig
from scheduler.history import park_tail
from scheduler.persistent import frozen
from scheduler.request import Request
from scheduler.slots import NULL_SLOT
from scheduler.state import SchedulerState, TokenLog, request_num_tokens


class StateEdit:
    """Mutable copies of one state's parts; `freeze()` builds the next immutable state. Used as a
    context manager: if the transition raises, the writes it made to the shared persistent arrays
    and maps are undone, so the input state stays whole."""

    def __init__(self, state: SchedulerState) -> None:
        self.cfg = state.config
        self.rows = state.rows.copy()
        self.blocks = state.blocks.edit()
        self.slots = state.slots.edit()
        self.claims = dict(state.claims)
        self.requests = dict(state.requests)
        self.waiting = list(state.waiting)
        self.running = list(state.running)
        self._running_rows, self._rows_valid = state.running_rows, len(state.running)  # a valid prefix
        self.row_of = dict(state.row_of)
        self.logs = dict(state.logs)
        self.parked = dict(state.parked_tokens)
        self.materializations = state.materializations
        self.in_flight = state.in_flight
        self.step = state.step

    def __enter__(self) -> StateEdit:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            self.rows.rollback()
            self.blocks.rollback()
            self.slots.rollback()

    def running_rows(self) -> np.ndarray:
        """The row of each running request, in running order (recomputed only past the first change)."""
        valid, total = self._rows_valid, len(self.running)
        if valid < total or len(self._running_rows) != total:
            # map over a bound C method, not a generator: a Python frame per request costs ~1 us
            rest = np.fromiter(map(self.row_of.__getitem__, self.running[valid:]), np.int64, total - valid)
            self._running_rows = frozen(np.concatenate([self._running_rows[:valid], rest]))
            self._rows_valid = total
        return self._running_rows

    def remove_running(self, request_id: str) -> None:
        index = self.running.index(request_id)
        del self.running[index]
        self._rows_valid = min(self._rows_valid, index)

    def freeze(self) -> SchedulerState:
        return SchedulerState(self.cfg, self.requests, tuple(self.waiting), tuple(self.running), self.running_rows(),
                              self.row_of, self.rows.frozen(), self.blocks.freeze(), self.slots.freeze(),
                              self.claims, self.logs, self.parked, self.materializations, self.in_flight, self.step)

    def num_tokens(self, request_id: str) -> int:
        return request_num_tokens(self.rows, self.row_of, self.parked, request_id)

    def hashes(self, request_id: str) -> list[int]:
        return self.logs[request_id].hashes[:self.num_tokens(request_id) // self.cfg.hash_unit]


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """Queue a request; raises ValueError (state unchanged) if it is malformed or can never fit."""
    _validate_request(state, request)
    with StateEdit(state) as edit:
        edit.logs[request.request_id] = TokenLog.create(request.prompt_token_ids, state.config.hash_unit)
        edit.requests[request.request_id] = request
        edit.parked[request.request_id] = request.num_prompt_tokens
        edit.waiting.append(request.request_id)
        return edit.freeze()


def _validate_request(state: SchedulerState, request: Request) -> None:
    cfg, rid, num_prompt = state.config, request.request_id, request.num_prompt_tokens
    if rid in state.requests:
        raise ValueError(f"request_id {rid!r} is already in use")
    if num_prompt == 0:
        raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
    if num_prompt >= cfg.max_model_len:
        raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens leaves no room for output "
                         f"within max_model_len {cfg.max_model_len}")
    _validate_checkpoint(request, cfg.hash_unit)
    need = -(-(max_len(cfg, request) + cfg.num_spec_tokens) // cfg.block_size)
    if need > cfg.num_blocks - 1:
        raise ValueError(f"request {rid!r} can never fit: it needs {need} KV blocks at its longest and the "
                         f"pool has {cfg.num_blocks - 1}")


def _validate_checkpoint(request: Request, unit: int) -> None:
    c = request.checkpoint_position
    if c is not None and (c <= 0 or c >= request.num_prompt_tokens or c % unit):
        raise ValueError(f"request {request.request_id!r}: checkpoint_position {c} must be a positive multiple "
                         f"of the hash unit {unit} inside the prompt of {request.num_prompt_tokens} tokens")


def abort_request(state: SchedulerState, request_id: str) -> SchedulerState:
    """Remove a request and free what it holds; raises KeyError (state unchanged) if unknown."""
    if request_id not in state.requests:
        raise KeyError(f"abort_request: unknown request_id {request_id!r}")
    with StateEdit(state) as edit:
        if request_id in edit.row_of:
            release_row(edit, request_id)
        else:
            edit.waiting.remove(request_id)
        forget(edit, request_id)
        return edit.freeze()


def preempt_request(state: SchedulerState, request_id: str) -> SchedulerState:
    """Preempt a running request (recompute) from outside the step, e.g. under external memory pressure."""
    if request_id not in state.row_of:
        raise KeyError(f"preempt_request: {request_id!r} is not running")
    if state.in_flight is not None:
        raise RuntimeError("preempt_request: a step is in flight; call update first")
    with StateEdit(state) as edit:
        preempt(edit, request_id)
        return edit.freeze()


def forget(edit: StateEdit, request_id: str) -> None:
    del edit.requests[request_id], edit.logs[request_id]
    edit.parked.pop(request_id, None)


def release_row(edit: StateEdit, request_id: str) -> None:
    """Free the row, KV blocks, running slot and any unfinished checkpoint claim of a running request."""
    row, rows, cfg = edit.row_of.pop(request_id), edit.rows, edit.cfg
    park_tail(edit.logs, rows, request_id, row, cfg.log_unit, cfg.hash_unit)
    # decode publishes full blocks once per log block (update.py); cache the rest before letting go
    computed = min(int(rows.num_computed[row]), int(rows.num_tokens[row]))
    register_blocks(edit, [(request_id, row, log_block_first_block(cfg, computed),
                            computed // cfg.hash_unit)])
    edit.blocks.release(rows.block_table[row, :rows.num_blocks[row]])
    if rows.running_slot[row] != NULL_SLOT:
        edit.slots.release(int(rows.running_slot[row]))
    release_claims(edit, request_id)
    # its running slot (the materialisation source) is gone: drop the asks
    edit.materializations = tuple(m for m in edit.materializations if m.request_id != request_id)
    edit.parked[request_id] = int(rows.num_tokens[row])
    edit.remove_running(request_id)
    rows.clear(row)


def max_len(cfg: SchedulerConfig, request: Request) -> int:
    """Tokens the request may reach (prompt + outputs): where it stops with reason LENGTH."""
    return min(request.num_prompt_tokens + request.sampling_params.max_tokens, cfg.max_model_len)


def log_block_first_block(cfg: SchedulerConfig, num_tokens):
    """The first KV block of the log block that holds token `num_tokens` (int or array): decode
    publishes KV blocks once per log block, so blocks from here on may still be unpublished."""
    return num_tokens // cfg.log_unit * cfg.log_unit // cfg.hash_unit


def register_blocks(edit: StateEdit, spans: list[tuple[str, int, int, int]]) -> None:
    """Publish the KV blocks [first, last) of each (request, row, first, last) under their chained
    hashes; every one of them must be full and computed by a step that has run."""
    table, keys, blocks = edit.rows.block_table, [], []
    for request_id, row, first, last in spans:
        keys += edit.logs[request_id].hashes[first:last]
        blocks.append(table[row, first:last])
    if keys:
        edit.blocks.register(np.concatenate(blocks), keys)


def release_claims(edit: StateEdit, request_id: str) -> None:
    """A producer lost before its checkpoint state exists hands the key back (PRODUCING -> ABSENT)."""
    for key, claim in list(edit.claims.items()):
        if claim.producer_id != request_id:
            continue
        status = advance(claim.status, CheckpointEvent.PRODUCER_LOST, key)
        if status is CheckpointStatus.ABSENT:
            edit.slots.release(claim.slot)
            del edit.claims[key]


def preempt(edit: StateEdit, request_id: str) -> None:
    """Recompute preemption: free everything, reset trackers, requeue at the front."""
    release_row(edit, request_id)
    edit.waiting.insert(0, request_id)


def free_row(edit: StateEdit) -> int:
    return int(edit.rows.active.argmin())  # the first inactive row (False < True)
