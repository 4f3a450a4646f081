"""Every Pallas op compiled for H100 and H200 without a GPU, at the shapes of every preset in configs/models.

For each preset, tensor-parallel size (1, 2, 4, 8; a mixer whose heads tp does not divide is replicated, as
the engine does, so it runs the TP 1 kernels and is not compiled again) and activation dtype, every public
op the preset's mixers use is compiled ahead of time (`pallas_kernels.aot`) at the launch parameters it picks
on that device: conv1d prefill, GDN / SSD prefill, decode, verify, verify with snapshots and materialize,
attention prefill and decode, and the FP8 weight matmul (at TP 1 only: its tiles do not depend on the TP
size). One line per kernel: ok or the reason, registers, spills, stack, shared memory against the 232,448 B
limit, threads and grid. Exits 1 on a compile error, a spill, or registers or shared memory over the limit.

Needs the CUDA plugin and ptxas (a venv of its own: docs/kernels.md, "Compile check without a GPU"):
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/aot_kernels.py --quick
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from tqdm import tqdm

from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.tensor_parallel import head_shards, local_heads
from pallas_kernels import aot
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import conv1d_prefill
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill, gdn_verify, gdn_verify_snapshots
from pallas_kernels.mamba2 import ssd_decode, ssd_materialize, ssd_prefill, ssd_verify, ssd_verify_snapshots

PRESETS = Path(__file__).parents[1] / "configs" / "models"
RESULTS = Path(__file__).parent / "results"
QUICK = ("qwen3_next_80b_a3b_instruct", "nemotron_h_8b_base_8k")  # one preset of each family
TP_SIZES, DTYPES = (1, 2, 4, 8), ("float32", "bfloat16")
# Sizes of one step: grids grow with them, kernels do not (tiles are static).
TOKENS, ROWS, DRAFTS, WINDOW, CONTEXT, BLOCK_SIZE = 8192, 64, 3, 8, 8192, 16
I32, F32 = jnp.int32, jnp.float32


class KernelCase(NamedTuple):
    preset: str
    tp: int
    dtype: str
    op: str
    fn: object  # (*arrays) -> results: the public op with its options bound, backend="pallas"
    specs: tuple  # jax.ShapeDtypeStruct per argument of fn


def _spec(dtype, *shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _rows(rows):  # cu_seqlens, slots
    return _spec(I32, rows + 1), _spec(I32, rows)


def _trackers(rows):  # ring_start, committed, flush
    return _spec(I32, rows), _spec(I32, rows), _spec(jnp.bool_, rows)


def _pallas(op, **options):
    return functools.partial(op, backend="pallas", **options)


SLOTS, ENTRIES, VERIFY_TOKENS = 2 * ROWS + 1, WINDOW + 1 + DRAFTS, ROWS * (1 + DRAFTS)


def conv_cases(conv_dim: int, taps: int, bias: bool, act):
    def conv(x, weight, *rest):
        return conv1d_prefill(x, weight, *rest, backend="pallas") if bias else conv1d_prefill(
            x, weight, None, *rest, backend="pallas")

    cu, slots = _rows(1)
    yield "conv1d_prefill", conv, (
        _spec(act, TOKENS, conv_dim), _spec(act, conv_dim, taps), *[_spec(act, conv_dim)] * bias, cu,
        _spec(act, SLOTS, taps - 1, conv_dim), slots, _spec(jnp.bool_, 1))


def gdn_cases(cfg, act):
    h, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim

    def tokens(n):  # q, k, v, g, beta
        return _spec(act, n, h, dk), _spec(act, n, h, dk), _spec(act, n, hv, dv), _spec(F32, n, hv), _spec(F32, n, hv)

    pool = _spec(F32, SLOTS, hv, dk, dv)
    rings = _spec(F32, SLOTS, h, ENTRIES, dk), _spec(F32, SLOTS, hv, ENTRIES, dv), _spec(F32, SLOTS, hv, ENTRIES)
    cu, slots = _rows(ROWS)
    yield "gdn_prefill", _pallas(gdn_prefill), (*tokens(TOKENS), _rows(1)[0], pool, _rows(1)[1], _spec(jnp.bool_, 1))
    yield "gdn_decode", _pallas(gdn_decode), (*tokens(ROWS), cu, pool, slots)
    yield "gdn_verify", _pallas(gdn_verify), (*tokens(VERIFY_TOKENS), cu, pool, *rings, slots, *_trackers(ROWS))
    snapshots = _spec(F32, SLOTS, hv, ENTRIES, dk, dv)
    yield "gdn_verify_snapshots", _pallas(gdn_verify_snapshots), (
        *tokens(VERIFY_TOKENS), cu, pool, snapshots, slots, *_trackers(ROWS))
    yield "gdn_materialize", _pallas(gdn_materialize), (pool, *rings, slots, slots, slots, slots)


def ssd_cases(cfg, act):
    nh, g, p, n = cfg.num_heads, cfg.n_groups, cfg.head_dim, cfg.state_size

    def tokens(m):  # x, dt, A, B, C, D
        return (_spec(act, m, nh, p), _spec(F32, m, nh), _spec(F32, nh), _spec(act, m, g, n), _spec(act, m, g, n),
                _spec(F32, nh))

    pool = _spec(F32, SLOTS, nh, p, n)
    rings = _spec(F32, SLOTS, nh, ENTRIES, p), _spec(F32, SLOTS, nh, ENTRIES), _spec(F32, SLOTS, g, ENTRIES, n)
    cu, slots = _rows(ROWS)
    yield "ssd_prefill", _pallas(ssd_prefill, chunk_size=cfg.chunk_size), (
        *tokens(TOKENS), _rows(1)[0], pool, _rows(1)[1], _spec(jnp.bool_, 1))
    yield "ssd_decode", _pallas(ssd_decode), (*tokens(ROWS), cu, pool, slots)
    yield "ssd_verify", _pallas(ssd_verify), (*tokens(VERIFY_TOKENS), cu, pool, *rings, slots, *_trackers(ROWS))
    snapshots = _spec(F32, SLOTS, nh, ENTRIES, p, n)
    yield "ssd_verify_snapshots", _pallas(ssd_verify_snapshots), (
        *tokens(VERIFY_TOKENS), cu, pool, snapshots, slots, *_trackers(ROWS))
    yield "ssd_materialize", _pallas(ssd_materialize), (pool, *rings, _spec(F32, nh), slots, slots, slots, slots)


def attention_cases(cfg, act):
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attend = _pallas(ragged_paged_attention, scale=dh**-0.5)
    for op, tokens, rows in (("attention_prefill", TOKENS, 1), ("attention_decode", ROWS, ROWS)):
        blocks = rows * (CONTEXT // BLOCK_SIZE)
        kv, pool = _spec(act, tokens, hkv, dh), _spec(act, blocks + 1, BLOCK_SIZE, hkv, dh)
        cu, _ = _rows(rows)
        yield op, attend, (_spec(act, tokens, hq, dh), kv, kv, pool, pool, _spec(I32, tokens),
                           _spec(I32, rows, CONTEXT // BLOCK_SIZE), cu, _spec(I32, rows))


def fp8_block(preset: str, cfg) -> int | None:
    """Input rows per scale of the preset's FP8 weights (None: one block of all rows, per tensor): its declared
    quantization, else its family's FP8 releases' (Qwen's 128 x 128 blocks, NVIDIA ModelOpt's per tensor)."""
    if cfg.quantization is not None:
        return cfg.quantization.weight_block[1] if cfg.quantization.weight_block else None
    return None if "nemotron" in preset else 128


def fp8_cases(cfg, act, block: int | None):
    """The FP8 weight matmul at the preset's MLP projections: one decode row (K splits), a decode bucket and a
    prefill, in row blocks of `block` (None: per tensor; Nemotron-H-8B's 21,504-row down projection is then one
    block that is not a power of two)."""
    hidden = cfg.hidden_size
    inner = cfg.moe.shared_intermediate_size if cfg.moe else cfg.intermediate_size
    for rows, (in_features, out_features) in ((1, (hidden, inner)), (ROWS, (inner, hidden)), (TOKENS, (hidden, inner))):
        rows_per_block = block or in_features
        blocks = -(-in_features // rows_per_block)
        weight = _spec(jnp.float8_e4m3fn, blocks, rows_per_block, out_features), _spec(F32, blocks, out_features)
        yield "fp8_matmul", _pallas(fp8_matmul), (_spec(act, rows, in_features), *weight)


def kernel_cases(preset: str, tp: int, dtype: str):
    """The cases of one preset at one TP size: the mixers whose heads tp splits (all of them at tp 1)."""
    cfg, act = load_config(PRESETS / f"{preset}.yaml"), jnp.dtype(dtype)
    mixers = [(cfg.gdn, gdn_cases), (cfg.mamba2, ssd_cases), (cfg.attention, attention_cases)]
    for mixer, cases in mixers:
        if mixer is None or head_shards(mixer, tp) != tp:
            continue
        local = local_heads(mixer, tp)
        if cases is not attention_cases:
            bias = getattr(local, "use_conv_bias", False)  # Mamba2 configs say; GDN convs have none
            yield from conv_cases(local.conv_dim, local.conv_kernel, bias, act)
        yield from cases(local, act)
    if tp == 1:
        yield from fp8_cases(cfg, act, fp8_block(preset, cfg))



def all_cases(presets, tp_sizes, dtypes):
    for preset in presets:
        for tp in tp_sizes:
            for dtype in dtypes:
                yield from (KernelCase(preset, tp, dtype, *case) for case in kernel_cases(preset, tp, dtype))


class Result(NamedTuple):
    case: KernelCase
    target: str
    seconds: float
    kernels: tuple[aot.KernelRecord, ...] = ()
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or any(k.problems() for k in self.kernels)

    def lines(self) -> list[str]:
        c = self.case
        where = f"{self.target} {c.preset} tp{c.tp} {c.dtype:<8} {c.op:<20}"
        if self.error is not None:
            return [f"{where} COMPILE ERROR {self.error}"]
        return [f"{where} {k.name:<56} {'; '.join(k.problems()) or 'ok':<10} {k.summary()}" for k in self.kernels]

    def to_json(self) -> dict:
        c = self.case
        return dict(target=self.target, preset=c.preset, tp=c.tp, dtype=c.dtype, op=c.op, error=self.error,
                    seconds=round(self.seconds, 2),
                    kernels=[dict(k._asdict(), problems=k.problems()) for k in self.kernels])


def check(case: KernelCase, target: str) -> Result:
    start = time.perf_counter()
    try:
        kernels = aot.compile_kernels(case.fn, case.specs, target)
    except Exception as error:  # noqa: BLE001 - a kernel that does not compile is a result, and fails the run
        message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        return Result(case, target, time.perf_counter() - start, error=message)
    return Result(case, target, time.perf_counter() - start, tuple(kernels))


def table(results: list[Result]) -> list[str]:
    """Per target, preset, TP and dtype: kernels ok / failed (compile errors count one each) / spilling."""
    counts: dict[tuple, list[int]] = {}
    for r in results:
        ok_failed_spilling = counts.setdefault((r.target, r.case.preset, r.case.tp, r.case.dtype), [0, 0, 0])
        ok_failed_spilling[1] += r.error is not None
        for k in r.kernels:
            ok_failed_spilling[0 if not k.problems() else 1] += 1
            ok_failed_spilling[2] += bool(k.spill_stores or k.spill_loads)
    header = f"{'target':<6} {'preset':<32} {'tp':>2} {'dtype':<8} {'ok':>3} {'failed':>6} {'spilling':>8}"
    return [header] + [f"{t:<6} {p:<32} {tp:>2} {d:<8} {ok:>3} {failed:>6} {spilling:>8}"
                       for (t, p, tp, d), (ok, failed, spilling) in counts.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    presets = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    parser.add_argument("--preset", nargs="+", choices=presets, help="presets to compile (default: all)")
    parser.add_argument("--family", nargs="+", choices=("qwen", "nemotron"), help="only presets of these families")
    parser.add_argument("--tp", nargs="+", type=int, default=TP_SIZES, help="tensor-parallel sizes")
    parser.add_argument("--dtype", nargs="+", default=DTYPES, choices=DTYPES, help="activation dtypes")
    parser.add_argument("--target", nargs="+", default=tuple(aot.TARGETS), choices=tuple(aot.TARGETS))
    parser.add_argument("--op", nargs="+", help="only these ops (e.g. gdn_prefill attention_decode)")
    parser.add_argument("--quick", action="store_true", help=f"the CI subset: {', '.join(QUICK)}")
    parser.add_argument("--json", type=Path, help="also write every record here")
    args = parser.parse_args()
    chosen = QUICK if args.quick else args.preset or presets
    chosen = [p for p in chosen if not args.family or any(f in p for f in args.family)]
    cases = [c for c in all_cases(chosen, args.tp, args.dtype) if not args.op or c.op in args.op]
    start, results = time.perf_counter(), []
    for case in tqdm(cases, desc="aot", unit="case"):
        for target in args.target:
            results.append(check(case, target))
            tqdm.write("\n".join(results[-1].lines()))
    print("\n".join(table(results)))
    failed = sum(r.failed for r in results)
    print(f"{len(results)} cases, {failed} failed, {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
