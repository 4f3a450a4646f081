"""SequenceSpec lifecycle outside the step: add (validated), abort, preempt, and freeing what a request holds."""

from __future__ import annotations

import numpy as np

from scheduler.checkpoints import CheckpointEvent, CheckpointStatus, advance
from scheduler.config import SchedulerConfig
from scheduler.history import park_tails
from scheduler.prefix_cache import root_hash
from scheduler.publish import publish_full_blocks
from scheduler.request import SequenceSpec, StopParams, is_int, is_int_type
from scheduler.slots import NULL_SLOT
from scheduler.state import (
    COMMITTED,
    NUM_BLOCKS,
    NUM_COMPUTED,
    NUM_TOKENS,
    RING_START,
    RUNNING_SLOT,
    SchedulerState,
    TokenLog,
)
from scheduler.transaction import StateEdit


def add_request(state: SchedulerState, request: SequenceSpec) -> SchedulerState:
    """Queue a request; raises ValueError (state unchanged) if it is malformed or can never fit."""
    _validate_request(state, request)
    with StateEdit(state) as edit:
        edit.logs[request.request_id] = TokenLog.create(request.prompt_token_ids, state.config.hash_unit,
                                                        root_hash(request.cache_salt))
        edit.requests[request.request_id] = request
        edit.parked[request.request_id] = request.num_prompt_tokens
        edit.writable_waiting().append(request.request_id)
        return edit.freeze()


def _validate_request(state: SchedulerState, request: SequenceSpec) -> None:
    cfg, rid, num_prompt = state.config, request.request_id, request.num_prompt_tokens
    if not isinstance(rid, str):
        raise ValueError(f"request_id must be a str, got {rid!r}")
    if rid in state.requests:
        raise ValueError(f"request_id {rid!r} is already in use")
    if not isinstance(request.stop_params, StopParams):
        raise ValueError(f"request {rid!r}: stop_params must be a StopParams, got "
                         f"{request.stop_params!r:.60}")
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


def _validate_token_ids(request: SequenceSpec, vocab_size: int | None) -> None:
    kinds = set(map(type, request.prompt_token_ids))  # one C-level pass; a bool is an int to numpy
    if not all(map(is_int_type, kinds)):
        raise ValueError(f"request {request.request_id!r}: prompt_token_ids must be integers, got "
                         f"{sorted(kind.__name__ for kind in kinds)} values")
    tokens = np.asarray(request.prompt_token_ids)
    high = np.iinfo(np.int32).max if vocab_size is None else vocab_size
    if tokens.min() < 0 or tokens.max() >= high:
        bad = int(tokens[(tokens < 0) | (tokens >= high)][0])
        raise ValueError(f"request {request.request_id!r}: token id {bad} is out of vocabulary [0, {high})")


def _validate_logits_and_row_data(request: SequenceSpec, row_data_bytes: int) -> None:
    f, c, rid = request.logits_from, request.checkpoint_position, request.request_id
    if f is not None and (not is_int(f) or not 0 <= f < request.num_prompt_tokens):
        raise ValueError(f"request {rid!r}: logits_from {f!r} must be an integer prompt position in "
                         f"[0, {request.num_prompt_tokens})")
    if f is not None and c is not None and c > f:
        raise ValueError(f"request {rid!r}: checkpoint_position {c} lies past logits_from {f}: the checkpoint's "
                         f"consumers could not compute the logits before it")
    if not isinstance(request.row_data, bytes) or len(request.row_data) != row_data_bytes:
        raise ValueError(f"request {rid!r}: row_data must be {row_data_bytes} bytes, got {request.row_data!r:.40}")


def _validate_checkpoint(request: SequenceSpec, unit: int) -> None:
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


def logits_from(request: SequenceSpec, prefill_end: int) -> int:
    """The first prefill position that asks for a logit: the prompt-logprobs start, else only the
    sampling position (also for a resumed request, whose prompt logits went out before preemption)."""
    if request.logits_from is None or prefill_end > request.num_prompt_tokens:
        return prefill_end - 1
    return request.logits_from


def max_len(cfg: SchedulerConfig, request: SequenceSpec) -> int:
    """Tokens the request may reach (prompt + outputs): where it stops with reason LENGTH."""
    return min(request.num_prompt_tokens + request.stop_params.max_tokens, cfg.max_model_len)


def _keep_materializations(edit: StateEdit, request_ids: list[str], cols: np.ndarray) -> None:
    """A boundary crossed in a request's last steps is still materialized: its running slot stays with the
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
