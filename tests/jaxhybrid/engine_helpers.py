"""Engines on the fixture models with small pools and ladders, driven for a bounded number of steps,
and the independent reference they are checked against: greedy continuations of the full forward."""

from __future__ import annotations

import functools

import numpy as np

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.model import Model
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR, load_model
from jaxhybrid.sample.sampler import ROW_DTYPE
from scheduler import SchedulerConfig
from scheduler.sim.invariants import check_drained

# a code prompt and four continuations of it, as the default model was trained on (LLM and async engine tests)
ANCHOR = "import os\nimport sys\n\n\ndef read_config(path):\n    \"\"\"Read a config file.\"\"\"\n"
CANDIDATES = ["    with open(path) as f:\n        return f.read()\n", "    return {}\n",
              "    raise NotImplementedError(path)\n", "    print(path)\n    return None\n"]


@functools.cache
def default_model() -> Model:
    """The embedded default model, loaded once per process."""
    return load_model()


@functools.cache
def default_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def engine_for(model: Model, *, k: int = 0, ring_size: int = 16, cache_mode: str = "align", budget: int = 64,
               num_blocks: int = 160, num_state_slots: int = 40, max_num_seqs: int = 8, max_model_len: int = 192,
               token_buckets: tuple[int, ...] | None = None, logits_buckets: tuple[int, ...] | None = None,
               tokenizer=None, seed: int = 0, async_scheduling: bool = True, max_logprobs: int = 20) -> Engine:
    """An engine with blocks of 16, Mamba blocks of 16 and one bucket of each kind unless given: one
    compilation."""
    config = SchedulerConfig(
        block_size=16, mamba_block_size=16, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, num_blocks=num_blocks, num_state_slots=num_state_slots, num_spec_tokens=k,
        ring_size=ring_size, cache_mode=cache_mode, vocab_size=model.config.vocab_size,
        row_data_bytes=ROW_DTYPE.itemsize, token_buckets=token_buckets or (budget,), row_buckets=(max_num_seqs,),
        logits_buckets=logits_buckets or (budget,), block_table_buckets=(-(-(max_model_len + k) // 16),))
    return Engine(model, config, tokenizer, seed=seed, async_scheduling=async_scheduling, max_logprobs=max_logprobs)


def run_to_completion(engine: Engine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step until every request has finished (at most `max_steps`); then the pools must be drained."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            problems = check_drained(engine.scheduler)
            assert not problems, problems
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"requests still running after {max_steps} steps: {sorted(engine.table.requests)}")


@functools.cache
def _continuation(model: Model, prompt: tuple[int, ...], num_tokens: int) -> tuple[int, ...]:
    sequence = list(prompt)
    for _ in range(num_tokens):
        # right padding to a multiple of 64 cannot reach earlier positions (causal), and keeps the compiled
        # forward shapes few
        padded = np.zeros((1, -(-len(sequence) // 64) * 64), np.int32)
        padded[0, :len(sequence)] = sequence
        sequence.append(int(np.argmax(np.asarray(model(padded))[0, len(sequence) - 1])))
    return tuple(sequence[len(prompt):])


def greedy_continuation(model: Model, prompt: Prompt | tuple[int, ...], num_tokens: int) -> list[int]:
    """The argmax continuation of `load_model`'s full forward, one token at a time."""
    token_ids = prompt.token_ids if isinstance(prompt, Prompt) else tuple(prompt)
    return list(_continuation(model, token_ids, num_tokens))
