"""GDN and attention kernels at Qwen3-Next-80B-A3B TP-4 per-device shapes, timed on this GPU, next to
flash-linear-attention (`fla-core`, Triton on torch) on the same shapes.

Run by `benchmarks/gpu_session.sh` on a lent H100/H200. First the GPU's own rates, measured in this run: a
device-to-device copy (bytes read and written) and a bf16 GEMM. Then each case through its public op with
backend="pallas" (its lowering must hold Triton calls, counted per case): the time per call, and its rates from
the op's `pl.CostEstimate`s (`pallas_kernels/*/cost.py`, summed by `pallas_kernels.cost.kernel_cost`), as GB/s
and TFLOP/s and as fractions of the measured copy bandwidth and GEMM rate. Cases:

  gdn_decode            256 and 1,024 rows of one token
  gdn_verify            MTP K = 3 (1 + 3 tokens a row), 256 rows, ReplaySSM W = 16 (8 entries committed)
  gdn_verify_snapshots  the same rows with W = 0, the snapshot-every-position baseline (2 committed, flushing)
  gdn_prefill           one row of 8,192 tokens
  grouped_prefill       1 anchor x 512 + 16 candidates x 64 tokens in one call (pallas_kernels.grouped_prefill)
  per-range prefill     the same tokens in 17 calls, each candidate from a copy of the anchor's state
  attention_decode      256 rows at context 4,096

fla-core's times sit next to ours where it has the op: `fused_recurrent_gated_delta_rule` for decode and for
verify (its 1 + K tokens a row with no ring: it keeps only the final state), `chunk_gated_delta_rule` for the
prefill, and for the grouped prefill two calls (the anchor, then the candidates varlen through cu_seqlens from its
state). Its inputs are ours, shared through DLPack; its rates count our op's bytes and FLOPs (equal work), and
`fla_max_abs_diff` compares its first output with ours where both start from the same states. Its states are
contiguous per row, where ours are gathered from a slot pool by index. fla-core is imported from a carried
wheel (gpu_session.sh); when it fails to import or run, the reason is recorded and the run goes on.

Calls are queued back to back and the queue timed to its end, so the host's dispatch overlaps the device's work.
Every finished case is written at once (`--out`/gpu_kernels.json; benchmarks/results/gpu_kernels.json when run
for real), so a timeout loses only the case in flight.

    python benchmarks/gpu_kernels.py --out "$OUT"      # on a GPU
    python benchmarks/gpu_kernels.py --dry-run --out /tmp/dry   # CPU: tiny shapes, the reference ops
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, write_results  # benchmarks/ is sys.path[0]
from roofline import PRESETS, Case, Inputs, _per_rank, _rows, kernel_case
from tqdm import tqdm

from jaxhybrid.models.hf_config import load_config
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify, gdn_verify_snapshots
from pallas_kernels.grouped_prefill import grouped_prefill
from pallas_kernels.pools import copy_slots
from scheduler.replay import ring_rows

TRITON_CALL = "__gpu$xla.gpu.triton"
PRESET = "qwen3_next_80b_a3b_instruct"


class Sizes(NamedTuple):
    tp: int
    decode_rows: tuple[int, ...]
    verify_rows: int
    drafts: int
    window: int
    prefill_tokens: int
    anchor: int
    candidates: int
    candidate: int
    attention_rows: int
    context: int
    copy_bytes: int  # the bandwidth probe's array
    gemm: int  # the GEMM probe's M = N = K


REAL = Sizes(tp=4, decode_rows=(256, 1024), verify_rows=256, drafts=3, window=16, prefill_tokens=8192, anchor=512,
             candidates=16, candidate=64, attention_rows=256, context=4096, copy_bytes=2 << 30, gemm=8192)
# The dry run's shapes: TP 16 leaves one qk and two value heads; a few rows and tokens of each case.
DRY = Sizes(tp=16, decode_rows=(4, 8), verify_rows=4, drafts=3, window=16, prefill_tokens=64, anchor=32,
            candidates=2, candidate=16, attention_rows=2, context=64, copy_bytes=4 << 20, gemm=128)


class FlaWork(NamedTuple):
    """What fla-core runs for a case: our token arrays, rows of `lengths` tokens, their first states."""

    kind: str  # "recurrent" (rows of equal length), "chunk" (one row), "grouped" (anchor, then varlen candidates)
    tokens: tuple  # q, k, v, g, beta
    lengths: tuple[int, ...]
    initial: jax.Array | None  # [rows, HV, K, V] f32 (grouped: None, the anchor starts from zeros)
    compare: bool  # whether our first output starts from the same states (a check of equal work)


class Bench(NamedTuple):
    case: Case  # its FLOPs and bytes, and the call threading its pools
    call: Callable  # (backend, *pools) -> (..., *pools): the op itself, to lower
    pools: list
    fla: FlaWork | None
    note: str = ""


def bench(op: str, shape: str, call: Callable, pools: list, fla: FlaWork | None = None, note: str = "") -> Bench:
    return Bench(kernel_case(op, shape, call, pools, ""), call, pools, fla, note)


# ---- timing ----------------------------------------------------------------------------------------------------


def per_call_seconds(run: Callable[[], Any], sync: Callable[[Any], Any], min_seconds: float = 0.05,
                     trials: int = 3, in_flight: int | None = None) -> tuple[float, Any]:
    """(seconds per call, the first call's result): the median over `trials` of back-to-back calls, queued without
    waiting and timed to the last one's end, so the host's dispatch overlaps the device's work; each trial lasts
    about `min_seconds`. The first call compiles (and autotunes) and is not timed. `in_flight`: wait for the call
    that many calls back before queueing another (the queue stays full), which bounds the memory of outputs that
    are each a large new array."""
    first = run()
    sync(first)
    start = time.perf_counter()
    sync(run())
    calls = max(1, math.ceil(min_seconds / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(trials):
        start, queued = time.perf_counter(), collections.deque()
        for _ in range(calls):
            queued.append(run())
            if in_flight is not None and len(queued) > in_flight:
                sync(queued.popleft())
        sync(queued[-1])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times), first


def measure_peaks(sizes: Sizes) -> dict[str, float]:
    """This GPU's copy bandwidth (bytes read + written per second, one device-to-device copy of a large array) and
    bf16 GEMM rate (FLOP/s, M = N = K = sizes.gemm, f32 accumulation), each timed as the kernels are."""
    x, copy, matmul = jnp.zeros(sizes.copy_bytes // 2, jnp.bfloat16), jax.jit(jnp.copy), jax.jit(jnp.matmul)
    copy_s, _ = per_call_seconds(lambda: copy(x), jax.block_until_ready, in_flight=2)
    a, b = (jax.random.normal(key, (sizes.gemm,) * 2, jnp.bfloat16) for key in jax.random.split(jax.random.key(0)))
    gemm_s, _ = per_call_seconds(lambda: matmul(a, b), jax.block_until_ready, in_flight=2)
    return dict(copy_bandwidth=2 * x.nbytes / copy_s, gemm_flops=2 * sizes.gemm**3 / gemm_s,
                copy_bytes=x.nbytes, gemm=sizes.gemm)


# ---- our cases -------------------------------------------------------------------------------------------------


def gdn_tokens(inputs: Inputs, cfg, tp: int, n: int) -> tuple:
    """q, k [n, H, K], v [n, HV, V] in the activation dtype; log-decays g and betas [n, HV] f32."""
    h, hv = _per_rank(cfg.num_k_heads, tp), _per_rank(cfg.num_v_heads, tp)
    return (inputs.act(n, h, cfg.head_k_dim), inputs.act(n, h, cfg.head_k_dim), inputs.act(n, hv, cfg.head_v_dim),
            inputs.decay(n, hv), inputs.unit(n, hv))  # fmt: skip


def state_pool(inputs: Inputs, cfg, tp: int, slots: int) -> jax.Array:
    return inputs.f32(slots, _per_rank(cfg.num_v_heads, tp), cfg.head_k_dim, cfg.head_v_dim, scale=0.1)


def shape_of(cfg, tp: int) -> str:
    return f"tp{tp} H={_per_rank(cfg.num_k_heads, tp)} HV={_per_rank(cfg.num_v_heads, tp)}"


def decode_bench(inputs: Inputs, cfg, tp: int, rows: int) -> Bench:
    tokens, pool, slots = gdn_tokens(inputs, cfg, tp, rows), state_pool(inputs, cfg, tp, rows + 1), _slots(rows)
    return bench("gdn_decode", f"{shape_of(cfg, tp)} R={rows}",
                 lambda b, p: gdn_decode(*tokens, _rows([1] * rows), p, slots, backend=b), [pool],
                 FlaWork("recurrent", tokens, (1,) * rows, pool[slots], True))


def verify_bench(inputs: Inputs, cfg, tp: int, rows: int, window: int, drafts: int) -> Bench:
    """MTP verify of 1 + K tokens a row. W > 0: the rows have W / 2 entries committed and do not flush (what the
    kernels' estimates assume, `pallas_kernels.estimates.folded_entries`). W = 0: every step flushes, here after the
    ~2 entries the last step accepted (1 + 0.7 + 0.49 + 0.34 expected at acceptance 0.7, less the bonus)."""
    h, hv, dk, dv = (_per_rank(cfg.num_k_heads, tp), _per_rank(cfg.num_v_heads, tp), cfg.head_k_dim,
                     cfg.head_v_dim)  # fmt: skip
    length, entries, slots = 1 + drafts, ring_rows(window, drafts), _slots(rows)
    tokens, cu, pool = gdn_tokens(inputs, cfg, tp, rows * length), _rows([length] * rows), state_pool(
        inputs, cfg, tp, rows + 1)
    committed = window // 2 if window else 2
    trackers = (slots, np.zeros(rows, np.int32), np.full(rows, committed, np.int32), np.full(rows, window == 0))
    shape = f"{shape_of(cfg, tp)} R={rows} T/row={length} W={window} committed={committed}"
    if window:
        rings = (inputs.f32(rows + 1, h, entries, dk), inputs.f32(rows + 1, hv, entries, dv),
                 inputs.decay(rows + 1, hv, entries))  # fmt: skip
        return bench("gdn_verify", shape, lambda b, *p: gdn_verify(*tokens, cu, *p, *trackers, backend=b),
                     [pool, *rings], FlaWork("recurrent", tokens, (length,) * rows, pool[slots], False),
                     "fla: fused_recurrent over the 1 + K tokens, keeping the final state only (no rollback)")
    snapshots = inputs.f32(rows + 1, hv, entries, dk, dv, scale=0.1)
    return bench("gdn_verify_snapshots", shape,
                 lambda b, *p: gdn_verify_snapshots(*tokens, cu, *p, *trackers, backend=b), [pool, snapshots],
                 note="fla: see gdn_verify")


def prefill_bench(inputs: Inputs, cfg, tp: int, tokens_count: int) -> Bench:
    tokens, pool, slots = gdn_tokens(inputs, cfg, tp, tokens_count), state_pool(inputs, cfg, tp, 2), _slots(1)
    return bench("gdn_prefill", f"{shape_of(cfg, tp)} T={tokens_count}",
                 lambda b, p: gdn_prefill(*tokens, _rows([tokens_count]), p, slots, np.ones(1, bool), backend=b),
                 [pool], FlaWork("chunk", tokens, (tokens_count,), pool[slots], True))


def grouped_benches(inputs: Inputs, cfg, tp: int, anchor: int, candidates: int, candidate: int) -> Iterator[Bench]:
    """1 anchor + N candidates: one grouped call (the anchor, its state copied into each candidate's slot, then
    every candidate), and the same rows in 1 + N calls (the per-range baseline)."""
    lengths = [anchor] + [candidate] * candidates
    tokens, pool = gdn_tokens(inputs, cfg, tp, sum(lengths)), state_pool(inputs, cfg, tp, candidates + 2)
    slots, has_initial = _slots(candidates + 1), np.arange(candidates + 1) > 0
    copy_src, copy_dst = np.ones(candidates, np.int32), slots[1:]
    shape = f"{shape_of(cfg, tp)} 1x{anchor} + {candidates}x{candidate}"

    def grouped(backend: str, p: jax.Array) -> tuple:
        def run(cu, pool_, slots_, has_initial_):
            return gdn_prefill(*tokens, cu, pool_, slots_, has_initial_, backend=backend)

        return grouped_prefill(run, _rows(lengths), np.int32(1), p, slots, has_initial, copy_src, copy_dst)

    def per_range(backend: str, p: jax.Array) -> tuple:
        outs, starts = [], np.cumsum([0] + lengths)
        for row, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
            if row:
                p = copy_slots(p, slots[:1], slots[row:row + 1])
            rows = slice(row, row + 1)
            o, p = gdn_prefill(*(x[start:end] for x in tokens), _rows([end - start]), p, slots[rows],
                               has_initial[rows], backend=backend)
            outs.append(o)
        return jnp.concatenate(outs), p

    work = FlaWork("grouped", tokens, tuple(lengths), None, True)
    jitted = dict(static_argnums=0, donate_argnums=1)  # one program each: its kernels back to back, no host between
    yield bench("grouped_prefill", f"{shape}, one call", jax.jit(grouped, **jitted), [pool], work,
                "fla: two calls, the anchor then the candidates varlen from its state")
    yield bench("per-range prefill", f"{shape}, {1 + candidates} calls", jax.jit(per_range, **jitted), [pool])


def attention_bench(inputs: Inputs, cfg, tp: int, rows: int, context: int, block: int = 16) -> Bench:
    """Rows of one new token at the end of `context` positions, each over its own blocks."""
    hq, hkv, dh = _per_rank(cfg.num_heads, tp), _per_rank(cfg.num_kv_heads, tp), cfg.head_dim
    per_row = context // block
    tables = (1 + np.arange(rows * per_row, dtype=np.int32)).reshape(rows, per_row)
    pools = [inputs.act(rows * per_row + 1, block, hkv, dh) for _ in range(2)]
    slot_mapping = tables[:, -1] * block + (context - 1) % block
    q, k, v, before = (inputs.act(rows, hq, dh), inputs.act(rows, hkv, dh), inputs.act(rows, hkv, dh),
                       np.full(rows, context - 1, np.int32))  # fmt: skip
    return bench("attention_decode", f"tp{tp} HQ={hq} HKV={hkv} Dh={dh} R={rows} ctx={context}",
                 lambda b, kp, vp: ragged_paged_attention(q, k, v, kp, vp, slot_mapping, tables, _rows([1] * rows),
                                                          before, scale=dh**-0.5, backend=b),
                 pools, note="fla-core has no paged attention")


def _slots(rows: int) -> np.ndarray:
    return np.arange(1, rows + 1, dtype=np.int32)


def benches(sizes: Sizes, dtype: str) -> Iterator[Bench]:
    """Each case built when its turn comes, so that one case's pools are on the device at a time."""
    cfg, inputs, tp = load_config(PRESETS / f"{PRESET}.yaml"), Inputs(dtype), sizes.tp
    for rows in sizes.decode_rows:
        yield decode_bench(inputs, cfg.gdn, tp, rows)
    for window in (sizes.window, 0):
        yield verify_bench(inputs, cfg.gdn, tp, sizes.verify_rows, window, sizes.drafts)
    yield prefill_bench(inputs, cfg.gdn, tp, sizes.prefill_tokens)
    yield from grouped_benches(inputs, cfg.gdn, tp, sizes.anchor, sizes.candidates, sizes.candidate)
    yield attention_bench(inputs, cfg.attention, tp, sizes.attention_rows, sizes.context)


def num_cases(sizes: Sizes) -> int:
    return len(sizes.decode_rows) + 6


def triton_calls(case: Bench, backend: str) -> int:
    """Triton custom calls in the case's lowering for this backend: > 0 shows that the GPU runs the compiled
    kernels, not interpret mode."""
    lowered = jax.jit(lambda *pools: case.call(backend, *pools)).lower(*case.pools)
    return lowered.as_text().count(TRITON_CALL)


# ---- fla-core -------------------------------------------------------------------------------------------------


def fla_call(work: FlaWork) -> Callable[[], Any]:
    """fla-core's op on our inputs (torch views of the same device buffers): () -> (o [B, T, HV, V], state)."""
    import torch  # noqa: PLC0415 - only on the GPU machine, with fla-core carried as a wheel
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: PLC0415

    q, k, v, g, beta = (torch.from_dlpack(x) for x in work.tokens)
    beta = beta.to(q.dtype)  # as vLLM passes it: gates in f32, beta in the activations' dtype
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if work.kind == "recurrent":  # one batch entry per row
        rows = len(work.lengths)
        per_row = [x.reshape(rows, work.lengths[0], *x.shape[1:]) for x in (q, k, v, g, beta)]
        initial = torch.from_dlpack(work.initial)
        return lambda: fused_recurrent_gated_delta_rule(*per_row, initial_state=initial, **options)
    if work.kind == "chunk":
        initial = torch.from_dlpack(work.initial)
        return lambda: chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=initial,
                                              **options)
    anchor, rest = work.lengths[0], work.lengths[1:]
    cu = torch.tensor(np.cumsum((0, *rest)), dtype=torch.long, device=q.device)
    head = [x[None, :anchor] for x in (q, k, v, g, beta)]
    tail = [x[None, anchor:] for x in (q, k, v, g, beta)]

    def grouped():
        o_anchor, state = chunk_gated_delta_rule(*head, **options)
        o, states = chunk_gated_delta_rule(*tail, initial_state=state.expand(len(rest), -1, -1, -1).contiguous(),
                                           cu_seqlens=cu, **options)
        return torch.cat([o_anchor, o], dim=1), states

    return grouped


def fla_version() -> str:
    """fla-core's version, or why it does not import (it needs torch, Triton and a GPU)."""
    try:
        import fla  # noqa: PLC0415
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            return "unavailable: torch sees no CUDA device"
        return f"fla-core {fla.__version__}, torch {torch.__version__}"
    except Exception as error:  # noqa: BLE001 - a missing peer is a result, not a failure
        return f"unavailable: {type(error).__name__}: {error}"


def run_fla(work: FlaWork, ours_first: Any) -> dict:
    import torch  # noqa: PLC0415

    seconds, first = per_call_seconds(fla_call(work), lambda _: torch.cuda.synchronize())
    record = dict(fla_s=seconds)
    if work.compare:
        ours = np.asarray(jnp.asarray(ours_first[0], jnp.float32))
        theirs = first[0].float().reshape(ours.shape).cpu().numpy()
        record["fla_max_abs_diff"] = float(np.abs(ours - theirs).max())
    return record


# ---- the run ---------------------------------------------------------------------------------------------------


def rates(record: dict, peaks: dict, prefix: str = "") -> dict:
    seconds = record[f"{prefix}s"]
    gbps, tflops = record["bytes"] / seconds / 1e9, record["flops"] / seconds / 1e12
    return {f"{prefix}gb_per_s": gbps, f"{prefix}tflop_per_s": tflops,
            f"{prefix}of_copy_bandwidth": gbps * 1e9 / peaks["copy_bandwidth"],
            f"{prefix}of_gemm_rate": tflops * 1e12 / peaks["gemm_flops"]}


def measure_case(case: Bench, backend: str, peaks: dict, on_gpu: bool) -> tuple[dict, Any]:
    """The case's record (its error, if any) and its first call's result."""
    record = dict(op=case.case.op, shape=case.case.shape, flops=case.case.flops, bytes=case.case.bytes,
                  note=case.note)
    try:
        record["triton_calls"] = triton_calls(case, backend) if on_gpu else 0
        if on_gpu and not record["triton_calls"]:
            raise RuntimeError(f"{case.case.op} lowers to no Triton call: not the compiled kernels")
        record["s"], first = per_call_seconds(case.case.call(backend), jax.block_until_ready)
    except Exception as error:  # noqa: BLE001 - one failing case is a result; the others still run
        record["error"] = f"{type(error).__name__}: {error}"[:500]
        traceback.print_exc()
        return record, None
    return record | rates(record, peaks), first


def row(r: dict) -> str:
    if "s" not in r:
        return f"{r['op']:<21} {r['shape']:<52} ERROR {r.get('error', '')}"
    fla = f"{1e3 * r['fla_s']:>8.3f} {r['fla_s'] / r['s']:>8.2f}" if "fla_s" in r else f"{'-':>8} {'-':>8}"
    return (f"{r['op']:<21} {r['shape']:<52} {1e3 * r['s']:>8.3f} {r['gb_per_s']:>7.0f} {r['tflop_per_s']:>8.1f} "
            f"{r['of_copy_bandwidth']:>7.1%} {r['of_gemm_rate']:>7.1%} {fla}")


def table(records: list[dict], peaks: dict) -> list[str]:
    lines = [f"# copy {peaks['copy_bandwidth'] / 1e9:,.0f} GB/s (read + write), bf16 GEMM "
             f"{peaks['gemm_flops'] / 1e12:,.0f} TFLOP/s, measured in this run; fla columns: its ms, its time / ours",
             f"{'op':<21} {'shape':<52} {'ms':>8} {'GB/s':>7} {'TFLOP/s':>8} {'of copy':>7} {'of GEMM':>7} "
             f"{'fla ms':>8} {'fla/ours':>8}"]
    lines += [row(r) for r in records]
    by_op = {r["op"]: r for r in records if "s" in r}
    if {"grouped_prefill", "per-range prefill"} <= set(by_op):
        lines.append(f"# grouped prefill {by_op['per-range prefill']['s'] / by_op['grouped_prefill']['s']:.2f}x "
                     f"faster than per-range calls (vLLM #55876 measured 7.58x on an L40S)")
    lines += [f"# {r['op']}: fla {r['fla_error']}" for r in records if "fla_error" in r]
    lines += [f"# {r['op']}: {r['note']}" for r in records if r.get("note")]
    return lines


class Writer(NamedTuple):
    """Writes the records so far after every case: to OUT and, on a real run, benchmarks/results/."""

    out: Path | None
    real: bool
    meta: dict

    def __call__(self, records: list[dict], peaks: dict) -> None:
        document = dict(meta=machine() | self.meta, peaks=peaks, results=records)
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_kernels.json").write_text(json.dumps(document, indent=1))
        if self.real:
            write_results("gpu_kernels", records, self.meta, peaks=peaks)


def run(args: argparse.Namespace) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.dry_run):
        raise SystemExit("needs a CUDA GPU (or --dry-run: tiny shapes on CPU)")
    sizes, backend = (DRY, "reference") if args.dry_run else (REAL, "pallas")
    peaks = measure_peaks(sizes)
    fla = fla_version() if args.fla else "not asked for (--no-fla)"
    write = Writer(args.out, not args.dry_run, dict(device=str(jax.devices()[0]), preset=PRESET, dtype=args.dtype,
                                                    backend=backend, sizes=sizes._asdict(), fla=fla))
    records, works = [], []
    for case in tqdm(benches(sizes, args.dtype), total=num_cases(sizes), desc="ours", unit="case"):
        record, first = measure_case(case, backend, peaks, on_gpu)
        records.append(record)
        tqdm.write(row(record))
        works.append((record, case.fla, first))
        write(records, peaks)
    if fla.startswith("fla-core"):
        for record, work, first in tqdm([w for w in works if w[1] and w[2] is not None], desc="fla-core",
                                        unit="case"):
            try:
                record.update(run_fla(work, first))
                record.update(rates(record, peaks, "fla_"))
            except Exception as error:  # noqa: BLE001 - recorded next to the case, the others still run
                record["fla_error"] = f"{type(error).__name__}: {error}"[:500]
                traceback.print_exc()
            write(records, peaks)
    print("\n".join(table(records, peaks)))
    print(f"fla: {fla}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="activations")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") and Path(os.environ["OUT"]),
                        help="also write gpu_kernels.json here (default: $OUT)")
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="skip fla-core")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, the reference ops, no fla-core")
    args = parser.parse_args()
    if args.dry_run:
        args.fla = False
    run(args)


if __name__ == "__main__":
    main()
