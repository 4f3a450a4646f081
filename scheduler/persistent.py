"""Persistent values for the scheduler state: PMap (a dict) and PArray (a numpy array).

Both use Baker's rerooting, so a transition changes a large map or array in O(entries written).
The newest version owns the real dict or array; every older version is a chain of undo entries
that ends at it. Reading or editing an older version first "reroots" the chain (moves the real
data to that version and turns the newer ones into undo chains), so every version keeps seeing
exactly its own contents: successive states never observe each other's changes, and the linear
use of the scheduler (each state edited once) costs O(1) per read and per write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np


def frozen(array: np.ndarray) -> np.ndarray:
    """Mark a state array read-only in place, so a later in-place write raises instead of leaking."""
    array.setflags(write=False)
    return array


_MISSING = object()


class _Node:
    __slots__ = ("data", "undo", "next")

    def __init__(self, data, undo: list | None = None, nxt: _Node | None = None) -> None:
        self.data, self.undo, self.next = data, undo, nxt


def _reroot(node: _Node, revert: Callable[[object, list], list]):
    """Make `node`'s version the one holding the data; returns the data. Callers test `node.data`
    first: in the scheduler's linear use the version read is almost always the newest one."""
    path = []
    while node.data is None:
        path.append(node)
        node = node.next
    for older in reversed(path):
        data = node.data
        node.data, node.undo, node.next = None, revert(data, older.undo), older
        older.data, older.undo, older.next = data, None, None
        node = older
    return node.data


def _advance(base: _Node, data, undo: list) -> _Node:
    """The node of a new version written on top of `base` (which becomes an undo chain)."""
    new = _Node(data)
    base.data, base.undo, base.next = None, undo, new
    return new


class _Inserted(NamedTuple):
    """A dict undo entry for many keys at once: `keys` were absent before the write."""

    keys: tuple


class _Removed(NamedTuple):
    """The redo of an `_Inserted` entry: put `items` back."""

    items: dict


def _revert_dict(data: dict, undo: list) -> list:
    redo = []
    for entry in reversed(undo):
        if type(entry) is _Inserted:
            redo.append(_Removed({key: data.pop(key) for key in entry.keys}))
        elif type(entry) is _Removed:
            data.update(entry.items)
            redo.append(_Inserted(tuple(entry.items)))
        else:
            key, value = entry
            redo.append((key, data.get(key, _MISSING)))
            if value is _MISSING:
                del data[key]
            else:
                data[key] = value
    return redo


class _Flat(NamedTuple):
    """An undo entry's index into the flattened array (`put`/`take`), not an `array[index]` key."""

    index: np.ndarray


def _revert_array(array: np.ndarray, undo: list) -> list:
    redo = []
    for index, values in reversed(undo):
        if type(index) is _Flat:
            redo.append((index, array.take(index.index)))
            array.put(index.index, values)
        else:
            redo.append((index, array[index].copy()))
            array[index] = values
    return redo


class PMap:
    """An immutable mapping value; `edit()` gives a PMapEdit whose `freeze()` is the next version."""

    __slots__ = ("_node",)

    def __init__(self, data: dict | None = None, node: _Node | None = None) -> None:
        self._node = node if node is not None else _Node(dict(data or {}))

    def data(self) -> dict:
        """The contents as a plain dict, for C-level lookups in bulk; read it, never write it."""
        data = self._node.data
        return data if data is not None else _reroot(self._node, _revert_dict)

    def get(self, key, default=None):
        return self.data().get(key, default)

    def __contains__(self, key) -> bool:
        return key in self.data()

    def __getitem__(self, key):
        return self.data()[key]

    def __len__(self) -> int:
        return len(self.data())

    def __iter__(self):
        return iter(list(self.data()))

    def keys(self):
        return list(self.data())

    def values(self):
        return list(self.data().values())

    def items(self):
        return list(self.data().items())

    def to_dict(self) -> dict:
        return dict(self.data())

    def edit(self) -> PMapEdit:
        return PMapEdit(self)


class PMapEdit:
    """Writes go straight into the newest dict and are recorded so the old version can be restored."""

    __slots__ = ("_base", "_data", "_undo")

    def __init__(self, base: PMap) -> None:
        self._base, self._data, self._undo = base, base.data(), []

    def data(self) -> dict:
        """The current contents as a plain dict, for C-level lookups in bulk; read it, never write it."""
        return self._data

    def get(self, key, default=None):
        return self._data.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __getitem__(self, key):
        return self._data[key]

    def __setitem__(self, key, value) -> None:
        self._undo.append((key, self._data.get(key, _MISSING)))
        self._data[key] = value

    def insert_new(self, items: dict) -> None:
        """Write many entries whose keys are absent (a prefill step publishes ~100 blocks at once):
        one undo entry for all of them, no lookups."""
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
        """Remove many present keys (evicted prefix-cache blocks): one undo entry for all of them."""
        data = self._data
        self._undo.append(_Removed({key: data.pop(key) for key in keys}))

    def rollback(self) -> None:
        """Undo this edit's writes (a transition that raised): the base version is whole again."""
        if self._undo:
            _revert_dict(self._data, self._undo)
            self._undo = []

    def freeze(self) -> PMap:
        if not self._undo:
            return self._base
        node, self._undo = _advance(self._base._node, self._data, self._undo), []
        return PMap(node=node)


class PArray:
    """An immutable numpy array value. All versions of one array share one buffer, so `get()` returns
    the same read-only view for each of them: read it before reading another version, never keep it
    across one (copy what must outlive that)."""

    __slots__ = ("_node", "_view")

    def __init__(self, array: np.ndarray, node: _Node | None = None, view: np.ndarray | None = None) -> None:
        self._node = node if node is not None else _Node(array)
        self._view = view if view is not None else frozen(array.view())

    def get(self) -> np.ndarray:
        if self._node.data is None:
            _reroot(self._node, _revert_array)
        return self._view

    def edit(self) -> PArrayEdit:
        return PArrayEdit(self)


class PArrayEdit:
    """Writes (`edit[index] = values`) go straight into the shared buffer, recording the old values.
    An index must not be changed by the caller after the write (the undo entry keeps it)."""

    __slots__ = ("_base", "_array", "_undo")

    def __init__(self, base: PArray) -> None:
        array = base._node.data
        self._base, self._undo = base, []
        self._array = array if array is not None else _reroot(base._node, _revert_array)

    @property
    def view(self) -> np.ndarray:
        """Read-only view of the array as edited so far."""
        return self._base._view

    def __getitem__(self, index) -> np.ndarray:
        return self._array[index]

    def __setitem__(self, index, values) -> None:
        self._undo.append((index, self._array[index].copy()))
        self._array[index] = values

    def put(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        """`ndarray.put` (indices into the flattened array): many scattered entries in one fast call
        instead of a broadcast fancy index."""
        self._undo.append((_Flat(flat_index), self._array.take(flat_index)))
        self._array.put(flat_index, values)

    def rollback(self) -> None:
        """Undo this edit's writes (a transition that raised): the base version is whole again."""
        _revert_array(self._array, self._undo)
        self._undo = []

    def freeze(self) -> PArray:
        if not self._undo:
            return self._base
        node, self._undo = _advance(self._base._node, self._array, self._undo), []
        return PArray(self._array, node, self._base._view)
