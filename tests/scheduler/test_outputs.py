"""StepOutputs (batched update outputs), the token tails behind them (history.py) and TokenLog."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scheduler import FinishReason, SequenceOutput, SequenceSpec, StepOutputs, StopParams, schedule, update
from scheduler.journal import frozen
from scheduler.prefix_cache import ROOT_HASH, root_hash
from scheduler.state import TokenLog
from tests.scheduler.helpers import Driver, make_config, request, result_for


def test_update_reports_stop_reasons_through_step_outputs():
    driver = Driver(make_config(num_spec_tokens=2))
    driver.add(request("a", range(5, 25), max_tokens=3))
    driver.add(request("b", range(9, 40), max_tokens=30))
    driver.step()
    state, plan = schedule(driver.state)
    state, outputs = update(state, plan, result_for(plan, 2, accepted=2))
    assert isinstance(outputs, StepOutputs) and not outputs.token_ids.flags.writeable
    assert {out.request_id: out.finish_reason for out in outputs} == {"a": FinishReason.LENGTH, "b": None}
    assert outputs.finished_ids == ["a"] and "a" not in state.requests


def test_step_outputs_view_matches_arrays():
    outputs = StepOutputs(("x", "y"), np.array([[4, 5, 6], [7, 8, 9]], np.int32), np.array([2, 3], np.int32),
                          np.array([0, 1], np.int8))
    assert list(outputs) == [SequenceOutput("x", (4, 5), None), SequenceOutput("y", (7, 8, 9), FinishReason.STOP)]
    assert outputs.finished_ids == ["y"] and len(outputs) == 2 and outputs[1].finished


@pytest.mark.parametrize("block_size, k", [(2, 3), (4, 3), (16, 3), (16, 0)])
def test_token_history_and_hashes_survive_tails_of_any_block_size(block_size, k):
    cfg = make_config(block_size=block_size, mamba_block_size=4 * block_size, num_spec_tokens=k, num_blocks=4096)
    driver = Driver(cfg)
    prompts = {"a": list(range(3, 3 + 21)), "b": list(range(50, 50 + 3 * block_size))}
    for rid, prompt in prompts.items():
        driver.add(request(rid, prompt, max_tokens=60))
    emitted = {rid: [] for rid in prompts}
    for step in range(12):
        seen = len(driver.outputs)
        driver.step(accepted=step % (k + 1))
        for out in driver.outputs[seen:]:
            emitted[out.request_id] += out.new_token_ids
    for rid, prompt in prompts.items():
        tokens = driver.state.token_ids(rid)
        assert tokens == prompt + emitted[rid]
        log = driver.state.logs[rid]  # whole log blocks (plus the prompt), hashed per KV block
        assert log.length >= len(tokens) // cfg.log_unit * cfg.log_unit
        assert log.slice(0, log.length).tolist() == tokens[:log.length]
        # hashed: every full block of the log, and the committed full blocks of the tail published so far
        assert log.length // block_size <= len(log.hashes) <= len(tokens) // block_size
        assert log.hashes == blake2b_chain(ROOT_HASH, tokens[:len(log.hashes) * block_size], block_size)


def blake2b_chain(root: bytes, tokens: list[int], unit: int) -> list[bytes]:
    """The prefix keys, written out independently: BLAKE2b-256 of (parent key, the unit's int32 tokens)."""
    keys, parent = [], root
    for start in range(0, len(tokens) // unit * unit, unit):
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start:start + unit])
        parent = hashlib.blake2b(parent + data, digest_size=32).digest()
        keys.append(parent)
    return keys


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=9), min_size=1, max_size=6),
       st.integers(1, 4), st.data())
def test_token_log_slices_and_hashes_like_one_list_and_truncates_to_a_mark(chunks, hash_unit, data):
    log = TokenLog.create(chunks[0], hash_unit)
    cut = data.draw(st.integers(1, len(chunks)))
    for i, chunk in enumerate(chunks[1:], start=1):
        if i == cut:
            mark = log.mark()
        log.extend(frozen(np.array(chunk, np.int32)), hash_unit)
    tokens = [t for chunk in chunks for t in chunk]
    assert log.length == len(tokens)
    assert log.hashes == blake2b_chain(ROOT_HASH, tokens, hash_unit)
    start = data.draw(st.integers(0, len(tokens)))
    end = data.draw(st.integers(start, len(tokens)))
    assert log.slice(start, end).tolist() == tokens[start:end]
    if cut < len(chunks):  # a transition that raised undoes its appends
        log.truncate(mark)
        kept = [t for chunk in chunks[:cut] for t in chunk]
        assert log.slice(0, log.length).tolist() == kept and log.hashes == blake2b_chain(ROOT_HASH, kept, hash_unit)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=16, max_size=16), st.lists(st.integers(0, 2**20), min_size=16,
       max_size=16), st.lists(st.integers(-3, 3), min_size=16, max_size=16))
def test_block_keys_are_not_linear_in_the_tokens(a, b, delta):
    """A weighted-sum digest moves by the same amount whenever the same token change is
    applied to any block, which is what lets lattice reduction craft colliding blocks: keys must not."""
    shift = lambda tokens: [t + d for t, d in zip(tokens, delta, strict=True)]
    assume(a != b and any(delta) and min(shift(a) + shift(b)) >= 0)
    key = lambda tokens: int.from_bytes(TokenLog.create(tokens, 16).hashes[0][:8], "little")
    assert (key(shift(a)) - key(a)) % 2**64 != (key(shift(b)) - key(b)) % 2**64


def test_a_cache_salt_separates_the_prefix_keys_of_equal_prompts():
    tokens = list(range(32))
    plain, salted, other = (TokenLog.create(tokens, 16, root_hash(salt)).hashes for salt in (None, "a", "b"))
    assert plain == TokenLog.create(tokens, 16).hashes and len({*plain, *salted, *other}) == 6


@given(st.lists(st.integers(0, 127), min_size=16, max_size=16))
def test_no_cache_salt_spells_a_chain_key(unit):
    """A salt whose bytes spell a token unit T (each token as little-endian int32: ASCII tokens give valid
    UTF-8) must not name the unsalted key of T, or (salt, P) would hit (no salt, T + P) a block late."""
    salt = np.array(unit, "<i4").tobytes().decode()
    assert root_hash(salt) != TokenLog.create(unit, 16).hashes[0]
    assert not {*TokenLog.create(unit * 3, 16, root_hash(salt)).hashes} & {*TokenLog.create(unit * 4, 16).hashes}


def test_a_crafted_cache_salt_does_not_hit_another_tenants_prefix():
    unit = list(range(65, 81))
    salt = np.array(unit, "<i4").tobytes().decode()
    driver = Driver(make_config(max_num_batched_tokens=128))
    prompt = list(range(200, 260))
    driver.add(request("U", unit + prompt))
    driver.drain("the unsalted U caches its states")
    driver.add(SequenceSpec("S", tuple(prompt + [5, 6, 7]), StopParams(max_tokens=1), cache_salt=salt))
    plan = driver.step()
    assert plan.request_ids == ("S",) and plan.context_lens[0] == 0 and plan.num_hit_copies == 0
