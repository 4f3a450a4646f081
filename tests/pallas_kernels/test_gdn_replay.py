"""GDN ReplaySSM verify/decode and materialize against plain recurrent decoding."""

import replay_sim
from gdn_replay_op import GdnReplay
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=6, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_matches_recurrent_decoding(max_drafts, seed, data):
    replay_sim.check_verify_matches_recurrent_decoding(GdnReplay(), max_drafts, seed, data)


@settings(max_examples=6, deadline=None)
@given(window=st.integers(1, 4), max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_the_engines_static_bounds_change_nothing(window, max_drafts, seed, data):
    replay_sim.check_the_engines_static_bounds_change_nothing(GdnReplay, window, max_drafts, seed, data)


def test_ring_wraps_and_rejected_entries_do_not_matter():
    replay_sim.check_ring_wraps_and_rejected_entries_do_not_matter(GdnReplay())


def test_width_one_is_bit_identical_to_plain_decoding():
    replay_sim.check_width_one_is_bit_identical_to_plain_decoding(GdnReplay(backend=None))
