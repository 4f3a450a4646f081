"""Align split, the lookahead livelock cases and the 216-case grid
(docs/scheduler.md#align-mode-and-the-mtp-lookahead)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.split import SplitInput, min_budget, split_chunk
from tests.scheduler.helpers import Driver, make_config, request, trace_ends

CAP = 1 << 20  # a step budget cap far above every block: aligned chunks are always fundable


def _split(start, budget, n_end, bs, lookahead=0, drop=False, checkpoint=None, cap=CAP) -> int:
    return split_chunk(SplitInput(start, budget, n_end, bs, cap, lookahead, drop, checkpoint))


def _ends(prompt, budgets, bs, start=0, lookahead=0, drop=False, cap=CAP, max_steps=200) -> list[int]:
    """Chunk ends (0-token steps recorded as None) with per-step budgets cycling through `budgets`."""
    ends, pos = [], start
    for budget in itertools.islice(itertools.cycle(budgets), max_steps):
        n = _split(pos, budget, prompt, bs, lookahead, drop, cap=cap)
        ends.append(pos + n if n else None)
        pos += n
        if pos == prompt:
            return ends
    raise AssertionError(f"no completion: {ends[:20]}")


def _assert_aligned(ends, prompt, bs, start=0):
    real = [e for e in ends if e is not None]
    assert real[-1] == prompt
    prev = start
    for end in real[:-1]:
        if prev % bs:
            assert end <= prev - prev % bs + bs, f"mid-block start {prev} crossed the next boundary to {end}"
        assert end % bs == 0 or prev % bs, f"non-final end {end} is not aligned"
        prev = end


# A: align split ------------------------------------------------------------------------------------

def test_a1_fragmented_first_chunk_is_deferred_not_poisoned():
    assert _ends(2002, [364, 2002], 1600, drop=True) == [None, 2002]


def test_a2_budget_inside_a_block_defers_then_finishes():
    assert _ends(3602, [1600, 1000, 3602], 1600, drop=True) == [1600, None, 3602]


@pytest.mark.parametrize("first", [800, 900, 1599, 1601, 2000])
@pytest.mark.parametrize("drop", [False, True])
def test_a3_non_final_ends_are_block_multiples(first, drop):
    _assert_aligned(_ends(3602, [first, 3602, 3602], 1600, drop=drop), 3602, 1600)


@pytest.mark.parametrize("bs, prompt, budgets", [(1536, 30000, [27648, 1024, 30000]),
                                                 (12288, 30000, [12288, 4000, 30000]),
                                                 (12288, 41000, [24576, 8000, 41000])])
def test_a4_block_size_independence(bs, prompt, budgets):
    _assert_aligned(_ends(prompt, budgets, bs, drop=True), prompt, bs)


@pytest.mark.parametrize("resume", [331, 1599, 1601, 2531, 3011])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("budgets", [[3602], [700, 1613, 3602]])
def test_a5_unaligned_resume_progresses_and_realigns(resume, drop, budgets):
    ends = _ends(3602, budgets, 1600, start=resume, drop=drop)
    _assert_aligned(ends, 3602, 1600, start=resume)


@pytest.mark.parametrize("external", [1, 368, 1599, 1617])
@pytest.mark.parametrize("drop", [False, True])
def test_a6_unaligned_external_tokens_complete(external, drop):
    prompt = 5 * 1600 + 7
    ends = _ends(prompt, [364, 700, 1613, prompt], 1600, start=external, drop=drop)
    _assert_aligned(ends, prompt, 1600, external)


@pytest.mark.parametrize("drop, first_end", [(True, 1600), (False, 3200)])
def test_a7_eagle_block_drop_moves_the_last_boundary(drop, first_end):
    assert _ends(3602, [3602], 1600, drop=drop)[0] == first_end


@pytest.mark.parametrize("prompt, drop", [(2002, False), (3602, True)])
def test_a8_ten_identical_prompts_hit_without_i1_violations(prompt, drop):
    cfg = make_config(mamba_block_size=1600, max_num_batched_tokens=16384, max_num_seqs=16, num_spec_tokens=3,
                      num_blocks=4096, num_state_slots=40, eagle_block_drop=drop)
    driver = Driver(cfg)
    tokens = [5 + (j % 11) for j in range(prompt)]
    for i in range(10):
        driver.add(request(f"r{i}", tokens, max_tokens=4))
    for i in range(4):
        driver.add(request(f"late{i}", tokens, max_tokens=4))
        driver.step(accepted=2)
    driver.drain("10 equal prompts + 4 late ones, 2 then 1 drafts accepted", accepted=1)
    assert driver.device.hits_checked >= 1  # the late requests hit the published state, checked against I1


def test_producer_truncation_is_a_mandatory_stop():
    assert _split(0, 100, 100, 16, checkpoint=48) == 48
    assert _split(48, 100, 100, 16) == 48  # an unmarked request stops at the last boundary, 96
    marked = SplitInput(48, 100, 100, 16, CAP, checkpoint=48, marked=True)
    assert split_chunk(marked) == 52  # a marked one caches only its checkpoint: no boundary stops


@st.composite
def split_inputs(draw) -> SplitInput:
    """Any chunk decision the scheduler can ask for: a prefill not yet done, any block size, cap, lookahead,
    block drop, producer checkpoint, marker, cache mode."""
    bs, prefill_end = draw(st.sampled_from([1, 2, 4, 8, 16, 64])), draw(st.integers(1, 200))
    start = draw(st.integers(0, prefill_end - 1))
    checkpoint = draw(st.none() | st.integers(start + 1, prefill_end))
    align = draw(st.booleans())
    return SplitInput(start, 0, prefill_end, bs, draw(st.integers(1, 80)), draw(st.integers(0, 5)), draw(st.booleans()),
                      checkpoint, align, align and draw(st.booleans()))


@given(split_inputs(), st.data())
def test_min_budget_is_exactly_the_least_budget_that_schedules_a_token(s, data):
    """The lemma behind the progress bound (schedule.py): a running prefill given min_budget tokens, at most
    a whole step's cap, is scheduled something; with any less, nothing."""
    need = min_budget(s)
    assert 0 < need <= s.max_chunk
    budget = data.draw(st.integers(0, s.max_chunk))
    assert (split_chunk(s._replace(budget=budget)) > 0) == (budget >= need)


