"""The containers of the single-use scheduler state: written in place, with an undo log per transition.

A transition (add, abort, schedule, update) changes the one state it was given. Every write to an
`UndoMap` or an `UndoArray` records the value it overwrites, so a transition that raises puts them
back (`rollback`) and leaves its input state as it was; one that returns drops the log (`commit`).
A step therefore costs O(entries it writes), never a copy of a table or of the per-request maps.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np


def frozen(array: np.ndarray) -> np.ndarray:
    """Mark an array read-only in place, so a later in-place write raises instead of leaking."""
    array.setflags(write=False)
    return array


def set_writable(arrays, writable: bool) -> None:
    """Open a state's arrays for a transition's writes, or close them again: between transitions they are
    read-only, so nothing a caller reads from a state can write into it."""
    for array in arrays:
        array.setflags(write=writable)


_MISSING = object()


class _Inserted(NamedTuple):
    """Undo entry for many keys written at once: `keys` were absent before."""

    keys: tuple


class _Removed(NamedTuple):
    """Undo entry for many keys removed at once: put `items` back."""

    items: dict


class UndoMap(dict):
    """A dict whose writes are undone by `rollback` until `commit`; reads are the dict's own."""

    __slots__ = ("_undo",)

    def __init__(self, data: dict | None = None) -> None:
        super().__init__(data or {})
        self._undo = []

    def __setitem__(self, key, value) -> None:
        self._undo.append((key, self.get(key, _MISSING)))
        super().__setitem__(key, value)

    def insert_new(self, items: dict) -> None:
        """Write many absent keys (a prefill step publishes ~100 blocks at once): one undo entry."""
        self._undo.append(_Inserted(tuple(items)))
        self.update(items)

    def __delitem__(self, key) -> None:
        self.pop(key)

    def pop(self, key, default=_MISSING):
        if default is not _MISSING and key not in self:
            return default
        value = super().pop(key)
        self._undo.append((key, value))
        return value

    def remove_many(self, keys: list) -> None:
        """Remove many present keys (evicted prefix-cache blocks): one undo entry."""
        pop = super().pop
        self._undo.append(_Removed({key: pop(key) for key in keys}))

    def rollback(self) -> None:
        put, drop = super().__setitem__, super().__delitem__
        for entry in reversed(self._undo):
            if type(entry) is _Inserted:
                for key in entry.keys:
                    drop(key)
            elif type(entry) is _Removed:
                self.update(entry.items)
            elif entry[1] is _MISSING:
                drop(entry[0])
            else:
                put(*entry)
        self._undo = []

    def commit(self) -> None:
        self._undo = []

    def __deepcopy__(self, memo) -> UndoMap:  # a copy starts with no undo log
        return UndoMap({copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()})


class _Flat(NamedTuple):
    """An undo entry's index into the flattened array (`put`), not an `array[index]` key."""

    index: np.ndarray


class UndoArray:
    """A numpy array whose writes (`a[index] = values`, `a.put`) are undone by `rollback` until
    `commit`. `view` is a read-only view of the live contents. An index must not be changed by the
    caller after the write (the undo entry keeps it)."""

    __slots__ = ("_array", "view", "_undo")

    def __init__(self, array: np.ndarray) -> None:
        self._array, self.view, self._undo = array, frozen(array.view()), []

    def __getitem__(self, index) -> np.ndarray:
        return self.view[index]  # reads never hand out a writable view

    def __setitem__(self, index, values) -> None:
        self._undo.append((index, self._array[index].copy()))
        self._array[index] = values

    def put(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        """`ndarray.put` (indices into the flattened array): many scattered entries in one fast call."""
        self._undo.append((_Flat(flat_index), self._array.take(flat_index)))
        self._array.put(flat_index, values)

    def rollback(self) -> None:
        for index, values in reversed(self._undo):
            if type(index) is _Flat:
                self._array.put(index.index, values)
            else:
                self._array[index] = values
        self._undo = []

    def commit(self) -> None:
        self._undo = []

    def __deepcopy__(self, memo) -> UndoArray:  # `view` must stay a view of the copy
        return UndoArray(self._array.copy())
