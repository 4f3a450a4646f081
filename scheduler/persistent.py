"""PMap: a persistent dict (Baker's rerooting), so a transition changes a large map in O(changes).

The newest version owns the real dict; every older version is a chain of undo entries that ends at
it. Reading or editing an older version first "reroots" the chain (moves the real dict to that
version and turns the newer ones into undo chains), so every version keeps seeing exactly its own
contents: successive states never observe each other's changes, and the linear use of the
scheduler (each state edited once) costs O(1) per read and per write.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np


def frozen(array: np.ndarray) -> np.ndarray:
    """Mark a state array read-only in place, so a later in-place write raises instead of leaking."""
    array.flags.writeable = False
    return array

_MISSING = object()


class _Node:
    __slots__ = ("data", "undo", "next")

    def __init__(self, data: dict | None, undo: list | None = None, nxt: _Node | None = None) -> None:
        self.data, self.undo, self.next = data, undo, nxt


def _reroot(node: _Node) -> dict:
    path = []
    while node.data is None:
        path.append(node)
        node = node.next
    for older in reversed(path):
        data, redo = node.data, []
        for key, value in reversed(older.undo):
            redo.append((key, data.get(key, _MISSING)))
            if value is _MISSING:
                del data[key]
            else:
                data[key] = value
        node.data, node.undo, node.next = None, redo, older
        older.data, older.undo, older.next = data, None, None
        node = older
    return node.data


class PMap:
    """An immutable mapping value; `edit()` gives a PMapEdit whose `freeze()` is the next version."""

    __slots__ = ("_node",)

    def __init__(self, data: dict | None = None, node: _Node | None = None) -> None:
        self._node = node if node is not None else _Node(dict(data or {}))

    def get(self, key, default=None):
        return _reroot(self._node).get(key, default)

    def __contains__(self, key) -> bool:
        return key in _reroot(self._node)

    def __getitem__(self, key):
        return _reroot(self._node)[key]

    def __len__(self) -> int:
        return len(_reroot(self._node))

    def __iter__(self):
        return iter(list(_reroot(self._node)))

    def keys(self):
        return list(_reroot(self._node))

    def items(self):
        return list(_reroot(self._node).items())

    def to_dict(self) -> dict:
        return dict(_reroot(self._node))

    def data(self) -> dict:
        """The contents as a plain dict, for C-level lookups in bulk; read it, never write it."""
        return _reroot(self._node)

    def edit(self) -> PMapEdit:
        return PMapEdit(self)


class PMapEdit:
    """Writes go straight into the newest dict and are recorded so the old version can be restored."""

    __slots__ = ("_base", "_data", "_undo")

    def __init__(self, base: PMap) -> None:
        self._base, self._data, self._undo = base, None, []

    def _dict(self) -> dict:
        if self._data is None:
            self._data = _reroot(self._base._node)
        return self._data

    def get(self, key, default=None):
        return self._dict().get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._dict()

    def __getitem__(self, key):
        return self._dict()[key]

    def data(self) -> dict:
        """The current contents as a plain dict, for C-level lookups in bulk; read it, never write it."""
        return self._dict()

    def __setitem__(self, key, value) -> None:
        data = self._dict()
        self._undo.append((key, data.get(key, _MISSING)))
        data[key] = value

    def update(self, items: dict) -> None:
        """Write many entries with C-level loops (a prefill step publishes ~100 blocks at once)."""
        data = self._dict()
        self._undo.extend(zip(items, map(data.get, items, repeat(_MISSING)), strict=True))
        data.update(items)

    def pop(self, key):
        data = self._dict()
        value = data.pop(key)
        self._undo.append((key, value))
        return value

    def freeze(self) -> PMap:
        if not self._undo:
            return self._base
        old, new = self._base._node, _Node(self._data)
        old.data, old.undo, old.next = None, self._undo, new
        self._undo = []
        return PMap(node=new)
