"""SchedulerState: the whole control-plane state, a single-use value (row table, queues, pools).

Like a donated JAX buffer, a state is consumed by the transition it is passed to: the transition
changes the one underlying `StateData` in place and hands it back under a new generation, and any
later use of the consumed handle raises `StaleStateError`. A transition that raises rolls its writes
back (journal.py) and leaves its input valid and unchanged. `snapshot()` (or `copy.deepcopy`) gives
an independent copy, for tests and debugging. Transitions stay functions of their inputs (no hidden
globals, no clocks), so a log of events replays every decision bit for bit (replay_log.py).
  * hot per-row counters are two small numpy buffers (`Rows.ints`, `Rows.bools`); hot paths gather
    all columns of many rows in one call;
  * the large tables (block tables, token tails, the block pool's arrays) and the hash and
    per-request maps are written in place with undo logs, so a step pays O(entries written), not
    O(requests);
  * token histories (`TokenLog`) are append-only; a running request's newest tokens sit in the row
    table's tail until they fill a log block (history.py);
  * cold per-request data are frozen `SequenceSpec` values.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from scheduler.blocks import BlockPool
from scheduler.checkpoints import Claim
from scheduler.config import SchedulerConfig
from scheduler.journal import UndoArray, UndoMap, frozen, set_writable
from scheduler.prefix_cache import ROOT_HASH, chain_hashes
from scheduler.replay import materialize_count
from scheduler.slots import SlotPool

# per-row int32 columns, indexed by row id in [0, max_num_seqs)
INT_COLUMNS = (
    "num_computed",   # tokens whose KV and state are computed
    "num_tokens",     # committed tokens (prompt + accepted outputs)
    "prefill_end",    # known tokens at admission: the prefill runs to here, then samples
    "num_prompt",
    "max_len",        # min(prompt + max_tokens, max_model_len): the request stops here
    "running_slot",
    "ring_start",     # ReplaySSM trackers (replay.py)
    "committed",
    "num_blocks",     # valid entries of block_table
    "last_token",     # the sampled token the next verify row starts with
    "checkpoint",     # declared checkpoint position, 0 if none
    "eos",            # eos token id that stops the request, -1 if none (or ignore_eos)
    "logits_from",    # prefill positions from here on ask for logits (prefill_end - 1: sampling only)
    "published",      # leading KV blocks of the row that are in the prefix cache
)
BOOL_COLUMNS = ("active", "prefill_done", "has_stop")  # has_stop: extra stop_token_ids to check
# row indices of the columns in `Rows.ints`, for hot paths that gather every column of many rows at once
(NUM_COMPUTED, NUM_TOKENS, PREFILL_END, NUM_PROMPT, MAX_LEN, RUNNING_SLOT, RING_START, COMMITTED, NUM_BLOCKS,
 LAST_TOKEN, CHECKPOINT, EOS, LOGITS_FROM, PUBLISHED) = range(len(INT_COLUMNS))


class Rows:
    """The row table: INT_COLUMNS and BOOL_COLUMNS [S] (read as attributes, e.g. `rows.num_computed`,
    each a view of one row of the `ints` or `bools` buffer, so hot paths gather every column of many
    rows in one call), drafts [S, K] int32, data [S, row_data_bytes] uint8 (each request's opaque
    `row_data`), and two tables written through undo logs: block_table
    [S, B] int32 and tail [S, log_unit + K] int32 (tokens of the partial log block, history.py).
    `begin` keeps the small buffers to restore if the transition raises; the tables (up to ~0.5 MB
    each) keep undo logs instead, so a transition pays only for the entries it writes."""

    __slots__ = ("ints", "bools", "drafts", "data", "_tables", "_saved")

    def __init__(self, cfg: SchedulerConfig) -> None:
        size = cfg.max_num_seqs
        self.ints = np.zeros((len(INT_COLUMNS), size), np.int32)
        self.bools = np.zeros((len(BOOL_COLUMNS), size), bool)
        self.drafts = np.zeros((size, cfg.num_spec_tokens), np.int32)
        self.data = np.zeros((size, cfg.row_data_bytes), np.uint8)
        self._tables = {"block_table": UndoArray(np.zeros((size, cfg.max_blocks_per_request), np.int32)),
                        "tail": UndoArray(np.zeros((size, cfg.log_unit + cfg.num_spec_tokens), np.int32))}
        self._saved = None
        self.lock()

    @property
    def block_table(self) -> np.ndarray:
        return self._tables["block_table"].view

    @property
    def tail(self) -> np.ndarray:
        return self._tables["tail"].view

    def edit(self, name: str) -> UndoArray:
        """The writer of table `name`."""
        return self._tables[name]

    def begin(self) -> None:
        self._saved = (self.ints.copy(), self.bools.copy(), self.drafts.copy(), self.data.copy())
        set_writable(self._saved, False)
        set_writable((self.ints, self.bools, self.drafts, self.data), True)

    def rollback(self) -> None:
        self.ints, self.bools, self.drafts, self.data = self._saved
        for table in self._tables.values():
            table.rollback()

    def commit(self) -> None:
        self._saved = None
        for table in self._tables.values():
            table.commit()
        self.lock()

    def lock(self) -> None:
        """Make the small buffers read-only until the next `begin` (the tables' views always are)."""
        set_writable((self.ints, self.bools, self.drafts, self.data), False)

    def clear(self, rows: np.ndarray) -> None:
        # block_table, drafts and tail are only read below num_blocks, after a sample or after
        # admission seeded them, so they are left as is
        self.ints[:, rows] = 0
        self.bools[:, rows] = False


def _add_column_properties() -> None:
    """`rows.<column>` for every name in INT_COLUMNS and BOOL_COLUMNS: that row of its buffer."""
    def column(buffer: str, index: int) -> property:
        return property(lambda rows: getattr(rows, buffer)[index])

    for buffer, names in (("ints", INT_COLUMNS), ("bools", BOOL_COLUMNS)):
        for index, name in enumerate(names):
            setattr(Rows, name, column(buffer, index))


_add_column_properties()


_NO_TOKENS = frozen(np.zeros(0, np.int32))


class TokenLog:
    """Append-only token history of one request, as read-only int32 chunks (the prompt, then log
    blocks and parked tails), plus the chained hash keys of its full hash units (`length // hash_unit`
    of them, and those of committed units still in its row's tail: publish.register_blocks), chained from
    `root` (prefix_cache.root_hash)."""

    __slots__ = ("chunks", "ends", "hashes", "root")

    def __init__(self, root: bytes = ROOT_HASH) -> None:
        self.chunks: list[np.ndarray] = []
        self.ends: list[int] = []
        self.hashes: list[bytes] = []
        self.root = root

    @staticmethod
    def create(tokens, hash_unit: int, root: bytes = ROOT_HASH) -> TokenLog:
        log = TokenLog(root)
        log.extend(frozen(np.array(tokens, np.int32)), hash_unit)
        return log

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __deepcopy__(self, memo) -> TokenLog:
        log = TokenLog(self.root)  # chunks are read-only, never written in place: a copy shares them
        log.chunks, log.ends, log.hashes = list(self.chunks), list(self.ends), list(self.hashes)
        return log

    def extend(self, tokens: np.ndarray, hash_unit: int) -> None:
        """Append the read-only `tokens` (kept, not copied) and hash the hash units they complete."""
        first = len(self.hashes) * hash_unit
        self.chunks.append(tokens)
        self.ends.append(self.length + len(tokens))
        last = self.length // hash_unit * hash_unit
        if last > first:
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes += chain_hashes(parent, self.slice(first, last), hash_unit)

    def replace(self, position: int, token: int, hash_unit: int) -> Callable[[], None]:
        """Overwrite the token at `position` (a placeholder resolved, resolve.py) and re-chain the keys of
        its unit and those after it in the log. Returns its undo, for a transition that raises."""
        i, unit = bisect.bisect_right(self.ends, position), position // hash_unit
        old_chunk, old_keys = self.chunks[i], self.hashes[unit:]
        chunk = old_chunk.copy()
        chunk[position - (self.ends[i - 1] if i else 0)] = token
        self.chunks[i] = frozen(chunk)
        if len(self.hashes) > unit:
            del self.hashes[unit:]
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes += chain_hashes(parent, self.slice(unit * hash_unit, self.length // hash_unit * hash_unit),
                                        hash_unit)

        def undo() -> None:
            self.chunks[i] = old_chunk
            self.hashes[unit:] = old_keys  # in place: the list is shared with undo marks (StateEdit.hash_marks)
        return undo

    def mark(self) -> tuple[int, int]:
        """Where the log ends now, for `truncate` (a transition that raises undoes its appends)."""
        return len(self.chunks), len(self.hashes)

    def truncate(self, mark: tuple[int, int]) -> None:
        num_chunks, num_hashes = mark
        del self.chunks[num_chunks:], self.ends[num_chunks:], self.hashes[num_hashes:]

    def slice(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) (end <= length) as one array: a view when they lie in one chunk."""
        if start >= end:
            return _NO_TOKENS
        i = bisect.bisect_right(self.ends, start)  # the chunk holding token `start`
        begin = self.ends[i - 1] if i else 0
        if end <= self.ends[i]:
            return self.chunks[i][start - begin:end - begin]
        j = bisect.bisect_left(self.ends, end)  # the chunk holding token `end - 1`
        return np.concatenate([self.chunks[i][start - begin:], *self.chunks[i + 1:j],
                               self.chunks[j][:end - self.ends[j - 1]]])


def num_logged(rows: Rows, row_ids, unit: int):
    """Tokens of each running row that are in its TokenLog (history.py explains the split)."""
    return np.maximum(rows.num_tokens[row_ids] // unit * unit, rows.prefill_end[row_ids])


def row_tokens(log: TokenLog, rows: Rows, row: int, unit: int) -> list[int]:
    """All committed tokens of the request running in `row`: the log's part, then the tail's."""
    total, logged = int(rows.num_tokens[row]), int(num_logged(rows, row, unit))
    start = total // unit * unit
    return log.slice(0, logged).tolist() + rows.tail[row, logged - start:total - start].tolist()


def request_num_tokens(rows: Rows, row_of, parked, request_id: str) -> int:
    """Committed tokens of a request: from its row while running, else from `parked` (waiting)."""
    row = row_of.get(request_id)
    return int(rows.num_tokens[row]) if row is not None else parked[request_id]


def request_tokens(rows: Rows, row_of, logs, parked, unit: int, request_id: str) -> list[int]:
    """Committed token ids of a request, running (log + row tail) or waiting (log only)."""
    row, log = row_of.get(request_id), logs[request_id]
    if row is None:
        return log.slice(0, parked[request_id]).tolist()
    return row_tokens(log, rows, row, unit)


class InFlight(NamedTuple):
    """Commitments of the scheduled, not yet updated step: what becomes READY in `update`."""

    step_id: int
    ready_slots: tuple[int, ...]      # PENDING cache slots written by the step
    checkpoint_keys: tuple[bytes, ...]  # UNREADY checkpoints completed by the step


class Materialize(NamedTuple):
    """Asked for by `update` (or, a step late, `resolve`), issued by the next `schedule`: publish the state
    after `boundary` tokens, S0 of `running_slot` advanced by `count` ring entries from `ring_start`."""

    request_id: str
    running_slot: int
    key: bytes
    boundary: int
    ring_start: int
    count: int
    released: bool = False  # the request is gone; its running slot is kept for this read alone

    def against(self, computed: int, committed: int, ring_start: int) -> Materialize | None:
        """This ask read from the row's trackers now, or None if its entries are gone (a flush since folded
        the ring past the boundary)."""
        count = materialize_count(self.boundary, computed, committed)
        return self._replace(ring_start=ring_start, count=count) if 0 <= count <= committed else None


class StaleStateError(RuntimeError):
    """A scheduler state was used after a transition consumed it."""


class StateData:
    """What a `SchedulerState` handle points at: the one mutable state of a scheduler, whose
    `generation` names the only live handle. Per-request maps and tables are written in place."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.requests = UndoMap()            # request id -> SequenceSpec: every live request, waiting or running
        self.waiting: tuple[str, ...] = ()   # FCFS; preempted requests go back to the front
        self.running: tuple[str, ...] = ()   # admission order; the newest is preempted first
        self.running_rows = frozen(np.zeros(0, np.int64))  # [len(running)] the row of each running request
        self.row_of = UndoMap()              # request id -> row of each running request
        self.rows = Rows(config)
        self.blocks = BlockPool(config.num_blocks)
        self.slots = SlotPool(config.num_state_slots)
        self.claims: dict[bytes, Claim] = {}  # checkpoint keys that are PRODUCING or UNREADY
        self.logs = UndoMap()                # request id -> TokenLog
        self.parked_tokens = UndoMap()       # request id -> committed tokens of a request without a row
        self.materializations: tuple[Materialize, ...] = ()
        self.aborting: tuple[str, ...] = ()  # running requests aborted while a step is in flight
        self.unresolved_ends = UndoMap()     # request id -> stop ids of a request that reached max_len on a
                                             # placeholder token: `resolve` tells "length" from "stop"
        self.in_flight: InFlight | None = None
        self.step = 0                        # steps scheduled so far; also the LRU clock
        self.num_preemptions = 0             # running requests preempted so far (a metric)
        self.generation = 0

    def num_tokens(self, request_id: str) -> int:
        return request_num_tokens(self.rows, self.row_of, self.parked_tokens, request_id)

    def token_ids(self, request_id: str) -> list[int]:
        return request_tokens(self.rows, self.row_of, self.logs, self.parked_tokens, self.config.log_unit,
                              request_id)

    def has_work(self) -> bool:
        """Requests to serve, or a finished one's boundary state still to materialize."""
        return bool(self.requests or self.materializations)


class SchedulerState:
    """A handle to the scheduler state of one generation: reads go through to its `StateData` while
    no transition has consumed it, and raise `StaleStateError` afterwards."""

    __slots__ = ("_data", "_generation")

    def __init__(self, data: StateData) -> None:
        self._data, self._generation = data, data.generation

    def live(self) -> StateData:
        if self._data.generation != self._generation:
            raise StaleStateError(f"this scheduler state (generation {self._generation}) was consumed by a "
                                  f"transition; use the state it returned (generation {self._data.generation})")
        return self._data

    def __getattr__(self, name: str):
        return getattr(self.live(), name)

    def snapshot(self) -> SchedulerState:
        """An independent copy of this state (tests, debugging, what-if branches)."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo) -> SchedulerState:
        data = copy.deepcopy(self.live(), memo)
        data.rows.lock()  # numpy copies are writable
        data.slots.lock()
        frozen(data.running_rows)
        return SchedulerState(data)


def init_state(config: SchedulerConfig) -> SchedulerState:
    return SchedulerState(StateData(config))
