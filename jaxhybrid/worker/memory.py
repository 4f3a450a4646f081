"""Pool sizing: how many KV blocks and recurrent state slots a memory budget holds (docs/engine.md#memory-model).

A state slot is one page of every recurrent layer: the checkpoint state S0 (fp32, or bf16 with
--mamba-ssm-cache-dtype), the conv window at S0, and the fp32 ReplaySSM rings of W + 1 + K entries (GDN:
normalised key, update and log-decay per token; Mamba2: x, processed dt and B; both: the pre-conv inputs;
with W = 0 whole states), plus the slot's token history (int32 per position, for sampling penalties). A KV
block holds `block_size` tokens of every attention layer, the MTP layers included, in the model's dtype or
fp8 (--kv-cache-dtype). The state pool gets a slot per running request and per checkpoint it may reserve
(so admission never waits on slots that cannot free), plus its share of the budget for cached prefix states;
the KV pool gets the rest. `max_num_seqs` is capped so that the running requests' own slots always fit. On a
device with a memory limit the budget is what is left of `gpu_memory_utilization` after the weights and the
largest step's temporaries (`runner.step_temporaries`).
On a host, the compiled steps' memory maps are checked against the kernel's limit before precompiling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from jaxhybrid.models.config import GDN, MAMBA2, ModelConfig
from jaxhybrid.models.tensor_parallel import device_param_bytes
from scheduler.replay import ring_rows

CPU_MEMORY_BUDGET = 512 * 2**20  # pool bytes on a platform that reports no device memory


class PoolSizes(NamedTuple):
    num_blocks: int         # KV blocks, the null block 0 included
    num_state_slots: int    # state slots, the null slot 0 included
    max_num_seqs: int       # running requests, capped to what the slots hold
    bytes_per_block: int
    bytes_per_slot: int

    def describe(self) -> str:
        kv, state = self.num_blocks * self.bytes_per_block / 2**30, self.num_state_slots * self.bytes_per_slot / 2**30
        return (f"{self.num_blocks} KV blocks x {self.bytes_per_block} B ({kv:.2f} GiB), {self.num_state_slots} state "
                f"slots x {self.bytes_per_slot} B ({state:.2f} GiB), max_num_seqs {self.max_num_seqs}")


def slot_bytes(cfg: ModelConfig, ring_size: int, num_spec_tokens: int, dtype_bytes: int = 2,
               history_len: int = 0, state_bytes: int = 4) -> int:
    """Bytes of one state slot over all recurrent layers (activations in `dtype_bytes`, S0 in `state_bytes`,
    ring entries in fp32) and its token history of `history_len` positions. W = `ring_size` = 0 is the
    snapshot baseline: a ring entry is a whole fp32 state."""
    entries = ring_rows(ring_size, num_spec_tokens)
    columns = cfg.conv_kernel - 1 + entries  # the window and the ring of pre-conv inputs
    per_kind = {}
    if cfg.gdn:
        g = cfg.gdn
        state = g.num_v_heads * g.head_k_dim * g.head_v_dim
        ring = g.num_k_heads * g.head_k_dim + g.num_v_heads * g.head_v_dim + g.num_v_heads if ring_size else state
        per_kind[GDN] = state_bytes * state + 4 * entries * ring + dtype_bytes * columns * g.conv_dim
    if cfg.mamba2:
        m = cfg.mamba2
        state = m.num_heads * m.head_dim * m.state_size
        ring = m.num_heads * m.head_dim + m.num_heads + m.n_groups * m.state_size if ring_size else state
        per_kind[MAMBA2] = state_bytes * state + 4 * entries * ring + dtype_bytes * columns * m.conv_dim
    return 4 * history_len + sum(per_kind[kind] for layer in cfg.layers for kind in layer if kind in per_kind)


def size_pools(cfg: ModelConfig, budget_bytes: int, *, block_size: int, ring_size: int, num_spec_tokens: int,
               max_num_seqs: int, max_model_len: int, cache_fraction: float = 0.1,
               dtype_bytes: int = 2, kv_bytes: int | None = None, state_bytes: int = 4) -> PoolSizes:
    """Split `budget_bytes` between the pools; raises ValueError when one longest request cannot fit.

    cache_fraction: share of the budget for cached prefix states beyond the per-request slots.
    dtype_bytes: the model's dtype; kv_bytes: the KV cache's (None: the model's); state_bytes: S0's.
    """
    if not 0 <= cache_fraction < 1:
        raise ValueError(f"cache_fraction must be in [0, 1), got {cache_fraction}")
    per_slot = slot_bytes(cfg, ring_size, num_spec_tokens, dtype_bytes, max_model_len + num_spec_tokens, state_bytes)
    per_block = block_size * cfg.kv_bytes_per_token(dtype_bytes if kv_bytes is None else kv_bytes)
    longest = -(-(max_model_len + num_spec_tokens) // block_size)  # blocks of one request at max_model_len
    # the null block and slot, one request at max_model_len with a reserved checkpoint and a cached hit
    minimum = (1 + longest) * per_block + 4 * per_slot
    if budget_bytes < minimum:
        raise ValueError(f"a memory budget of {budget_bytes} B cannot hold one request of max_model_len "
                         f"{max_model_len}: it needs {minimum} B ({longest} KV blocks of {per_block} B and 4 state "
                         f"slots of {per_slot} B)")
    if per_slot:  # each running request: its slot and a checkpoint it may reserve
        max_num_seqs = min(max_num_seqs, (budget_bytes - (1 + longest) * per_block - 2 * per_slot) // (2 * per_slot))
    # cached prefix states take their share only from what one longest request's blocks leave
    slot_room = (budget_bytes - (1 + longest) * per_block) // per_slot if per_slot else 0
    cached = max(min(int(cache_fraction * budget_bytes) // per_slot, slot_room - 1 - 2 * max_num_seqs), 1) \
        if per_slot else 0
    slots = 1 + 2 * max_num_seqs + cached if per_slot else 1
    blocks = (budget_bytes - slots * per_slot) // per_block if per_block else 1
    return PoolSizes(int(blocks), int(slots), int(max_num_seqs), per_block, per_slot)


def capacity_report(chosen: PoolSizes, auto: PoolSizes, kv_cache_dtype: str, state_dtype: str,
                    model_dtype: str) -> list[str]:
    """One line per pool whose dtype is not auto's: its pages with the chosen dtype against auto's, on the same
    budget (e.g. "KV cache fp8: 2.00x the blocks of bfloat16 (N vs M)")."""
    lines = []
    if chosen.bytes_per_block != auto.bytes_per_block:
        lines.append(f"KV cache {kv_cache_dtype}: {chosen.num_blocks / auto.num_blocks:.2f}x the blocks of "
                     f"{model_dtype} ({chosen.num_blocks} vs {auto.num_blocks})")
    if chosen.bytes_per_slot != auto.bytes_per_slot:
        lines.append(f"recurrent states {state_dtype}: {auto.bytes_per_slot / chosen.bytes_per_slot:.2f}x the "
                     f"state slots per byte of float32 ({chosen.bytes_per_slot} vs {auto.bytes_per_slot} B a slot; "
                     f"{chosen.num_state_slots} vs {auto.num_state_slots} slots, {chosen.num_blocks} vs "
                     f"{auto.num_blocks} KV blocks)")
    return lines


def pool_budget(utilization: float, device_bytes: int, weight_bytes: int, in_use: int = 0) -> int:
    """One device's pool bytes: `utilization` of its `device_bytes` less its share of the weights and what
    is already `in_use`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(utilization * device_bytes) - weight_bytes - in_use


def device_memory_budget(utilization: float, weight_bytes: int) -> int:
    """`pool_budget` on this host's first device; CPU_MEMORY_BUDGET where it reports no memory."""
    stats = _first_device_stats()
    budget = pool_budget(utilization, stats.get("bytes_limit", 0), weight_bytes, stats.get("bytes_in_use", 0))
    return budget if "bytes_limit" in stats else CPU_MEMORY_BUDGET


def reports_memory() -> bool:
    """Whether this host's first device has a memory limit (a GPU does; XLA:CPU reports none)."""
    return "bytes_limit" in _first_device_stats()


def _first_device_stats() -> dict:
    # this process's own device: under multi-host jax.devices()[0] may be another process's, and asking for
    # its stats made the two-process test's next collective time out (test_tensor_parallel.py)
    return jax.local_devices()[0].memory_stats() or {}


def param_bytes(params: Any, cfg: ModelConfig, mesh: Mesh | None) -> int:
    """The params' bytes on one device: all of them, or their shards under tensor parallelism."""
    if mesh is None:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    return device_param_bytes(params, cfg, mesh)


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the most the kernel allows it), or None where Linux's /proc is not."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps), limit
    except OSError:
        return None


def check_maps_suffice(before: tuple[int, int] | None, after: tuple[int, int] | None, remaining: int) -> None:
    """Raise if `remaining` more compiled steps, each mapping what the one between `before` and `after` did,
    would pass the process's memory-map limit: XLA:CPU maps every kernel of a compiled step (~1,400 maps for
    an 8-layer model), and past Linux's default 65,530 the next compile dies with SIGSEGV."""
    if before is None or after is None:
        return
    held, limit = after
    per_step = held - before[0]
    needed = held + per_step * remaining
    if needed > limit:
        raise RuntimeError(
            f"compiling {remaining + 1} step shapes needs about {needed:,} memory maps ({per_step:,} per step for "
            f"this model), over this host's vm.max_map_count of {limit:,}: use fewer buckets (--bucket-growth, "
            f"--token-buckets, --row-buckets, a smaller --max-num-seqs or --max-num-batched-tokens) or raise "
            f"vm.max_map_count")
