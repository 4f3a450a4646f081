"""The engine's side of structured outputs: each constrained sequence's grammar, moved on by the tokens it
emits, and the token masks of a step's constrained rows.

A step with a constrained row runs in two halves (`Runner.forward`, `Runner.finish`). One step ahead, the
device runs step N+1's layers while the host reads step N's tokens, moves the grammars on by them and fills
N+1's masks; only the sampling half waits for the masks. Everything here runs on the engine's thread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import llguidance
import numpy as np

import scheduler
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams
from jaxhybrid.structured_output import GrammarCompiler, MaskRow, SequenceGrammar, fill_token_masks
from jaxhybrid.structured_output.grammar import ReasoningEnd
from scheduler import BatchPlan, RowKind, StepResult

log = logging.getLogger("jaxhybrid")


class StructuredOutputs:
    """The grammars of the running constrained sequences, by sequence id."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int], num_spec_tokens: int,
                 reasoning_end: ReasoningEnd | None = None):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self.num_spec_tokens, self.reasoning_end = num_spec_tokens, reasoning_end
        self.grammars: dict[str, SequenceGrammar] = {}

    @functools.cached_property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: reading a large vocabulary into llguidance takes a moment."""
        if self._tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer; this engine has none")
        return GrammarCompiler(self._tokenizer.to_json(), self._vocab_size, self._eos)

    @functools.cached_property
    def _executor(self) -> llguidance.LLExecutor:
        """llguidance's mask threads, started on the first constrained step."""
        return llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher for `params` (GrammarError, a ValueError, naming the field). Thread-safe."""
        return self.compiler.compile(params)

    def add(self, sequence_ids: Sequence[str], matcher: llguidance.LLMatcher, prompt: Sequence[int],
            after_reasoning: bool = True) -> None:
        """Constrain each sequence by a copy of `matcher`. With a reasoning parser, the grammar starts once the
        reasoning ends: at once if the prompt already ends it (thinking switched off), or if `after_reasoning`
        is false (the request asked for no reasoning)."""
        reasoning = after_reasoning and self.reasoning_end is not None and not self.reasoning_end(prompt)
        for sequence_id in sequence_ids:  # a copy each: `matcher` may serve other prompts of a request too
            self.grammars[sequence_id] = SequenceGrammar(matcher.deep_copy(), reasoning)

    def drop(self, sequence_id: str) -> None:
        self.grammars.pop(sequence_id, None)

    def in_plan(self, plan: BatchPlan) -> bool:
        grammars = self.grammars
        return bool(grammars) and any(sequence_id in grammars for sequence_id in plan.request_ids)

    def advance(self, outputs: scheduler.StepOutputs) -> None:
        """Move each constrained sequence's grammar past the tokens it emitted; forget the ones that ended."""
        if not self.grammars:
            return
        for i, sequence_id in enumerate(outputs.request_ids):
            grammar = self.grammars.get(sequence_id)
            if grammar is None:
                continue
            if outputs.finish_codes[i]:
                del self.grammars[sequence_id]
            elif not grammar.accept(outputs.token_ids[i, :outputs.num_new_tokens[i]].tolist(), self.reasoning_end):
                log.warning("sequence %s left its grammar (%s); it runs unconstrained from here", sequence_id,
                            grammar.error)

    def token_masks(self, plan: BatchPlan, words: int, previous: StepResult | None) -> np.ndarray:
        """[L, words] int32 masks of `plan`'s logit entries: its constrained rows' grammars at the entries they
        sample, all ones elsewhere. `previous`: the tokens of the step before, which `plan`'s drafts may
        name by placeholder (one step ahead)."""
        k, rows = self.num_spec_tokens, []
        for r, sequence_id in enumerate(plan.request_ids):
            grammar = self.grammars.get(sequence_id)
            if grammar is None or not plan.num_logits[r]:
                continue
            verify = plan.row_kind[r] == RowKind.VERIFY
            drafts = real_tokens(plan.draft_token_ids[r], previous, k) if verify else ()
            rows.append(MaskRow(grammar, int(plan.cu_logits[r + 1]) - 1 - len(drafts), drafts))
        masks = np.full((plan.logits_bucket, words), -1, np.int32)
        fill_token_masks(self._executor, rows, masks, self.reasoning_end)
        return masks


def real_tokens(token_ids: np.ndarray, previous: StepResult | None, num_spec_tokens: int) -> list[int]:
    """`token_ids` with each placeholder P(r, j) = -(1 + r * (1+K) + j) replaced by row r's last emitted token
    (j = 0) or its draft j in `previous` (scheduler/resolve.py)."""
    real = []
    for token in token_ids.tolist():
        if token < 0:
            row, j = divmod(-1 - token, 1 + num_spec_tokens)
            token = (previous.sampled_token_ids[row, previous.num_accepted[row]] if j == 0
                     else previous.draft_token_ids[row, j - 1])
        real.append(int(token))
    return real
