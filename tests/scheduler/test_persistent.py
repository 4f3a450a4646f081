"""PMap and PArray: every version keeps its own contents however the versions are edited and read."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.persistent import PArray, PMap


def test_branches_do_not_see_each_other():
    base = PMap({1: "a"})
    edit = base.edit()
    edit[2] = "b"
    edit.pop(1)
    left = edit.freeze()
    edit = base.edit()
    edit[3] = "c"
    right = edit.freeze()
    assert base.to_dict() == {1: "a"} and left.to_dict() == {2: "b"} and right.to_dict() == {1: "a", 3: "c"}
    assert 2 in left and 2 not in right and len(right) == 2


def test_random_version_tree_matches_plain_dicts():
    rng = random.Random(0)
    versions = [(PMap(), {})]
    for _ in range(1500):
        pmap, expected = rng.choice(versions) if rng.random() < 0.3 else versions[-1]
        edit, expected = pmap.edit(), dict(expected)
        for _ in range(rng.randint(0, 4)):
            key = rng.randint(0, 40)
            if key in expected and rng.random() < 0.4:
                edit.pop(key)
                del expected[key]
            elif expected and rng.random() < 0.2:  # a batch of present keys (evicted blocks)
                gone = rng.sample(sorted(expected), min(3, len(expected)))
                edit.remove_many(gone)
                for k in gone:
                    del expected[k]
            elif rng.random() < 0.3:  # a batch of absent keys: one undo entry for all of them
                fresh = {k: rng.random() for k in rng.sample(range(41), 3) if k not in expected}
                edit.insert_new(fresh)
                expected.update(fresh)
            else:
                expected[key] = edit[key] = rng.random()
        if rng.random() < 0.05:  # a transition that raised: its writes are undone
            edit.rollback()
            expected = pmap.to_dict()
        versions.append((edit.freeze(), expected))
        if rng.random() < 0.2:
            old, want = rng.choice(versions)
            assert old.to_dict() == want
    assert all(pmap.to_dict() == want for pmap, want in versions)


def test_data_reads_the_edited_version():
    base = PMap({1: "a", 2: "b"})
    edit = base.edit()
    edit.pop(1)
    edit[3] = "c"
    assert edit.data() == {2: "b", 3: "c"}
    edit.freeze()
    assert base.edit().data() == {1: "a", 2: "b"}


def test_parray_branches_do_not_see_each_other():
    base = PArray(np.arange(6, dtype=np.int32))
    edit = base.edit()
    edit[np.array([1, 4])] = 9
    assert edit.view.tolist() == [0, 9, 2, 3, 9, 5] and not edit.view.flags.writeable
    left = edit.freeze()
    edit = base.edit()
    edit[2:4] = edit[0:2] + 7
    right = edit.freeze()
    assert base.get().tolist() == [0, 1, 2, 3, 4, 5]
    assert left.get().tolist() == [0, 9, 2, 3, 9, 5]
    assert right.get().tolist() == [0, 1, 7, 8, 4, 5]
    assert base.edit().freeze() is base  # nothing written: the same version


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_parray_random_version_tree_matches_plain_copies(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    versions = [(PArray(np.zeros((4, 6), np.int64)), np.zeros((4, 6), np.int64))]
    for _ in range(data.draw(st.integers(1, 60))):
        parray, expected = versions[rng.integers(len(versions))]
        edit, expected = parray.edit(), expected.copy()
        for _ in range(rng.integers(0, 4)):
            value = int(rng.integers(1, 100))
            if rng.random() < 0.3:  # flat indices into the whole array, duplicates allowed
                flat = rng.integers(0, 24, (2, 2))
                edit.put(flat, value)
                expected.reshape(-1)[flat] = value
                continue
            if rng.random() < 0.5:  # basic slice of one row
                row, lo = int(rng.integers(4)), int(rng.integers(6))
                index = (row, slice(lo, lo + int(rng.integers(1, 4))))
            else:  # 2-D fancy index with broadcasting, duplicates allowed
                rows = rng.integers(0, 4, 3)
                index = (rows[:, None], rng.integers(0, 6, 2)[None, :])
            edit[index] = value
            expected[index] = value
        versions.append((edit.freeze(), expected))
        old, want = versions[rng.integers(len(versions))]
        np.testing.assert_array_equal(old.get(), want)
    for parray, want in versions:
        np.testing.assert_array_equal(parray.get(), want)
