"""PMap: every version keeps its own contents however the versions are edited and read."""

from __future__ import annotations

import random

from scheduler.persistent import PMap


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
            key = rng.randint(0, 20)
            if key in expected and rng.random() < 0.4:
                edit.pop(key)
                del expected[key]
            else:
                expected[key] = edit[key] = rng.random()
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
