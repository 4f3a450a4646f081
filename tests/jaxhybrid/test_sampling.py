"""Device sampling: masks and penalties against NumPy, batch-independent seeds, logprobs, and lossless
verification of speculative drafts (chi-square against the target distribution)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import (
    ROW_DTYPE,
    SamplingRows,
    apply_penalties,
    filtered_logits,
    logprobs,
    pack_row,
    sample,
    verify_greedy,
    verify_random,
)

V = 12


def _rows(n: int, **settings) -> SamplingRows:
    return SamplingRows.from_records(np.frombuffer(pack_row(**settings) * n, np.uint8).reshape(n, -1))


def _numpy_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept tokens, written out the plain way: sort, cut at k, keep the prefix reaching p, then min-p."""
    x = logits / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    mass = 0.0
    kept_p = np.zeros(len(x), bool)
    for i in order:
        if not keep[i] or (top_p < 1 and mass >= top_p):  # p = 1 keeps all, whatever the rounding
            continue
        kept_p[i], mass = True, mass + probs[i]
    probs = np.where(kept_p, probs, 0.0)
    return kept_p & (probs >= min_p * probs.max())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]), top_k=st.integers(0, V),
       top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_top_k_top_p_min_p_keep_what_numpy_keeps(seed, temperature, top_k, top_p, min_p):
    logits = np.random.default_rng(seed).normal(0, 2, (1, V)).astype(np.float32)
    rows = _rows(1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), rows)))[0]
    np.testing.assert_array_equal(kept, _numpy_filter(logits[0], temperature, top_k, top_p, min_p))


def test_top_p_of_one_keeps_a_token_whose_mass_rounds_away():
    """Sorted probabilities sum to 1 in f32 before the last, tiny one: top-p 1 must still keep it."""
    logits = np.array([[30.0, 29.0] + [0.0] * (V - 2)], np.float32)
    rows = _rows(1, temperature=1.0, top_k=V, top_p=1.0)
    assert np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), rows))).all()


def test_penalties_match_the_vllm_rules():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (2, V)).astype(np.float32)
    prompt = rng.random((2, V)) < 0.3
    counts = rng.integers(0, 3, (2, V)).astype(np.int32)
    rows = _rows(2, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    got = np.asarray(apply_penalties(jnp.asarray(logits), rows, jnp.asarray(prompt), jnp.asarray(counts)))
    seen = prompt | (counts > 0)
    want = np.where(seen, np.where(logits > 0, logits / 1.3, logits * 1.3), logits) - 0.25 * counts - 0.5 * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(want).max())


def test_greedy_is_argmax_and_seeded_draws_do_not_depend_on_the_batch():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 1, (5, V)).astype(np.float32))
    positions = jnp.arange(5, dtype=jnp.int32) + 40
    greedy = sample(logits, _rows(5), positions)
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), axis=-1))
    records = np.frombuffer(b"".join(pack_row(temperature=1.0, seed=s) for s in (7, 8, 9, 10, 11)), np.uint8)
    rows = SamplingRows.from_records(records.reshape(5, -1))
    together = np.asarray(sample(logits, rows, positions))
    alone = [int(sample(logits[i : i + 1], SamplingRows(*(f[i : i + 1] for f in rows)), positions[i : i + 1])[0])
             for i in range(5)]
    assert together.tolist() == alone
    shifted = np.asarray(sample(logits, rows, positions + 1))  # another position draws anew
    assert together.tolist() != shifted.tolist() or np.unique(together).size == 1


def test_seeded_sampling_follows_the_filtered_distribution():
    logits = jnp.asarray(np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], np.float32)))
    n = 20_000
    rows = _rows(n, temperature=1.0, top_k=3, seed=123)
    tokens = np.asarray(sample(jnp.repeat(logits, n, axis=0), rows, jnp.arange(n, dtype=jnp.int32)))
    expected = np.array([0.5, 0.3, 0.15]) / 0.95
    assert _chi_square(np.bincount(tokens, minlength=V)[:3], expected) < CHI2_DF2


