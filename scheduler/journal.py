"""The containers of the single-use scheduler state: written in place, with an undo log per transition.

A transition (add, abort, schedule, update) changes the one state it was given. Every write to an
`UndoMap` or an `UndoArray` records the value it overwrites, so a transition that raises puts them
back (`rollback`) and leaves its input state as it was; one that returns drops the log (`commit`).
A step therefore costs O(entries it writes), never a copy of a table or of the per-request maps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def frozen(array: np.ndarray) -> np.ndarray:
    """Mark an array read-only in place, so a later in-place write raises instead of leaking."""
    array.setflags(write=False)
    return array


_MISSING = object()


class _Inserted(NamedTuple):
    """Undo entry for many keys written at once: `keys` were absent before."""

    keys: tuple


class _Removed(NamedTuple):
    """Undo entry for many keys removed at once: put `items` back."""

    items: dict


class UndoMap:
    """A dict whose writes are undone by `rollback` until `commit`."""

    __slots__ = ("_data", "_undo")

    def __init__(self, data: dict | None = None) -> None:
        self._data, self._undo = dict(data or {}), []

    def data(self) -> dict:
        """The contents as a plain dict, for C-level lookups in bulk; read it, never write it."""
        return self._data

    def get(self, key, default=None):
        return self._data.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __getitem__(self, key):
        return self._data[key]

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self):
        return iter(list(self._data))

    def keys(self) -> list:
        return list(self._data)

    def values(self) -> list:
        return list(self._data.values())

    def items(self) -> list:
        return list(self._data.items())

    def to_dict(self) -> dict:
        return dict(self._data)

    def __setitem__(self, key, value) -> None:
        self._undo.append((key, self._data.get(key, _MISSING)))
        self._data[key] = value

    def insert_new(self, items: dict) -> None:
        """Write many absent keys (a prefill step publishes ~100 blocks at once): one undo entry."""
        self._undo.append(_Inserted(tuple(items)))
        self._data.update(items)

    def __delitem__(self, key) -> None:
        self.pop(key)

    def pop(self, key, default=_MISSING):
        if default is not _MISSING and key not in self._data:
            return default
        value = self._data.pop(key)
        self._undo.append((key, value))
        return value

    def remove_many(self, keys: list) -> None:
        """Remove many present keys (evicted prefix-cache blocks): one undo entry."""
        data = self._data
        self._undo.append(_Removed({key: data.pop(key) for key in keys}))

    def rollback(self) -> None:
        data = self._data
        for entry in reversed(self._undo):
            if type(entry) is _Inserted:
                for key in entry.keys:
                    del data[key]
            elif type(entry) is _Removed:
                data.update(entry.items)
            elif entry[1] is _MISSING:
                del data[entry[0]]
            else:
                data[entry[0]] = entry[1]
        self._undo = []

    def commit(self) -> None:
        self._undo = []


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
        return self._array[index]

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
