"""A step's token masks: one bit per vocabulary entry (bit t % 32 of word t // 32, llguidance's layout) at
each logit entry a constrained row samples from; every other entry allows everything.

A verify row samples 1 + K entries: entry j draws the token after the first j drafts, so its mask is the
grammar's after them. llguidance fills those in one call (validating the drafts and rolling back), so the
matcher itself only ever moves past emitted tokens. Past a draft the grammar refuses, the masks allow
everything: the sampler never accepts that draft, so no later entry of the row is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import llguidance
import llguidance.numpy
import numpy as np

from jaxhybrid.structured_output.grammar import ReasoningEnd, SequenceGrammar


class MaskRow(NamedTuple):
    grammar: SequenceGrammar
    entry: int  # the logit entry of the row's first sampled token
    drafts: Sequence[int]  # the drafts the row verifies (none for decode and prefill rows)


def fill_token_masks(executor: llguidance.LLExecutor, rows: Sequence[MaskRow], masks: np.ndarray,
                     reasoning_end: ReasoningEnd | None) -> None:
    """Fill `masks` ([L, words] int32, all ones on entry) at `rows`' entries, on llguidance's threads. A row
    still reasoning is free up to the draft that ends its reasoning, and constrained after it."""
    plain, with_drafts = [], []  # llguidance takes rows without drafts in a call of their own
    for row in rows:
        matcher, start = row.grammar.matcher, 0
        if row.grammar.in_reasoning:
            start = next((j + 1 for j, token in enumerate(row.drafts) if reasoning_end([token])), None)
        if start is None or matcher.is_error():  # a broken matcher constrains nothing (the engine logs it)
            continue
        drafts = list(row.drafts[start:])
        if drafts:
            with_drafts.append((matcher, row.entry + start, drafts))
        else:
            plain.append((matcher, row.entry + start))
    if plain:
        llguidance.numpy.fill_next_token_bitmask_par(executor, plain, masks)
    if with_drafts:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, with_drafts, masks)
