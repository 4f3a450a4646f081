"""What the side-by-side benchmarks share: random token-id work, and jaxhybrid's side of it.

Scoring is `LLM.score_candidates`: a checkpoint before the anchor's last token (block-aligned), so the anchor is
computed once and each candidate from the checkpoint on; the anchor's last logit scores each candidate's first token.
Generation is greedy with eos ignored, so both sides produce exactly `new_tokens` per prompt.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams

ANCHOR, CANDIDATE_LEN, PROMPT_LEN, NEW_TOKENS, BLOCK = 512, 64, 128, 64, 16


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    """Ids past the tokenizer's special ones (0-3: eos, the chat markers and the checkpoint marker, which an engine
    that loads the tokenizer would read as a checkpoint)."""
    return rng.integers(4, vocab, n).tolist()


# the `json` job's schema: an array of car descriptions without bound, so with eos ignored every one of a row's
# tokens is made under a live JSON constraint (strings, an enum, separators)
CAR = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                        "model": {"type": "string", "maxLength": 12},
                                        "car_type": {"type": "string", "enum": ["sedan", "SUV", "Truck", "Coupe"]}},
       "required": ["brand", "model", "car_type"], "additionalProperties": False}
JSON_SCHEMA = {"type": "array", "items": CAR}


def engine(directory: Path, dtype: str = "auto", max_num_seqs: int = 64, tokenizer: bool = False,
           scan_layers: bool = True) -> LLM:
    """An LLM sized for these jobs, every bucket compiled before anything is timed; `tokenizer` for the `json`
    job (a grammar is compiled over the checkpoint's tokenizer); `scan_layers` as `EngineArgs.scan_layers`."""
    # buckets of 2 for decoding one sequence: XLA:CPU turns a one-row bf16 matmul into a convert of the whole
    # weight to f32 (2.3x slower), and a wider bucket computes padding
    llm = LLM(directory, dtype=dtype, skip_tokenizer_init=not tokenizer, num_blocks=4096, num_state_slots=160,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, max_model_len=ANCHOR + CANDIDATE_LEN + 16,
              mamba_block_size=BLOCK, token_buckets=(2, 16, 64, 128, 512, 1024),
              row_buckets=tuple(r for r in (2, 16, 64) if r <= max_num_seqs), scan_layers=scan_layers)
    llm.engine.precompile(progress=False)
    return llm


def score(llm: LLM, anchor: list[int], candidates: list[list[int]]) -> tuple[float, list[list[float]]]:
    """Seconds, and each candidate's prompt logprobs after the anchor (`LLM.score_candidates`: the anchor once)."""
    start = time.perf_counter()
    scores = llm.score_candidates(anchor, candidates)
    return time.perf_counter() - start, [c.token_logprobs for c in scores.candidates]


def generate(llm: LLM, prompts: list[list[int]], new_tokens: int, schema: dict | None = None
             ) -> tuple[float, list[list[int]]]:
    """Seconds, and each prompt's greedy tokens (under `schema`, JSON without whitespace, if given)."""
    structured = None if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=structured)
    start = time.perf_counter()
    generated = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in generated]


def agreeing_prefix(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The mean fraction of each sequence before the first differing token."""
    a, b = np.array(ours), np.array(theirs)
    return float(np.cumprod(a == b, axis=1).mean())
