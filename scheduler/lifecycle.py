"""Request lifecycle outside the step: add, abort, and freeing everything a request holds.

`StateEdit` is how every transition (add, abort, schedule, update) changes the single-use state:
the large parts in place with undo logs, the small ones (queues, claims) as private copies; `freeze()`
commits them and hands the state back under a new generation, an exception rolls them back.
"""

from __future__ import annotations

from collections.abc import Callable
from hashlib import blake2b

import numpy as np

from scheduler.checkpoints import CheckpointEvent, CheckpointStatus, advance
from scheduler.config import SchedulerConfig
from scheduler.history import park_tails
from scheduler.journal import frozen
from scheduler.prefix_cache import KEY_BYTES, root_hash
from scheduler.request import Request, SamplingParams, is_int, is_int_type
from scheduler.slots import NULL_SLOT
from scheduler.state import (
    COMMITTED,
    NUM_BLOCKS,
    NUM_COMPUTED,
    NUM_TOKENS,
    PUBLISHED,
    RING_START,
    RUNNING_SLOT,
    SchedulerState,
    StateData,
    TokenLog,
    request_num_tokens,
)


class StateEdit:
    """One transition's view of the state it consumes. Used as a context manager: if the transition
    raises, every write is undone and the input state stays valid and unchanged. The waiting queue
    is copied only on its first write, so a step costs the same with ten or ten thousand queued
    requests."""

    def __init__(self, state: SchedulerState) -> None:
        data: StateData = state.live()
        self._data, self._generation, self.cfg = data, data.generation, data.config
        self.rows, self.blocks, self.slots = data.rows, data.blocks, data.slots
        self.requests, self.row_of, self.logs, self.parked = data.requests, data.row_of, data.logs, data.parked_tokens
        self.unresolved_ends = data.unresolved_ends
        self._parts = (self.rows, self.blocks, self.slots, self.requests, self.row_of, self.logs, self.parked,
                       self.unresolved_ends)
        for part in self._parts[:3]:  # the maps keep undo logs from their first write
            part.begin()
        self._log_marks: dict[str, tuple[TokenLog, tuple[int, int]]] = {}
        self._replace_undos: list[Callable[[], None]] = []  # TokenLog.replace's undos, in order
        self.hash_marks: list[tuple[list[bytes], int]] = []  # keys chained over row tails, and their old lengths
        self.claims = dict(data.claims)
        self._waiting, self._waiting_copy = data.waiting, None
        self.running = list(data.running)
        self._running_rows, self._rows_valid = data.running_rows, len(data.running)  # a valid prefix
        self.materializations = data.materializations
        self.aborting = data.aborting
        self.in_flight = data.in_flight
        self.step = data.step
        self.num_preemptions = data.num_preemptions

    def __enter__(self) -> StateEdit:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and self._data.generation == self._generation:  # raised before `freeze`
            for part in self._parts:
                part.rollback()
            for undo in reversed(self._replace_undos):  # before the truncations: see TokenLog.replace
                undo()
            for log, mark in self._log_marks.values():
                log.truncate(mark)
            for hashes, length in reversed(self.hash_marks):
                del hashes[length:]

    def writable_log(self, request_id: str) -> TokenLog:
        """The request's log, to append to (its appends are undone if the transition raises)."""
        log = self.logs[request_id]
        if request_id not in self._log_marks:
            self._log_marks[request_id] = (log, log.mark())
        return log

    def replace_token(self, request_id: str, position: int, token: int) -> None:
        """Overwrite a token of the request's log (undone if the transition raises)."""
        self._replace_undos.append(self.logs[request_id].replace(position, token, self.cfg.hash_unit))

    @property
    def waiting(self) -> tuple[str, ...] | list[str]:
        """The waiting queue as it stands, for reading; `writable_waiting()` changes it."""
        return self._waiting if self._waiting_copy is None else self._waiting_copy

    def writable_waiting(self) -> list[str]:
        if self._waiting_copy is None:
            self._waiting_copy = list(self._waiting)
        return self._waiting_copy

    def running_rows(self) -> np.ndarray:
        """The row of each running request, in running order (recomputed only past the first change)."""
        valid, total = self._rows_valid, len(self.running)
        if valid < total or len(self._running_rows) != total:
            # map over a bound C method, not a generator: a Python frame per request costs ~1 us
            rest = np.fromiter(map(self.row_of.__getitem__, self.running[valid:]), np.int64, total - valid)
            self._running_rows = frozen(np.concatenate([self._running_rows[:valid], rest]))
            self._rows_valid = total
        return self._running_rows

    def remove_running(self, request_ids: list[str]) -> None:
        indices = sorted(map(self.running.index, request_ids), reverse=True)
        for index in indices:
            del self.running[index]
        # the valid prefix of the running rows stays valid without the removed entries
        keep = np.ones(self._rows_valid, bool)
        keep[[i for i in indices if i < self._rows_valid]] = False
        self._running_rows = frozen(self._running_rows[:self._rows_valid][keep])
        self._rows_valid = len(self._running_rows)

    def freeze(self) -> SchedulerState:
        """Commit the writes; returns the state's new handle (the one passed in is consumed)."""
        data = self._data
        for part in self._parts:
            part.commit()
        data.waiting, data.running, data.running_rows = tuple(self.waiting), tuple(self.running), self.running_rows()
        data.claims, data.materializations, data.in_flight, data.step = (self.claims, self.materializations,
                                                                         self.in_flight, self.step)
        data.aborting, data.num_preemptions = self.aborting, self.num_preemptions
        data.generation += 1
        return SchedulerState(data)

    def num_tokens(self, request_id: str) -> int:
        return request_num_tokens(self.rows, self.row_of, self.parked, request_id)

    def hashes(self, request_id: str) -> list[int]:
        return self.logs[request_id].hashes[:self.num_tokens(request_id) // self.cfg.hash_unit]


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """Queue a request; raises ValueError (state unchanged) if it is malformed or can never fit."""
    _validate_request(state, request)
    with StateEdit(state) as edit:
        edit.logs[request.request_id] = TokenLog.create(request.prompt_token_ids, state.config.hash_unit,
                                                        root_hash(request.cache_salt))
        edit.requests[request.request_id] = request
        edit.parked[request.request_id] = request.num_prompt_tokens
        edit.writable_waiting().append(request.request_id)
        return edit.freeze()


def _validate_request(state: SchedulerState, request: Request) -> None:
    cfg, rid, num_prompt = state.config, request.request_id, request.num_prompt_tokens
    if not isinstance(rid, str):
        raise ValueError(f"request_id must be a str, got {rid!r}")
    if rid in state.requests:
        raise ValueError(f"request_id {rid!r} is already in use")
    if not isinstance(request.sampling_params, SamplingParams):
        raise ValueError(f"request {rid!r}: sampling_params must be a SamplingParams, got "
                         f"{request.sampling_params!r:.60}")
    if num_prompt == 0:
        raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
    if num_prompt >= cfg.max_model_len:
        raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens leaves no room for output "
                         f"within max_model_len {cfg.max_model_len}")
    _validate_token_ids(request, cfg.vocab_size)
    _validate_checkpoint(request, cfg.hash_unit)
    _validate_logits_and_row_data(request, cfg.row_data_bytes)
    if request.cache_salt is not None and not _is_utf8_str(request.cache_salt):
        raise ValueError(f"request {rid!r}: cache_salt must be a str (UTF-8 encodable) or None, got "
                         f"{request.cache_salt!r:.60}")
    need = -(-(max_len(cfg, request) + cfg.num_spec_tokens) // cfg.block_size)
    if need > cfg.num_blocks - 1:
        raise ValueError(f"request {rid!r} can never fit: it needs {need} KV blocks at its longest and the "
                         f"pool has {cfg.num_blocks - 1}")


def _is_utf8_str(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode()  # as root_hash digests it
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _validate_token_ids(request: Request, vocab_size: int | None) -> None:
    kinds = set(map(type, request.prompt_token_ids))  # one C-level pass; a bool is an int to numpy
    if not all(map(is_int_type, kinds)):
        raise ValueError(f"request {request.request_id!r}: prompt_token_ids must be integers, got "
                         f"{sorted(kind.__name__ for kind in kinds)} values")
    tokens = np.asarray(request.prompt_token_ids)
    high = np.iinfo(np.int32).max if vocab_size is None else vocab_size
    if tokens.min() < 0 or tokens.max() >= high:
        bad = int(tokens[(tokens < 0) | (tokens >= high)][0])
        raise ValueError(f"request {request.request_id!r}: token id {bad} is out of vocabulary [0, {high})")


def _validate_logits_and_row_data(request: Request, row_data_bytes: int) -> None:
    f, c, rid = request.logits_from, request.checkpoint_position, request.request_id
    if f is not None and (not is_int(f) or not 0 <= f < request.num_prompt_tokens):
        raise ValueError(f"request {rid!r}: logits_from {f!r} must be an integer prompt position in "
                         f"[0, {request.num_prompt_tokens})")
    if f is not None and c is not None and c > f:
        raise ValueError(f"request {rid!r}: checkpoint_position {c} lies past logits_from {f}: the checkpoint's "
                         f"consumers could not compute the logits before it")
    if not isinstance(request.row_data, bytes) or len(request.row_data) != row_data_bytes:
        raise ValueError(f"request {rid!r}: row_data must be {row_data_bytes} bytes, got {request.row_data!r:.40}")


def _validate_checkpoint(request: Request, unit: int) -> None:
    c = request.checkpoint_position
    if c is not None and (not is_int(c) or c <= 0 or c >= request.num_prompt_tokens or c % unit):
        raise ValueError(f"request {request.request_id!r}: checkpoint_position {c!r} must be a positive integer "
                         f"multiple of the hash unit {unit} inside the prompt of {request.num_prompt_tokens} tokens")


def abort_request(state: SchedulerState, request_id: str) -> SchedulerState:
    """Remove a request and free what it holds; raises KeyError (state unchanged) if unknown.

    A running request aborted while a step is in flight is released by that step's `update`: the step
    still writes its KV blocks and states (a producer's checkpoint among them), which are published
    then, and nothing it holds is reused before the step has run. It emits no more tokens."""
    if request_id not in state.requests:
        raise KeyError(f"abort_request: unknown request_id {request_id!r}")
    with StateEdit(state) as edit:
        end_request(edit, request_id)
        return edit.freeze()


def end_request(edit: StateEdit, request_id: str) -> None:
    """Free a live request now, or, if it runs in the step in flight, when that step is updated."""
    if request_id in edit.row_of and edit.in_flight is not None:
        if request_id not in edit.aborting:
            edit.aborting += (request_id,)
        return
    if request_id in edit.row_of:
        release_rows(edit, [request_id])
    else:
        edit.writable_waiting().remove(request_id)
    forget(edit, request_id)


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


def release_rows(edit: StateEdit, request_ids: list[str]) -> None:
    """Free the rows, KV blocks, running slots and unfinished checkpoint claims of running requests,
    all at once (a step's finished requests are released together)."""
    rows, cfg = edit.rows, edit.cfg
    row_ids = np.fromiter(map(edit.row_of.pop, request_ids), np.int64, len(request_ids))
    publish_full_blocks(edit, row_ids, request_ids)  # before the blocks go: a later prompt may share them
    cols = rows.ints.take(row_ids, axis=1)
    park_tails(edit.writable_log, rows, request_ids, row_ids, cfg.log_unit, cfg.hash_unit)
    # each request's blocks tail first, so that its tail is evicted before its head (as vLLM does): a
    # head keeps serving prefix hits on its own, a tail without its head is never hit again
    table = rows.block_table
    held = [table[row, :count][::-1] for row, count in zip(row_ids.tolist(), cols[NUM_BLOCKS].tolist(), strict=True)]
    edit.blocks.release(np.concatenate(held), distinct=len(held) == 1)  # requests may share prefix blocks
    gone = set(request_ids)
    if any(m.request_id in gone for m in edit.materializations):
        _keep_materializations(edit, request_ids, cols)
    kept = {m.running_slot for m in edit.materializations if m.released}
    for slot in cols[RUNNING_SLOT].tolist():
        if slot != NULL_SLOT and slot not in kept:
            edit.slots.release(slot)
    release_claims(edit, gone)
    for request_id, num_tokens in zip(request_ids, cols[NUM_TOKENS].tolist(), strict=True):
        edit.parked[request_id] = num_tokens
    edit.remove_running(request_ids)
    rows.clear(row_ids)


def logits_from(request: Request, prefill_end: int) -> int:
    """The first prefill position that asks for a logit: the prompt-logprobs start, else only the
    sampling position (also for a resumed request, whose prompt logits went out before preemption)."""
    if request.logits_from is None or prefill_end > request.num_prompt_tokens:
        return prefill_end - 1
    return request.logits_from


def max_len(cfg: SchedulerConfig, request: Request) -> int:
    """Tokens the request may reach (prompt + outputs): where it stops with reason LENGTH."""
    return min(request.num_prompt_tokens + request.sampling_params.max_tokens, cfg.max_model_len)


def publish_full_blocks(edit: StateEdit, row_ids: np.ndarray, request_ids) -> None:
    """Publish every full KV block that the rows have computed and committed: decode leaves them to be
    published here, right before anything looks them up (admission) or lets them go (release), so a
    steady decode batch hashes nothing while every lookup sees every full block."""
    cols = edit.rows.ints.take(row_ids, axis=1)
    full = np.minimum(cols[NUM_COMPUTED], cols[NUM_TOKENS]) // edit.cfg.hash_unit
    todo = (full > cols[PUBLISHED]).nonzero()[0]
    if todo.size:
        register_blocks(edit, [request_ids[i] for i in todo.tolist()], row_ids[todo], full[todo])


def register_blocks(edit: StateEdit, request_ids, row_ids: np.ndarray, last: np.ndarray) -> None:
    """Publish the KV blocks of each request i, running in row_ids[i], from its first unpublished one up
    to last[i], under their chained keys; all must be full, committed and computed by a step that has run."""
    rows = edit.rows
    first = rows.published[row_ids]
    last = np.maximum(last, first)
    rows.published[row_ids] = last
    counts = last - first
    if not counts.any():
        return
    logs = [edit.logs[rid] for rid in request_ids]
    have = np.array([len(log.hashes) for log in logs])
    todo = (last > have).nonzero()[0]
    if todo.size:
        _chain_tail_keys(edit, [logs[i] for i in todo.tolist()], row_ids[todo], have[todo], last[todo])
    keys = [key for log, lo, hi in zip(logs, first.tolist(), last.tolist(), strict=True) for key in log.hashes[lo:hi]]
    offsets = np.arange(len(keys)) - np.repeat(counts.cumsum() - counts - first, counts)  # block index in its row
    table = rows.block_table
    edit.blocks.register(table.take(np.repeat(row_ids, counts) * table.shape[1] + offsets).tolist(), keys)


def _chain_tail_keys(edit: StateEdit, logs: list[TokenLog], row_ids: np.ndarray, have: np.ndarray,
                     last: np.ndarray) -> None:
    """Chain the keys of units [have[i], last[i]) onto each log from its row's tail: a KV block is
    published before its log block moves into the log, and each unit is hashed once. Decode fills ~1
    block per row every few steps, so this is the per-row part of a decode step: the tokens are gathered
    and serialised in one call, and the common case costs one digest per row."""
    h, unit, tail = edit.cfg.hash_unit, edit.cfg.log_unit, edit.rows.tail
    counts = last - have
    start = have * h - edit.rows.num_tokens[row_ids] // unit * unit  # the tail begins at its log block
    columns = start[:, None] + np.arange(int(counts.max()) * h)
    data = tail.take(row_ids[:, None] * tail.shape[1] + np.minimum(columns, tail.shape[1] - 1)).astype("<i4")
    data, stride, size = data.tobytes(), 4 * columns.shape[1], 4 * h
    edit.hash_marks.extend((log.hashes, len(log.hashes)) for log in logs)
    for i, (log, count) in enumerate(zip(logs, counts.tolist(), strict=True)):
        hashes, parent = log.hashes, log.hashes[-1] if log.hashes else log.root
        for j in range(count):
            parent = blake2b(parent + data[i * stride + j * size:i * stride + (j + 1) * size],
                             digest_size=KEY_BYTES).digest()
            hashes.append(parent)


def _keep_materializations(edit: StateEdit, request_ids: list[str], cols: np.ndarray) -> None:
    """A boundary crossed in a request's last steps is still materialised: its running slot stays with the
    ask until the next step has read it (asks whose ring entries are gone are dropped)."""
    index = {rid: i for i, rid in enumerate(request_ids)}
    asks = []
    for m in edit.materializations:
        if m.request_id in index and not m.released:
            m = m.against(*cols[[NUM_COMPUTED, COMMITTED, RING_START], index[m.request_id]].tolist())
            m = m and m._replace(released=True)
        if m is not None:
            asks.append(m)
    edit.materializations = tuple(asks)


def release_claims(edit: StateEdit, request_ids: set[str]) -> None:
    """Producers lost before their checkpoint state exists hand the key back (PRODUCING -> ABSENT)."""
    for key, claim in list(edit.claims.items()):
        if claim.producer_id not in request_ids:
            continue
        status = advance(claim.status, CheckpointEvent.PRODUCER_LOST, key)
        if status is CheckpointStatus.ABSENT:
            edit.slots.release(claim.slot)
            del edit.claims[key]


def preempt(edit: StateEdit, request_id: str) -> None:
    """Recompute preemption: free everything, reset trackers, requeue at the front."""
    edit.num_preemptions += 1
    release_rows(edit, [request_id])
    edit.writable_waiting().insert(0, request_id)


def free_row(edit: StateEdit) -> int:
    return int(edit.rows.active.argmin())  # the first inactive row (False < True)
