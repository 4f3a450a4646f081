"""Sampling on device: per-row settings, penalties, top-k / top-p / min-p, seeded draws, logprobs, and the
lossless verification of speculative (MTP) drafts. Pure jittable functions over [N, V] logits.

Per-row settings travel through the scheduler as an opaque record (`Request.row_data`, `ROW_DTYPE`):
the runner views the plan's bytes as this dtype, so no Python loop over requests runs per step.

Randomness is a function of (request seed, position, draw), never of the batch: `row_keys` folds them
into a key per logit, so a seeded request samples the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The engine's per-row record, packed into `Request.row_data` (SchedulerConfig.row_data_bytes = itemsize).
ROW_DTYPE = np.dtype([
    ("temperature", "<f4"),         # 0: greedy
    ("top_p", "<f4"),               # 1: off
    ("top_k", "<i4"),               # <= 0: off
    ("min_p", "<f4"),               # 0: off
    ("repetition_penalty", "<f4"),  # 1: off (prompt and output tokens)
    ("presence_penalty", "<f4"),    # 0: off (output tokens)
    ("frequency_penalty", "<f4"),   # 0: off (output tokens)
    ("seed", "<u4"),                # the low 32 bits of the request's 64-bit seed
    ("seed_high", "<u4"),           # ... and the high 32 bits
    ("logprobs", "<i4"),            # logprobs reported: 0 none, 1 the tokens' own, n + 1 also the top n
    ("prompt_len", "<i4"),          # positions before it hold the prompt (penalties)
    ("min_tokens", "<i4"),          # CONSTRAINT_MIN_TOKENS entries are banned before this many outputs
])

# Constraints on a row's logits (logit_bias, allowed_token_ids, bad_words, min_tokens' bans) travel beside
# the plan as a padded list of entries per row, [R, E, 4] int32 of (kind, token, value, back), scattered
# onto the row's logits on device: the transfer grows with the entries, never with the vocabulary. E is
# the engine's one constraint width (`max_sampling_constraints`), so every step is compiled once, at start-up,
# and a request that needs more entries than E is refused instead of compiling a new step while serving. A
# step with no constrained row passes all padding, and the jitted sampler skips the entries at run time.
DEFAULT_CONSTRAINT_WIDTH = 1024


class Constraint(enum.IntEnum):
    NONE = 0       # padding
    BIAS = 1       # value (f32 bits) is added to the token's logit
    MIN_TOKENS = 2 # banned while the row has fewer than its min_tokens outputs (eos, stop_token_ids)
    ALLOWED = 3    # a row with any ALLOWED entry samples only those tokens
    BAD_WORD = 4   # banned when the `back` entries before it (its word's PREFIX) end the output
    PREFIX = 5     # a bad word's token `back` positions before the one its word bans


_DRAW_SAMPLE, _DRAW_ACCEPT, _DRAW_RESIDUAL = 0, 1, 2  # independent streams of one (seed, position)


class SamplingRows(NamedTuple):
    """The settings of N logits (rows of ROW_DTYPE, repeated per logit), as device arrays."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array
    seed_high: jax.Array
    logprobs: jax.Array
    prompt_len: jax.Array
    min_tokens: jax.Array

    @staticmethod
    def from_records(records: np.ndarray) -> SamplingRows:
        """[N] ROW_DTYPE (or [N, itemsize] uint8 bytes of them) -> device arrays."""
        records = np.ascontiguousarray(records).view(ROW_DTYPE).reshape(-1)
        return SamplingRows(*(jnp.asarray(records[name]) for name in ROW_DTYPE.names))

    @staticmethod
    def from_bytes(row_data: jax.Array) -> SamplingRows:
        """Inside jit: [R, itemsize] uint8 records (a plan's `row_data`) -> per-field arrays."""
        words = jax.lax.bitcast_convert_type(row_data.reshape(row_data.shape[0], -1, 4), jnp.uint32)
        return SamplingRows(*(jax.lax.bitcast_convert_type(words[:, i], jnp.dtype(ROW_DTYPE[name]).newbyteorder("="))
                              for i, name in enumerate(ROW_DTYPE.names)))


def pack_row(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             seed: int = 0, logprobs: int = 0, prompt_len: int = 0, min_tokens: int = 0) -> bytes:
    """One request's settings as `Request.row_data` bytes; `logprobs` as the record's field says."""
    record = np.array([(temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
                        seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, logprobs, prompt_len, min_tokens)],
                      ROW_DTYPE)
    return record.tobytes()


