"""SchedulerConfig: every budget, size and switch the scheduler reads, frozen and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

CACHE_MODES = ("none", "align")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Static scheduler configuration.

    The KV block size is also the prefix-hash unit (`h` in the reference): block hashes, checkpoint
    positions and partial prefix entries all live on that grid. The Mamba block size (`bs`) is the
    coarser grid on which recurrent states are cached in align mode.

    Fields:
        block_size: tokens per KV block and per prefix-hash unit.
        mamba_block_size: tokens between cacheable recurrent states; a multiple of `block_size`.
        max_num_batched_tokens: token budget of one step (real tokens, before bucket padding).
        max_num_seqs: most requests running at once (one row and one running slot each).
        max_model_len: most tokens (prompt + output) one request may hold.
        num_blocks: KV blocks in the paged pool, including the null block 0.
        num_state_slots: recurrent state slots, including the null slot 0.
        num_spec_tokens: MTP drafts per step (`k`); a verify row has `1 + k` tokens.
        num_lookahead: prefill lookahead `L`; `None` means `k` (multi-module MTP).
        eagle_block_drop: back a hit (and the last cacheable boundary) off by one Mamba block, as
            vLLM's EAGLE/MTP path does; `None` means "on when k > 0".
        cache_mode: "none" (no prefix caching) or "align" (states cached at block boundaries).
        ring_size: ReplaySSM window `W`; a verify row flushes when `committed + T > W`. 0: no window,
            every verify row flushes (the engine's snapshot-every-position baseline).
        token_buckets / row_buckets: allowed padded sizes of a BatchPlan; `()` picks powers of two.
        block_table_buckets: allowed widths of a BatchPlan's block table (the most KV blocks of any
            row in the step, padded); `()` picks powers of two from 8, capped at the most blocks one
            request can hold.
        vocab_size: token ids of a request must lie in [0, vocab_size); None skips the check.
        max_num_logits: most logits one step asks for (each belongs to a token, so at most
            max_num_batched_tokens, the default); prompt-logprob chunks are cut to fit.
        logits_buckets: allowed padded sizes of a BatchPlan's `logits_indices`; `()` picks powers of two.
        row_data_bytes: size of each request's opaque per-row record (`SequenceSpec.row_data`: its sampling
            settings, packed by the engine), handed to the device as `BatchPlan.row_data`.
    """

    block_size: int = 16
    mamba_block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    num_blocks: int = 4096
    num_state_slots: int = 512
    num_spec_tokens: int = 0
    num_lookahead: int | None = None
    eagle_block_drop: bool | None = None
    cache_mode: str = "align"
    ring_size: int = 16
    token_buckets: tuple[int, ...] = field(default=())
    row_buckets: tuple[int, ...] = field(default=())
    block_table_buckets: tuple[int, ...] = field(default=())
    vocab_size: int | None = None
    max_num_logits: int | None = None
    logits_buckets: tuple[int, ...] = field(default=())
    row_data_bytes: int = 0

    def __post_init__(self) -> None:
        _resolve_defaults(self)
        _validate_sizes(self)
        _validate_buckets(self)

    @property
    def align(self) -> bool:
        return self.cache_mode == "align"

    @property
    def hash_unit(self) -> int:
        return self.block_size

    @property
    def log_unit(self) -> int:
        """Tokens a running request gathers in its row tail before they move to its TokenLog and get
        hashed (history.py): the Mamba block, the grid on which decode states are published anyway."""
        return self.mamba_block_size

    @property
    def max_blocks_per_request(self) -> int:
        return -(-(self.max_model_len + self.num_spec_tokens) // self.block_size)


def default_buckets(cap: int, smallest: int = 8, growth: int = 2) -> tuple[int, ...]:
    """`smallest` times powers of `growth` up to the first one >= cap. Each bucket is one compiled step
    per combination with the other ladders, so a coarser growth trades padding for warm-up time."""
    buckets = [smallest]
    while buckets[-1] < cap:
        buckets.append(buckets[-1] * growth)
    return tuple(buckets)


def _resolve_defaults(cfg: SchedulerConfig) -> None:
    # frozen dataclass: defaults that depend on other fields are filled in once, here
    if cfg.num_lookahead is None:
        object.__setattr__(cfg, "num_lookahead", cfg.num_spec_tokens)
    if cfg.eagle_block_drop is None:
        object.__setattr__(cfg, "eagle_block_drop", cfg.num_spec_tokens > 0)
    if not cfg.token_buckets:
        object.__setattr__(cfg, "token_buckets", default_buckets(cfg.max_num_batched_tokens))
    if cfg.max_num_logits is None:
        object.__setattr__(cfg, "max_num_logits", cfg.max_num_batched_tokens)
    if not cfg.logits_buckets:
        object.__setattr__(cfg, "logits_buckets", default_buckets(cfg.max_num_logits))
    if not cfg.row_buckets:
        object.__setattr__(cfg, "row_buckets", default_buckets(cfg.max_num_seqs))
    if not cfg.block_table_buckets:
        widest = cfg.max_blocks_per_request
        widths = tuple(b for b in default_buckets(widest) if b < widest) + (widest,)
        object.__setattr__(cfg, "block_table_buckets", widths)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SchedulerConfig.{name}: {message}")


def _validate_sizes(cfg: SchedulerConfig) -> None:
    for name in ("block_size", "mamba_block_size", "max_num_batched_tokens", "max_num_seqs",
                 "max_model_len"):
        _require(getattr(cfg, name) >= 1, name, f"must be >= 1, got {getattr(cfg, name)}")
    _require(cfg.mamba_block_size % cfg.block_size == 0, "mamba_block_size",
             f"{cfg.mamba_block_size} is not a multiple of block_size {cfg.block_size}")
    _require(cfg.cache_mode in CACHE_MODES, "cache_mode", f"{cfg.cache_mode!r} not in {CACHE_MODES}")
    _require(cfg.num_spec_tokens >= 0, "num_spec_tokens", f"must be >= 0, got {cfg.num_spec_tokens}")
    _require(cfg.num_lookahead >= 0, "num_lookahead", f"must be >= 0, got {cfg.num_lookahead}")
    _require(cfg.num_blocks >= 2, "num_blocks", f"needs the null block and one more, got {cfg.num_blocks}")
    # A request admitted alone must always fit, or the queue head waits forever: the null slot and a
    # running slot, plus in align mode a producer's reserved checkpoint slot and the cached slot of its
    # prefix hit, pinned while it is copied.
    min_slots = 4 if cfg.align else 2
    _require(cfg.num_state_slots >= min_slots, "num_state_slots",
             f"needs at least {min_slots} in cache_mode {cfg.cache_mode!r} (null, running"
             f"{', checkpoint, prefix hit' if cfg.align else ''}), got {cfg.num_state_slots}")
    _require(cfg.ring_size == 0 or cfg.ring_size >= 1 + cfg.num_spec_tokens, "ring_size",
             f"{cfg.ring_size} cannot hold one verify row of {1 + cfg.num_spec_tokens} tokens (0: no window)")
    _require(cfg.vocab_size is None or cfg.vocab_size >= 1, "vocab_size", f"must be >= 1, got {cfg.vocab_size}")
    _require(1 + cfg.num_spec_tokens <= cfg.max_num_logits <= cfg.max_num_batched_tokens, "max_num_logits",
             f"{cfg.max_num_logits} must hold one verify row of {1 + cfg.num_spec_tokens} logits and at most "
             f"max_num_batched_tokens {cfg.max_num_batched_tokens}")
    _require(cfg.row_data_bytes >= 0, "row_data_bytes", f"must be >= 0, got {cfg.row_data_bytes}")
    _require(cfg.max_num_batched_tokens >= 1 + cfg.num_spec_tokens, "max_num_batched_tokens",
             f"{cfg.max_num_batched_tokens} cannot hold one verify row of {1 + cfg.num_spec_tokens} tokens")


def _validate_buckets(cfg: SchedulerConfig) -> None:
    for name, cap in (("token_buckets", cfg.max_num_batched_tokens), ("row_buckets", cfg.max_num_seqs),
                      ("logits_buckets", cfg.max_num_logits),
                      ("block_table_buckets", cfg.max_blocks_per_request)):
        buckets = getattr(cfg, name)
        _require(list(buckets) == sorted(set(buckets)), name, f"must be strictly increasing, got {buckets}")
        _require(buckets[0] >= 1 and buckets[-1] >= cap, name, f"largest bucket {buckets[-1]} < {cap}")
