"""A step's (tokens, rows, logits) buckets: always one of the shapes the runner compiles, each big enough."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.buckets import bucket_shapes, step_buckets
from scheduler.config import default_buckets
from tests.scheduler.helpers import make_config


@st.composite
def configs_and_steps(draw):
    growth = draw(st.sampled_from([2, 4]))
    k = draw(st.integers(0, 3))
    max_tokens = draw(st.integers(8, 600))
    max_seqs = draw(st.integers(1, 40))
    cfg = make_config(num_spec_tokens=k, max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                      token_buckets=default_buckets(max_tokens, 2, growth),
                      row_buckets=default_buckets(max_seqs, draw(st.sampled_from([1, 8])), growth),
                      logits_buckets=default_buckets(max_tokens, 8, growth))
    num_tokens = draw(st.integers(0, max_tokens))
    num_rows = draw(st.integers(0, max_seqs))
    return cfg, num_tokens, num_rows, draw(st.integers(0, num_tokens))


@settings(max_examples=300, deadline=None)
@given(configs_and_steps())
def test_every_step_lands_on_a_compiled_shape_that_holds_it(case):
    cfg, num_tokens, num_rows, num_logits = case
    tokens, rows, logits = step_buckets(cfg, num_tokens, num_rows, num_logits)
    shapes = bucket_shapes(cfg)
    assert (tokens, rows, logits) in shapes and len(set(shapes)) == len(shapes)
    assert tokens >= max(num_tokens, min(num_rows, cfg.token_buckets[-1])) and rows >= num_rows
    assert logits >= num_logits


def test_decode_steps_take_the_rows_logits_and_tokens_hold_the_rows():
    cfg = make_config(max_num_batched_tokens=512, max_num_seqs=64, token_buckets=default_buckets(512, 2),
                      row_buckets=default_buckets(64, 8), logits_buckets=default_buckets(512, 8))
    assert step_buckets(cfg, 16, 16, 16) == (16, 16, 16)
    assert step_buckets(cfg, 16 + 128, 17, 17) == (256, 32, 32)  # a prompt's chunk: logits stay the rows'
    assert step_buckets(cfg, 200, 2, 150) == (256, 8, 256)  # prompt logprobs: the tokens' logits
    assert step_buckets(cfg, 2, 5, 0) == (8, 8, 8)  # five copies with two tokens: the tokens hold the rows
    # the rows a token bucket cannot hold, and logits between the two sizes, are never compiled
    assert not {(t, r, l) for t, r, l in bucket_shapes(cfg) if r > max(t, 8) or r < l < t}