def constraint_entries(logit_bias: dict[int, float], allowed_token_ids: tuple[int, ...],
                       bad_words: list[tuple[int, ...]], min_tokens_bans: tuple[int, ...]) -> np.ndarray:
    """One request's constraint entries, [n, 4] int32 (see `Constraint`); bad_words as token ids. A token
    listed twice among the allowed ids or the bans takes one entry."""
    entries = [(Constraint.BIAS, token, bias, 0) for token, bias in logit_bias.items()]
    entries += [(Constraint.ALLOWED, token, 0.0, 0) for token in dict.fromkeys(allowed_token_ids)]
    entries += [(Constraint.MIN_TOKENS, token, 0.0, 0) for token in dict.fromkeys(min_tokens_bans)]
    for word in bad_words:
        entries += [(Constraint.PREFIX, token, 0.0, len(word) - 1 - i) for i, token in enumerate(word[:-1])]
        entries.append((Constraint.BAD_WORD, word[-1], 0.0, len(word) - 1))
    table = np.zeros((len(entries), 4), np.int32)
    for i, (kind, token, value, back) in enumerate(entries):
        table[i] = (kind, token, np.float32(value).view(np.int32), back)
    return table


def batch_constraints(per_row: list[np.ndarray | None], num_rows: int,
                      width: int = DEFAULT_CONSTRAINT_WIDTH) -> np.ndarray:
    """Rows' entries padded to [num_rows, width, 4]; a row with more than `width` entries is a ValueError."""
    longest = max((len(entries) for entries in per_row if entries is not None), default=0)
    if longest > width:
        raise ValueError(f"a row has {longest} constraint entries, more than the step's width {width}")
    batch = np.zeros((num_rows, width, 4), np.int32)
    for row, entries in enumerate(per_row):
        if entries is not None:
            batch[row, :len(entries)] = entries
    return batch


def apply_constraints(logits: jax.Array, entries: jax.Array, earlier: jax.Array, num_output: jax.Array,
                      min_tokens: jax.Array) -> jax.Array:
    """[N, V] logits with their rows' constraint entries [N, E, 4] applied. earlier: [N, E] the output token
    `back` positions before the one drawn (-1 where that is not an output token); num_output: [N] outputs
    before the one drawn. A bad word is banned when all of its PREFIX entries match."""
    kind, token, back = entries[..., 0], entries[..., 1], entries[..., 3]
    value = jax.lax.bitcast_convert_type(entries[..., 2], jnp.float32)
    failures = jnp.cumsum((kind == Constraint.PREFIX) & (earlier != token), axis=1)
    before = jnp.concatenate([jnp.zeros_like(failures[:, :1]), failures], axis=1)  # failures before entry e
    word_start = jnp.clip(jnp.arange(kind.shape[1]) - back, 0, kind.shape[1])
    word_matched = failures == jnp.take_along_axis(before, word_start, axis=1)
    banned = (((kind == Constraint.MIN_TOKENS) & (num_output < min_tokens)[:, None])
              | ((kind == Constraint.BAD_WORD) & word_matched))
    delta = jnp.where(kind == Constraint.BIAS, value, jnp.where(banned, -jnp.inf, 0.0))
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.astype(jnp.float32).at[rows, token].add(delta)
    allowed = jnp.zeros(logits.shape, bool).at[rows, token].max(kind == Constraint.ALLOWED)
    only_allowed = jnp.any(kind == Constraint.ALLOWED, axis=1)[:, None]
    return jnp.where(only_allowed & ~allowed, -jnp.inf, logits)


def row_keys(rows: SamplingRows, positions: jax.Array, draw: int) -> jax.Array:
    """One PRNG key per logit from (64-bit seed, position, draw): independent of the batch it runs in."""
    base = jax.vmap(lambda low, high: jax.random.fold_in(jax.random.key(low), high))(
        rows.seed.astype(jnp.uint32), rows.seed_high.astype(jnp.uint32))
    return jax.vmap(lambda key, position: jax.random.fold_in(jax.random.fold_in(key, position), draw))(
        base, positions.astype(jnp.uint32))


def has_penalties(rows: SamplingRows) -> jax.Array:
    """[N] bool: rows with a repetition, presence or frequency penalty."""
    return (rows.repetition_penalty != 1) | (rows.presence_penalty != 0) | (rows.frequency_penalty != 0)


def apply_penalties(logits: jax.Array, rows: SamplingRows, prompt_mask: jax.Array,
                    output_counts: jax.Array) -> jax.Array:
    """vLLM's penalties. prompt_mask: [N, V] bool, tokens of the prompt; output_counts: [N, V] i32 counts
    of generated tokens. Repetition divides positive logits (multiplies negative ones) of tokens seen in
    the prompt or the output; presence subtracts a constant, frequency a multiple of the count."""
    seen = prompt_mask | (output_counts > 0)
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty[:, None] * output_counts
    return logits - rows.presence_penalty[:, None] * (output_counts > 0)


