"""check_invariants(state): pool and table consistency, used by the simulator and the tests.

Returns a list of human-readable violations (empty when the state is consistent). Checked: KV ref
counts equal the live block-table references, free counts match, no block twice in one table, one
distinct RUNNING slot per running row, the hash maps are inverse and point at slots of a caching
kind, PENDING slots and UNREADY claims exist only while a step is in flight, PRODUCING claims are
held by running requests, the queues partition the live requests, and no row or materialization
counts more committed ring entries than the reference ops fold (`replay.max_committed`).
"""

from __future__ import annotations

import numpy as np

from scheduler.checkpoints import CheckpointStatus
from scheduler.replay import max_committed, ring_rows
from scheduler.slots import NULL_SLOT, SlotKind
from scheduler.state import SchedulerState


def check_invariants(state: SchedulerState) -> list[str]:
    return _blocks(state) + _slots(state) + _claims(state) + _queues(state) + _rings(state)


def _live_rows(state: SchedulerState) -> list[int]:
    return sorted(state.row_of.values())


def _blocks(state: SchedulerState) -> list[str]:
    rows, pool, errors = state.rows, state.blocks, []
    live = _live_rows(state)
    tables = [rows.block_table[row, :rows.num_blocks[row]] for row in live]
    flat = np.concatenate(tables).astype(np.int64) if tables else np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(live)), [t.size for t in tables])
    if np.unique(owner * pool.ref_count.size + flat).size != flat.size or not flat.all():
        errors.append("a block table repeats a block or holds the null block")
    expected = np.bincount(flat, minlength=pool.ref_count.size)
    if not np.array_equal(expected[1:], pool.ref_count[1:]):
        errors.append(f"ref counts differ from live references at {np.flatnonzero(expected != pool.ref_count)}")
    free = np.concatenate([pool.free_uncached, pool.free_cached])
    if np.unique(free).size != free.size or set(free.tolist()) != set(np.flatnonzero(pool.ref_count == 0)) - {0}:
        errors.append("free queues differ from the unreferenced blocks")
    if {b: h for h, b in pool.hash_to_block.items()} != dict(pool.block_to_key):
        errors.append("KV hash maps are not inverse")
    if not all(map(pool.block_to_key.__contains__, pool.free_cached.tolist())):
        errors.append("a block in free_cached holds no hash")
    if pool.num_cached_free != len(pool.free_cached):
        errors.append(f"num_cached_free {pool.num_cached_free} != {len(pool.free_cached)} live queue entries")
    return errors


def _slots(state: SchedulerState) -> list[str]:
    rows, pool, errors = state.rows, state.slots, []
    running = [int(rows.running_slot[row]) for row in _live_rows(state)]
    running += [m.running_slot for m in state.materializations if m.released]  # held until materialized
    if len(set(running)) != len(running) or NULL_SLOT in running:
        errors.append(f"running slots {running} repeat or use the null slot")
    kinds = pool.kind
    if any(kinds[s] != SlotKind.RUNNING for s in running):
        errors.append("a running row's slot is not RUNNING")
    if int(np.count_nonzero(kinds[1:] == SlotKind.RUNNING)) != len(running):
        errors.append("RUNNING slots without a running row (leak)")
    caching = {int(s) for s in np.flatnonzero(kinds >= SlotKind.CACHED)}
    if set(pool.slot_to_hash) != caching or any(pool.hash_to_slot.get(h) != s for s, h in pool.slot_to_hash.items()):
        errors.append("state hash maps disagree with slot kinds")
    if state.in_flight is None and np.any(kinds == SlotKind.PENDING):
        errors.append("PENDING slots with no step in flight")
    return errors


def _rings(state: SchedulerState) -> list[str]:
    cfg = state.config
    bound = max_committed(ring_rows(cfg.ring_size, cfg.num_spec_tokens), cfg.num_spec_tokens)
    committed = [int(state.rows.committed[row]) for row in _live_rows(state)]
    committed += [m.count for m in state.materializations]
    if max(committed, default=0) > bound:
        return [f"committed ring entries {committed} pass the fold's bound {bound}"]
    return []


def _claims(state: SchedulerState) -> list[str]:
    errors = []
    for key, claim in state.claims.items():
        if claim.status is CheckpointStatus.UNREADY and state.in_flight is None:
            errors.append(f"checkpoint {key.hex()[:16]} UNREADY with no step in flight")
        if claim.status is CheckpointStatus.PRODUCING:
            if claim.producer_id not in state.row_of:
                errors.append(f"checkpoint {key.hex()[:16]} held by {claim.producer_id!r}, which is not running")
            if state.slots.kind[claim.slot] != SlotKind.RESERVED:
                errors.append(f"checkpoint {key.hex()[:16]} slot {claim.slot} is not RESERVED")
    return errors


def _queues(state: SchedulerState) -> list[str]:
    waiting, running = set(state.waiting), set(state.running)
    errors = []
    if waiting & running or waiting | running != set(state.requests) or running != set(state.row_of):
        errors.append("waiting/running do not partition the live requests")
    if state.running_rows.tolist() != [state.row_of.get(rid) for rid in state.running]:
        errors.append("running_rows differ from the rows of the running requests")
    if int(np.count_nonzero(state.rows.active)) != len(running):
        errors.append("active rows != running requests")
    available = int(np.count_nonzero((state.slots.kind == SlotKind.FREE) | (state.slots.kind == SlotKind.CACHED)))
    if state.slots.num_free_or_cached != available:
        errors.append(f"slot pool counts {state.slots.num_free_or_cached} free or cached slots, there are {available}")
    return errors


# every per-request map and queue the state keeps: all empty once every request has ended
_REQUEST_MAPS = ("requests", "waiting", "running", "row_of", "logs", "parked_tokens", "unresolved_ends", "claims",
                 "materializations", "aborting")


def check_drained(state: SchedulerState) -> list[str]:
    """Once every request has ended and every step is updated and resolved, the pools must be back to their
    initial free counts and every per-request map empty."""
    errors = check_invariants(state)
    if state.blocks.num_free != state.config.num_blocks - 1:
        errors.append(f"{state.config.num_blocks - 1 - state.blocks.num_free} KV blocks still referenced")
    busy = np.flatnonzero((state.slots.kind[1:] != SlotKind.FREE) & (state.slots.kind[1:] != SlotKind.CACHED))
    if busy.size:
        errors.append(f"state slots {busy + 1} still held")
    left = [name for name in _REQUEST_MAPS if getattr(state, name)]
    if left:
        errors.append(f"left over in {', '.join(left)}")
    if state.in_flight is not None:
        errors.append(f"step {state.in_flight.step_id} is still in flight")
    return errors