def test_logprobs_are_the_raw_distribution_and_its_top_n():
    logits = jnp.asarray(np.random.default_rng(2).normal(0, 1, (3, V)).astype(np.float32))
    tokens = jnp.asarray([0, 5, 11], jnp.int32)
    out = logprobs(logits, tokens, num_top=4)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(out.sampled, ref[np.arange(3), [0, 5, 11]], rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-ref, axis=-1)[:, :4])
    assert (np.diff(np.asarray(out.top), axis=-1) <= 0).all()
    without_top = logprobs(logits, tokens, num_top=4, with_top=False)  # no row asked for the top n
    np.testing.assert_array_equal(without_top.sampled, out.sampled)
    np.testing.assert_array_equal(without_top.sampled_rank, out.sampled_rank)
    assert not np.asarray(without_top.top).any() and not np.asarray(without_top.top_ids).any()


def test_the_row_record_says_how_many_logprobs_a_request_reports():
    asked = lambda **kw: int(SamplingRows.from_records(np.frombuffer(SamplingParams(**kw).row_data(0, 0), np.uint8)
                                                       .reshape(1, -1)).logprobs[0])
    assert asked() == 0
    assert asked(prompt_logprobs=0) == 1 and asked(logprobs=0) == 1  # the tokens' own logprobs only
    assert asked(logprobs=3, prompt_logprobs=1) == 4
    assert asked(prompt_logprobs=-1) > 1  # the whole vocabulary


def test_greedy_verification_accepts_the_agreeing_prefix_then_the_argmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (4, 4, V)).astype(np.float32)  # R = 4 rows, K = 3
    best = logits.argmax(-1)
    drafts = best[:, :3].copy()
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # row 1: first draft wrong
    drafts[2, 2] = (drafts[2, 2] + 1) % V  # row 2: third draft wrong
    out = verify_greedy(jnp.asarray(logits), jnp.asarray(drafts))
    assert np.asarray(out.num_accepted).tolist() == [3, 0, 2, 3]
    for r, n in enumerate([3, 0, 2, 3]):
        assert np.asarray(out.tokens)[r, : n + 1].tolist() == best[r, : n + 1].tolist()


# chi-square critical values at p = 0.001
CHI2_DF2, CHI2_DF5 = 13.82, 20.52


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_random_verification_is_lossless():
    """Drafts from q, verified against p: every emitted position follows p exactly (a per-position target,
    so positions are independent), whatever q proposes, one-hot (greedy drafter) or spread out."""
    vocab, k, n = 6, 2, 30_000
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(vocab), size=k + 1)  # the target at each of the 1 + K positions
    for q in (rng.dirichlet(np.ones(vocab) * 0.5, size=k), np.eye(vocab)[[2, 4]]):
        drafts = np.stack([rng.choice(vocab, n, p=q[i]) for i in range(k)], axis=1).astype(np.int32)
        target = jnp.asarray(np.broadcast_to(np.log(p), (n, k + 1, vocab)))
        draft_probs = jnp.asarray(np.broadcast_to(q, (n, k, vocab)).astype(np.float32))
        records = np.zeros(n, ROW_DTYPE)
        records["temperature"], records["top_p"], records["repetition_penalty"] = 1.0, 1.0, 1.0
        records["seed"] = np.arange(n)
        out = verify_random(target, draft_probs, jnp.asarray(drafts), SamplingRows.from_records(records),
                            jnp.zeros(n, jnp.int32))
        tokens, accepted = np.asarray(out.tokens), np.asarray(out.num_accepted)
        assert _chi_square(np.bincount(tokens[:, 0], minlength=vocab), p[0]) < CHI2_DF5
        second = tokens[accepted >= 1, 1]
        assert second.size > 1000 and _chi_square(np.bincount(second, minlength=vocab), p[1]) < CHI2_DF5