def filtered_logits(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Temperature, then top-k, top-p and min-p masks (-inf), as vLLM orders them; greedy rows are
    left at temperature 1 (their draw is an argmax). The vocabulary is sorted only when a row filters."""
    temperature = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    logits = logits.astype(jnp.float32) / temperature
    filters = jnp.any((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0))
    return jax.lax.cond(filters, lambda: _apply_filters(logits, rows), lambda: logits)


def _apply_filters(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs_sorted = jax.nn.softmax(jnp.where(ordered < kth, -jnp.inf, ordered), axis=-1)
    # top-p: keep the smallest prefix of the sorted tokens whose mass reaches p (the first always stays); p = 1
    # keeps all, as in vLLM, though the mass before a last tiny-probability token can round to 1
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    cut = jnp.sum((before < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1), axis=-1)  # tokens kept, >= 1
    threshold = jnp.take_along_axis(ordered, (cut - 1)[:, None], axis=-1)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= rows.min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, rows: SamplingRows, positions: jax.Array) -> jax.Array:
    """[N, V] logits (penalties already applied) -> [N] i32 tokens: argmax where temperature is 0."""
    filtered = filtered_logits(logits, rows)
    drawn = jax.vmap(jax.random.categorical)(row_keys(rows, positions, _DRAW_SAMPLE), filtered)
    return jnp.where(rows.temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class Logprobs(NamedTuple):
    sampled: jax.Array       # [N] f32 logprob of each chosen token
    top_ids: jax.Array       # [N, n] i32 the n most likely tokens, most likely first
    top: jax.Array           # [N, n] f32 their logprobs
    sampled_rank: jax.Array  # [N] i32 the chosen token's rank in the whole vocabulary (ties share the last)


def logprobs(logits: jax.Array, tokens: jax.Array, num_top: int, with_top: jax.Array | bool = True) -> Logprobs:
    """Logprobs of the model's raw distribution (before penalties and temperature, as vLLM reports); the top
    `num_top` only where `with_top` (else zeros): a scorer's thousand prompt positions skip a top-k over the
    vocabulary that nobody reads."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    shape = (logp.shape[0], num_top)
    top, top_ids = jax.lax.cond(with_top, lambda: tuple(jax.lax.top_k(logp, num_top)),
                                lambda: (jnp.zeros(shape), jnp.zeros(shape, jnp.int32)))
    sampled = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logp >= sampled[:, None], axis=-1, dtype=jnp.int32)  # vLLM's: tokens at least as likely
    return Logprobs(sampled, top_ids.astype(jnp.int32), top, rank)


class Verified(NamedTuple):
    num_accepted: jax.Array  # [R] i32 accepted drafts, 0..K (the bonus token not counted)
    tokens: jax.Array        # [R, 1+K] i32: accepted drafts, then the bonus/correction token; rest unused


def verify_greedy(target_logits: jax.Array, drafts: jax.Array) -> Verified:
    """Accept drafts while they equal the target's argmax; the token after them is the argmax there.
    target_logits: [R, 1+K, V] at the verify row's 1 + K positions; drafts: [R, K]."""
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [R, 1+K]
    return _accept(best[:, :-1] == drafts, drafts, best)


def verify_random(target_logits: jax.Array, draft_probs: jax.Array, drafts: jax.Array, rows: SamplingRows,
                  positions: jax.Array) -> Verified:
    """Speculative sampling (Leviathan et al. 2023): accept draft i with probability min(1, p_i(d)/q_i(d));
    at the first rejection draw from normalize(max(0, p_i - q_i)); after K acceptances draw the bonus
    from p_K. The emitted tokens are distributed exactly as sampling from p (lossless).

    target_logits: [R, 1+K, V] (penalties applied); draft_probs: [R, K, V] the drafter's q (one-hot for a
    greedy drafter); drafts: [R, K]; rows: settings per row; positions: [R] position of the first logit."""
    num_rows, width, vocab = target_logits.shape
    flat = lambda x: x.reshape(num_rows * width, *x.shape[2:])
    per_logit = SamplingRows(*(jnp.repeat(field, width) for field in rows))
    logit_positions = (positions[:, None] + jnp.arange(width)).reshape(-1)
    p = jax.nn.softmax(filtered_logits(flat(target_logits), per_logit), axis=-1).reshape(num_rows, width, vocab)
    q = draft_probs
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.random.uniform)(row_keys(per_logit, logit_positions, _DRAW_ACCEPT)).reshape(num_rows, width)
    accept = u[:, :-1] * q_draft < p_draft  # u < p/q without dividing by a zero q
    residual = jnp.maximum(p[:, :-1] - q, 0.0)
    residual = jnp.concatenate([residual, p[:, -1:]], axis=1)  # after K acceptances: the bonus from p_K
    keys = row_keys(per_logit, logit_positions, _DRAW_RESIDUAL)
    choices = jax.vmap(jax.random.categorical)(keys, jnp.log(flat(residual))).reshape(num_rows, width)
    verified = _accept(accept, drafts, choices.astype(jnp.int32))
    greedy = verify_greedy(target_logits, drafts)
    use_greedy = (rows.temperature <= 0)[:, None]
    return Verified(jnp.where(use_greedy[:, 0], greedy.num_accepted, verified.num_accepted),
                    jnp.where(use_greedy, greedy.tokens, verified.tokens))


def _accept(accepted: jax.Array, drafts: jax.Array, fallback: jax.Array) -> Verified:
    """Keep the leading accepted drafts; the next slot takes `fallback` there ([R, 1+K])."""
    num = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    index = jnp.arange(fallback.shape[1])[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    bonus = jnp.take_along_axis(fallback, num[:, None], axis=-1)
    return Verified(num, jnp.where(index < num[:, None], padded, jnp.where(index == num[:, None], bonus, 0)))