# B: the lookahead livelock ------------------------------------------------------------------------

def _pre_fix_ends(prompt, budget, bs, lookahead, drop, max_steps=8) -> list[int]:
    """vLLM's split without the window rules, then its separate lookahead reservation."""
    ends, pos = [], 0
    for _ in range(max_steps):
        n = _split(pos, budget, prompt, bs, 0, drop)
        remaining = prompt - pos - n
        if 0 < remaining < lookahead:
            n = max(n - (lookahead - remaining), 0)
        ends.append(pos + n)
        pos += n
        if pos == prompt:
            break
    return ends


LIVELOCK_TABLE = [  # (N, L, budget, drop, pre-fix ends, post-fix ends)
    (49, 3, 512, False, [46, 46, 46], [49]),
    (49, 3, 16, True, [16, 32, 46, 46, 46], [16, 32, 48, 49]),
    (50, 3, 16, True, [16, 32, 47, 47, 47], [16, 32, 48, 50]),
    (33, 2, 16, True, [16, 31, 31, 31], [16, 32, 33]),
    (49, 5, 48, False, [44, 44, 44], [32, 49]),
]


@pytest.mark.parametrize("n_end, lookahead, budget, drop, pre, post", LIVELOCK_TABLE)
def test_b_livelock_table_pre_fix_stalls(n_end, lookahead, budget, drop, pre, post):
    ends = _pre_fix_ends(n_end, budget, 16, lookahead, drop, max_steps=len(pre))
    assert ends == pre  # the end stops moving: 0 tokens forever


@pytest.mark.parametrize("n_end, lookahead, budget, drop, pre, post", LIVELOCK_TABLE)
def test_b_livelock_table_post_fix_split(n_end, lookahead, budget, drop, pre, post):
    assert [e for e in _ends(n_end, [budget], 16, lookahead=lookahead, drop=drop)] == post


@pytest.mark.parametrize("n_end, lookahead, budget, drop, pre, post", LIVELOCK_TABLE)
def test_b_livelock_table_real_scheduler(n_end, lookahead, budget, drop, pre, post):
    cfg = make_config(max_num_batched_tokens=budget, num_spec_tokens=lookahead, eagle_block_drop=drop)
    assert trace_ends(cfg, n_end) == post


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("prompt, budget", [(49, 16), (49, 512), (50, 16), (33, 16), (3602, 1000), (97, 32)])
@pytest.mark.parametrize("drop", [False, True])
def test_b_window_rules_are_a_noop_without_multi_module_mtp(lookahead, prompt, budget, drop):
    assert _ends(prompt, [budget], 16, lookahead=lookahead, drop=drop) == \
        _ends(prompt, [budget], 16, lookahead=0, drop=drop)


# The 216-case grid ----------------------------------------------------------------------------------

GRID = list(itertools.product([64, 1600], [2, 3, 5], ["inside", "edge", "past"], [1, 2],
                              [4.0, 1.0, 0.5], [True, False]))


def test_grid_has_216_cases():
    assert len(GRID) == 216


@pytest.mark.parametrize("bs, lookahead, tail, full_blocks, budget_blocks, drop", GRID)
def test_grid_multi_module_mtp_prefill_lookahead(bs, lookahead, tail, full_blocks, budget_blocks, drop):
    prompt = full_blocks * bs + {"inside": lookahead - 1, "edge": lookahead, "past": lookahead + 1}[tail]
    budget = int(budget_blocks * bs)
    cfg = make_config(mamba_block_size=bs, max_num_batched_tokens=budget, num_spec_tokens=lookahead,
                      eagle_block_drop=drop, max_num_seqs=2, num_blocks=4 * prompt // 16 + 8)
    ends = trace_ends(cfg, prompt)  # completes; the fake device checks every state read (I1)
    starts = [0] + ends[:-1]
    for start, end in zip(starts[:-1], ends[:-1], strict=True):
        assert end % bs == 0 or budget < bs, f"non-final end {end} unaligned with budget {budget}"
        if prompt - lookahead < end < prompt:
            assert end % bs == 0 or budget < bs, f"end {end} inside the window off a boundary"
            assert min(budget, prompt - start) < prompt - start or start % bs, "could have finished"
