"""`StateEdit`: how every transition (add, abort, schedule, update) changes the single-use state.

The large parts change in place with undo logs, the small ones (queues, claims) as private copies. `freeze()`
commits them and hands the state back under a new generation; an exception rolls them back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scheduler.journal import frozen
from scheduler.state import SchedulerState, StateData, TokenLog, request_num_tokens


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
