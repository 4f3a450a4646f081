"""Admission's fair share: first come, first served, except that a group (the samples and prompts of one
client request) past max_num_seqs over the groups present waits behind other groups' requests, in the same
step, while rows and budget last. One client's n = max_num_seqs never shuts out the next client."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler.helpers import Driver, make_config, request


def grouped(rid: str, group: str | None, max_tokens: int = 4):
    return dataclasses.replace(request(rid, range(1, 9), max_tokens=max_tokens), group=group)


def admitted(plan) -> set[str]:
    return {rid for rid in plan.request_ids[:plan.num_rows]}


def test_a_late_client_gets_a_row_in_the_first_step_it_waits():
    driver = Driver(make_config(max_num_seqs=4))
    for i in range(6):  # one client's n = 6 on a batch of 4
        driver.add(grouped(f"a{i}", "a", max_tokens=20))
    driver.add(grouped("b0", "b"))
    first = admitted(driver.step())
    # two groups: a share of 2 each; a's third and fourth sequences come after b's, rows left over
    assert first == {"a0", "a1", "b0", "a2"}, first


def test_a_batch_held_by_one_client_is_shared_as_it_frees():
    driver = Driver(make_config(max_num_seqs=4))
    for i in range(4):
        driver.add(grouped(f"a{i}", "a", max_tokens=2 + i))
    for i in range(4, 8):
        driver.add(grouped(f"a{i}", "a", max_tokens=2))
    assert admitted(driver.step()) == {"a0", "a1", "a2", "a3"}
    driver.add(grouped("b0", "b"))
    plans = [admitted(driver.step()) for _ in range(3)]
    # a0 ends after its 2nd token and frees a row: b0 takes it ahead of a4..a7, which came first
    assert "b0" in plans[1] and not any(f"a{i}" in plans[1] for i in range(4, 8)), plans


def test_without_groups_admission_is_first_come_first_served():
    driver = Driver(make_config(max_num_seqs=4))
    for i in range(6):
        driver.add(grouped(f"r{i}", None))
    assert admitted(driver.step()) == {"r0", "r1", "r2", "r3"}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 6)), min_size=1, max_size=12),
       st.integers(2, 6))
def test_fair_share_keeps_rows_busy_and_everyone_finishes(arrivals, max_num_seqs):
    """Work-conserving (a step leaves no row idle while someone waits) and no one starves."""
    driver = Driver(make_config(max_num_seqs=max_num_seqs))
    for i, (group, max_tokens) in enumerate(arrivals):
        driver.add(grouped(f"{group}{i}", group, max_tokens))
    for _ in range(200):
        if not driver.state.has_work():
            break
        waiting_before = len(driver.state.waiting)
        running_before = len(driver.state.running)
        plan = driver.step()
        assert plan.num_rows >= min(max_num_seqs, waiting_before + running_before) or not waiting_before
    assert not driver.state.has_work(), "a request never finished"
