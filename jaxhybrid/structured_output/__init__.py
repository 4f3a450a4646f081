"""Structured outputs through llguidance: grammars compiled from `StructuredOutputsParams`, one matcher per
sequence, and the token masks of a step's constrained rows, filled on the host (`docs/engine.md`)."""

from jaxhybrid.structured_output.grammar import GrammarCompiler, GrammarError, SequenceGrammar
from jaxhybrid.structured_output.masks import MaskRow, fill_token_masks

__all__ = ["GrammarCompiler", "GrammarError", "MaskRow", "SequenceGrammar", "fill_token_masks"]
