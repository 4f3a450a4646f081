"""SchedulerState: the whole control-plane state as one immutable value (row table, queues, pools).

How a transition stays cheap without ever changing an old state:
  * hot per-row counters are two small numpy buffers (`Rows.ints`, `Rows.bools`), copied once per
    transition and read-only afterwards; hot paths gather all columns of many rows in one call;
  * the large tables (block tables, token tails, the block pool's arrays) are `PArray`s, and the
    hash maps and per-request maps `PMap`s (persistent.py): a transition writes them in place and
    pays O(entries written), not O(requests), while every older state still reads exactly its own
    contents;
  * token histories (`TokenLog`) are append-only and shared: a state sees only its prefix, and a
    writer whose view is not the buffer's end branches off a copy; a running request's newest
    tokens sit in the row table's tail until they fill a log block (history.py);
  * cold per-request data are frozen `Request` values; the waiting queue is a tuple, copied only by
    a transition that changes it.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from scheduler.blocks import BlockPool
from scheduler.checkpoints import Claim
from scheduler.config import SchedulerConfig
from scheduler.persistent import PArray, PArrayEdit, PMap, frozen
from scheduler.prefix_cache import ROOT_HASH, chain_hashes, unit_digests
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
)
BOOL_COLUMNS = ("active", "prefill_done", "has_stop")  # has_stop: extra stop_token_ids to check
# row indices of the columns in `Rows.ints`, for hot paths that gather every column of many rows at once
(NUM_COMPUTED, NUM_TOKENS, PREFILL_END, NUM_PROMPT, MAX_LEN, RUNNING_SLOT, RING_START, COMMITTED, NUM_BLOCKS,
 LAST_TOKEN, CHECKPOINT, EOS) = range(len(INT_COLUMNS))


class Rows:
    """The row table: INT_COLUMNS and BOOL_COLUMNS [S] (read as attributes, e.g. `rows.num_computed`,
    each a view of one row of the `ints` or `bools` buffer, so a transition copies two small arrays
    instead of fifteen and hot paths gather every column of many rows in one call), drafts [S, K]
    int32, and two persistent tables: block_table [S, B] int32 and tail [S, log_unit + K] int32
    (tokens of the partial log block, history.py). The tables (up to ~0.5 MB each) are `PArray`s,
    so a transition pays only for the entries it writes, through `rows.edit(name)`."""

    __slots__ = ("ints", "bools", "drafts", "_tables", "_edits")

    @staticmethod
    def create(cfg: SchedulerConfig) -> Rows:
        rows, size = Rows(), cfg.max_num_seqs
        rows.ints = np.zeros((len(INT_COLUMNS), size), np.int32)
        rows.bools = np.zeros((len(BOOL_COLUMNS), size), bool)
        rows.drafts = np.zeros((size, cfg.num_spec_tokens), np.int32)
        rows._tables = {"block_table": PArray(np.zeros((size, cfg.max_blocks_per_request), np.int32)),
                        "tail": PArray(np.zeros((size, cfg.log_unit + cfg.num_spec_tokens), np.int32))}
        rows._edits = {}
        return rows.frozen()

    @property
    def block_table(self) -> np.ndarray:
        return self._tables["block_table"].get()

    @property
    def tail(self) -> np.ndarray:
        return self._tables["tail"].get()

    def copy(self) -> Rows:
        """Writable columns and drafts; the tables are written through `edit`."""
        rows = Rows()
        rows.ints, rows.bools, rows.drafts = self.ints.copy(), self.bools.copy(), self.drafts.copy()
        rows._tables, rows._edits = self._tables, {}
        return rows

    def edit(self, name: str) -> PArrayEdit:
        """The writer of table `name` for this transition."""
        if name not in self._edits:
            self._edits[name] = self._tables[name].edit()
        return self._edits[name]

    def rollback(self) -> None:
        for edit in self._edits.values():
            edit.rollback()

    def frozen(self) -> Rows:
        # column views are taken on each read, so freezing the buffers freezes every view
        for buffer in (self.ints, self.bools, self.drafts):
            buffer.setflags(write=False)
        if self._edits:
            self._tables = self._tables | {name: edit.freeze() for name, edit in self._edits.items()}
            self._edits = {}
        return self

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
    blocks and parked tails), plus the chained hashes of its full hash units (always
    `length // hash_unit` of them). States share one TokenLog and each reads only the prefix it
    knows; `history.py` branches off a copy when a writer's view is not the buffer's end."""

    __slots__ = ("chunks", "ends", "hashes")

    def __init__(self, chunks: list[np.ndarray], ends: list[int], hashes: list[int]) -> None:
        self.chunks, self.ends, self.hashes = chunks, ends, hashes

    @staticmethod
    def create(tokens, hash_unit: int) -> TokenLog:
        log = TokenLog([], [], [])
        log.extend(frozen(np.array(tokens, np.int32)), hash_unit)
        return log

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0

    def extend(self, tokens: np.ndarray, hash_unit: int) -> None:
        """Append the read-only `tokens` (kept, not copied) and hash the hash units they complete."""
        first = len(self.hashes) * hash_unit
        self._append(tokens)
        last = self.length // hash_unit * hash_unit
        if last > first:
            self._chain(unit_digests(self.slice(first, last), hash_unit).tolist())

    def append_block(self, tokens: np.ndarray, digests: list[int]) -> None:
        """Append the read-only `tokens` whose hash units, with any logged tokens of the first one,
        have the digests `digests` (history.py computes them for many rows in one call)."""
        self._append(tokens)
        self._chain(digests)

    def _append(self, tokens: np.ndarray) -> None:
        self.chunks.append(tokens)
        self.ends.append(self.length + len(tokens))

    def _chain(self, digests: list[int]) -> None:
        self.hashes += chain_hashes(self.hashes[-1] if self.hashes else ROOT_HASH, digests)

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

    def branch(self, num_tokens: int, hash_unit: int) -> TokenLog:
        """A private copy of the view of `num_tokens`, for a writer whose view is not the buffer's end."""
        keep = bisect.bisect_right(self.ends, num_tokens)
        chunks, ends = self.chunks[:keep], self.ends[:keep]
        if num_tokens > (ends[-1] if ends else 0):
            chunks.append(frozen(self.slice(ends[-1] if ends else 0, num_tokens)))
            ends.append(num_tokens)
        return TokenLog(chunks, ends, self.hashes[:num_tokens // hash_unit])


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
    checkpoint_keys: tuple[int, ...]  # UNREADY checkpoints completed by the step


class Materialize(NamedTuple):
    """Asked for by `update`, issued by the next `schedule`: publish the state at `boundary`."""

    request_id: str
    running_slot: int
    key: int
    ring_start: int
    count: int


class SchedulerState(NamedTuple):
    """The whole control-plane state: an immutable value (a NamedTuple: built in one C call per step).
    The per-request maps are persistent (`PMap`): a transition pays for the entries it changes, not
    for the number of requests. `claims` is a small dict private to this version: never mutate it."""

    config: SchedulerConfig
    requests: PMap                     # request id -> Request: every live request, waiting or running
    waiting: tuple[str, ...]           # FCFS; preempted requests go back to the front
    running: tuple[str, ...]           # admission order; the newest is preempted first
    running_rows: np.ndarray           # [len(running)] int64 read-only: the row of each running request
    row_of: PMap                       # request id -> row of each running request
    rows: Rows
    blocks: BlockPool
    slots: SlotPool
    claims: dict[int, Claim]           # checkpoint keys that are PRODUCING or UNREADY
    logs: PMap                         # request id -> TokenLog
    parked_tokens: PMap                # request id -> committed tokens of a request without a row
    materializations: tuple[Materialize, ...]
    in_flight: InFlight | None
    step: int                          # steps scheduled so far; also the LRU clock

    def num_tokens(self, request_id: str) -> int:
        return request_num_tokens(self.rows, self.row_of, self.parked_tokens, request_id)

    def token_ids(self, request_id: str) -> list[int]:
        return request_tokens(self.rows, self.row_of, self.logs, self.parked_tokens, self.config.log_unit,
                              request_id)

    def has_work(self) -> bool:
        return bool(self.requests)


def init_state(config: SchedulerConfig) -> SchedulerState:
    return SchedulerState(config, PMap(), (), (), frozen(np.zeros(0, np.int64)), PMap(), Rows.create(config),
                          BlockPool.create(config.num_blocks), SlotPool.create(config.num_state_slots), {}, PMap(),
                          PMap(), (), None, 0)
