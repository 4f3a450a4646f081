"""Kernel timings at model-like layer shapes: every op of pallas_kernels, one table.

Each case times the op through its public function on this machine's default backend (reference on
CPU, Pallas on GPU; `--backend` overrides) and, in the same run, a plain-NumPy baseline of the same
maths (token loops vectorised over heads, dense softmax attention). Shapes follow Qwen3-Next GDN
(H 16, HV 32, dk = dv = 128, conv dim 8192), Nemotron-H Mamba2 (128 heads x 64, N 128, G 8) and a
gated-attention layer (16 q heads, 2 kv heads, head dim 256, block 16); `--scale` shrinks heads and
tokens for a quick run. Prints a table and writes benchmarks/results/kernels_<platform>.json.

`--gpu`: every op at Qwen3-Next-80B-A3B and Nemotron-H-8B shapes (TP 1 and TP 4 heads per rank, 8k-token
prefill, batch 64 decode/verify/materialize, 8k-context attention decode) in bf16, the Pallas kernel next
to the XLA reference on the same GPU: time, TFLOP/s, GB/s and the fraction of the H200 roofline, against
the targets (>= 60% of HBM bandwidth for decode-type ops, >= 35% of bf16 peak for GDN/SSD prefill). Writes
kernels_gpu_roofline.json and a roofline plot. `--gpu --kernel-backend interpret --divide 64` is a CPU
smoke run of the same cases.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import jax
import numpy as np
from common import figure, write_results  # benchmarks/ is sys.path[0]

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import conv1d_prefill, conv1d_replay
from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill, gdn_verify
from pallas_kernels.mamba2 import ssd_decode, ssd_materialize, ssd_prefill, ssd_verify

H200_HBM_BYTES_PER_S = 4.8e12


class Case(NamedTuple):
    op: str
    shape: str
    run: object  # () -> device result, through the public op
    baseline: object  # () -> the same maths in NumPy
    tokens: int  # tokens (or materialized slots) processed per call
    state_bytes: int = 0  # recurrent state read + written per call (decode-type ops; 0 = not memory-bound)


def median_ms(fn, repeats):
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


class Pools:
    """Device-resident pools threaded through donating calls, as the engine's step does."""

    def __init__(self, *pools):
        self.pools = [jax.device_put(p) for p in pools]

    def call(self, fn, *args, **kwargs):
        """fn(*args, *pools, **kwargs) -> (out, *pools); keeps the new pools and returns them with out, so
        that timing waits for every write (ops that only update pools return out = None)."""
        out, *self.pools = fn(*args, *self.pools, **kwargs)
        return out, self.pools


def _rows(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


# ---- NumPy baselines -------------------------------------------------------------------------------


def np_conv(x, weight, cu, windows):
    out = np.empty_like(x)
    for r in range(len(cu) - 1):
        xx = np.concatenate([windows[r], x[cu[r] : cu[r + 1]]])
        taps = np.stack([xx[i : i + cu[r + 1] - cu[r]] for i in range(weight.shape[1])])
        y = np.einsum("ktd,dk->td", taps, weight)
        out[cu[r] : cu[r + 1]] = y / (1 + np.exp(-y))
    return out


def np_gdn(q, k, v, g, beta, cu, states):
    group = v.shape[1] // q.shape[1]
    q, k = np.repeat(_l2(q) * q.shape[-1] ** -0.5, group, 1), np.repeat(_l2(k), group, 1)
    out = np.empty_like(v)
    for r in range(len(cu) - 1):
        s = states[r].copy()
        for t in range(cu[r], cu[r + 1]):
            s *= np.exp(g[t])[:, None, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))
            s += k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out


def np_ssd(x, dt, a, b, c, d, cu, states):
    group = x.shape[1] // b.shape[1]
    b, c = np.repeat(b, group, 1), np.repeat(c, group, 1)
    out = np.empty_like(x)
    for r in range(len(cu) - 1):
        s = states[r].copy()
        for t in range(cu[r], cu[r + 1]):
            s = np.exp(dt[t] * a)[:, None, None] * s + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
            out[t] = np.einsum("hpn,hn->hp", s, c[t]) + d[:, None] * x[t]
    return out


def np_attention(q, keys, values, cu, context, scale):
    out = np.empty_like(q)
    group = q.shape[1] // keys[0].shape[1]
    for r in range(len(cu) - 1):
        n = cu[r + 1] - cu[r]
        kk, vv = np.repeat(keys[r], group, 1), np.repeat(values[r], group, 1)
        s = np.einsum("thd,khd->htk", q[cu[r] : cu[r + 1]], kk) * scale
        s = np.where(np.arange(context[r])[None, :] <= (context[r] - n + np.arange(n))[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[cu[r] : cu[r + 1]] = np.einsum("htk,khd->thd", p / p.sum(-1, keepdims=True), vv)
    return out


# ---- cases: (op, shape, run, baseline) --------------------------------------------------------------


def conv_case(rng, backend, tokens, rows, dim=8192, kc=4, drafts=3):
    x, weight = rng.standard_normal((tokens, dim), np.float32), rng.standard_normal((dim, kc), np.float32)
    cu, slots = _rows([tokens // rows] * rows), np.arange(1, rows + 1, dtype=np.int32)
    pool = rng.standard_normal((rows + 1, kc - 1, dim), np.float32)
    device = Pools(pool)
    yield Case(
        "conv1d_prefill", f"T={tokens} R={rows} D={dim}",
        lambda: device.call(lambda p: conv1d_prefill(x, weight, None, cu, p, slots, np.ones(rows, bool),
                                                     backend=backend)),
        lambda: np_conv(x, weight, cu, pool[slots, : kc - 1]), tokens,
    )  # fmt: skip
    ring = rng.standard_normal((rows + 1, 1, 16 + 1 + drafts, dim), np.float32)
    xv, cuv = x[: rows * (1 + drafts)], _rows([1 + drafts] * rows)
    trackers = (np.zeros(rows, np.int32), np.full(rows, 8, np.int32), np.zeros(rows, bool))
    yield Case(
        "conv1d_replay", f"R={rows} T/row={1 + drafts} D={dim}",
        lambda: device.call(lambda p: conv1d_replay(xv, weight, None, cuv, p, ring, slots, *trackers,
                                                    backend=backend)[:2]),
        lambda: np_conv(xv, weight, cuv, np.concatenate([pool[slots, : kc - 1], ring[slots, 0, :8]], 1)[:, -(kc - 1):]),
        rows * (1 + drafts),
    )  # fmt: skip


def _gdn_tokens(rng, tokens, heads, value_heads, dim):
    return (
        rng.standard_normal((tokens, heads, dim), np.float32), rng.standard_normal((tokens, heads, dim), np.float32),
        rng.standard_normal((tokens, value_heads, dim), np.float32),
        -rng.exponential(0.1, (tokens, value_heads)).astype(np.float32),
        rng.uniform(0, 1, (tokens, value_heads)).astype(np.float32),
    )  # fmt: skip


def np_fold_gdn_ring(states, ring_k, ring_u, ring_g, group, num_entries):
    """S <- e^g S + k u^T for each of the first entries (ring_start 0)."""
    states = states.copy()
    for j in range(num_entries):
        k = np.repeat(ring_k[:, :, j], group, 1)
        states = np.exp(ring_g[:, :, j])[..., None, None] * states + k[..., :, None] * ring_u[:, :, j, None, :]
    return states


def gdn_cases(rng, backend, tokens, rows, heads, dim=128, width=8, drafts=3):
    value_heads = 2 * heads
    pool = rng.standard_normal((2 * rows + 1, value_heads, dim, dim), np.float32) * 0.1
    slots, ones = np.arange(1, rows + 1, dtype=np.int32), np.ones(rows, bool)
    device = Pools(pool)
    state_bytes = rows * value_heads * dim * dim * 4 * 2  # fp32 state read and written once per row
    prefill_tokens = _gdn_tokens(rng, tokens, heads, value_heads, dim)
    cu = _rows([tokens // rows] * rows)
    yield Case(
        "gdn_prefill", f"T={tokens} R={rows} HV={value_heads} K=V={dim}",
        lambda: device.call(lambda p: gdn_prefill(*prefill_tokens, cu, p, slots, ones, backend=backend)),
        lambda: np_gdn(*prefill_tokens, cu, pool[slots]), tokens,
    )  # fmt: skip
    decode_tokens, cu1 = _gdn_tokens(rng, rows, heads, value_heads, dim), _rows([1] * rows)
    yield Case(
        "gdn_decode", f"R={rows} HV={value_heads}",
        lambda: device.call(lambda p: gdn_decode(*decode_tokens, cu1, p, slots, backend=backend)),
        lambda: np_gdn(*decode_tokens, cu1, pool[slots]), rows, state_bytes,
    )  # fmt: skip
    verify_tokens, cuv = _gdn_tokens(rng, rows * (1 + drafts), heads, value_heads, dim), _rows([1 + drafts] * rows)
    rings = (
        rng.standard_normal((2 * rows + 1, heads, width, dim), np.float32),
        rng.standard_normal((2 * rows + 1, value_heads, width, dim), np.float32),
        -rng.exponential(0.1, (2 * rows + 1, value_heads, width)).astype(np.float32),
    )
    with_rings = Pools(pool, *rings)
    for flush in (False, True):
        committed = np.full(rows, 4, np.int32)
        trackers = (slots, np.zeros(rows, np.int32), committed, np.full(rows, flush))
        verify = lambda *pools, t=trackers: gdn_verify(*verify_tokens, cuv, *pools, *t, backend=backend)
        yield Case(
            f"gdn_verify ({'flush' if flush else 'no write'})", f"R={rows} T/row={1 + drafts} W={width} committed=4",
            lambda v=verify: with_rings.call(v),
            lambda: np_gdn(*verify_tokens, cuv, pool[slots]),  # sequential decoding of the same tokens
            rows * (1 + drafts), state_bytes // (1 if flush else 2),
        )  # fmt: skip
    dst, starts, entries = slots + rows, np.zeros(rows, np.int32), np.full(rows, width // 2, np.int32)
    yield Case(
        "gdn_materialize", f"M={rows} entries={width // 2}",
        lambda: with_rings.call(
            lambda sp, *r: (None, gdn_materialize(sp, *r, slots, dst, starts, entries, backend=backend), *r)
        ),
        lambda: np_fold_gdn_ring(pool[slots], *(r[slots] for r in rings), 2, width // 2), rows, state_bytes,
    )  # fmt: skip


def np_fold_ssd_ring(states, ring_x, ring_dt, ring_b, a, group, num_entries):
    """h <- e^{dt A} h + dt x (x) B for each of the first entries (ring_start 0)."""
    states = states.copy()
    for j in range(num_entries):
        dt, b = ring_dt[:, :, j], np.repeat(ring_b[:, :, j], group, 1)
        states = np.exp(dt * a)[..., None, None] * states + (dt[..., None] * ring_x[:, :, j])[..., None] * b[:, :, None]
    return states


def ssd_cases(rng, backend, tokens, rows, heads, head_dim=64, state=128, groups=8, width=8, drafts=3):
    a = -np.exp(rng.uniform(-1, 1, heads)).astype(np.float32)
    d = rng.standard_normal(heads).astype(np.float32)
    pool = rng.standard_normal((2 * rows + 1, heads, head_dim, state), np.float32) * 0.1
    slots, ones = np.arange(1, rows + 1, dtype=np.int32), np.ones(rows, bool)
    device = Pools(pool)
    state_bytes = rows * heads * head_dim * state * 4 * 2

    def tokens_of(n):
        x, dt = rng.standard_normal((n, heads, head_dim), np.float32), rng.uniform(0.001, 0.1, (n, heads))
        b, c = rng.standard_normal((2, n, groups, state), np.float32)
        return x, dt.astype(np.float32), b, c

    x, dt, b, c = tokens_of(tokens)
    cu = _rows([tokens // rows] * rows)
    yield Case(
        "ssd_prefill", f"T={tokens} R={rows} NH={heads} P={head_dim} N={state}",
        lambda: device.call(lambda p: ssd_prefill(x, dt, a, b, c, d, cu, p, slots, ones, backend=backend)),
        lambda: np_ssd(x, dt, a, b, c, d, cu, pool[slots]), tokens,
    )  # fmt: skip
    x1, dt1, b1, c1 = tokens_of(rows)
    cu1 = _rows([1] * rows)
    yield Case(
        "ssd_decode", f"R={rows} NH={heads}",
        lambda: device.call(lambda p: ssd_decode(x1, dt1, a, b1, c1, d, cu1, p, slots, backend=backend)),
        lambda: np_ssd(x1, dt1, a, b1, c1, d, cu1, pool[slots]), rows, state_bytes,
    )  # fmt: skip
    xv, dtv, bv, cv = tokens_of(rows * (1 + drafts))
    cuv = _rows([1 + drafts] * rows)
    rings = (
        rng.standard_normal((2 * rows + 1, heads, width, head_dim), np.float32),
        rng.uniform(0.001, 0.1, (2 * rows + 1, heads, width)).astype(np.float32),
        rng.standard_normal((2 * rows + 1, groups, width, state), np.float32),
    )
    with_rings = Pools(pool, *rings)
    trackers = (slots, np.zeros(rows, np.int32), np.full(rows, 4, np.int32), np.zeros(rows, bool))
    yield Case(
        "ssd_verify (no write)", f"R={rows} T/row={1 + drafts} W={width} committed=4",
        lambda: with_rings.call(lambda *p: ssd_verify(xv, dtv, a, bv, cv, d, cuv, *p, *trackers, backend=backend)),
        lambda: np_ssd(xv, dtv, a, bv, cv, d, cuv, pool[slots]), rows * (1 + drafts), state_bytes // 2,
    )  # fmt: skip
    dst, starts, entries = slots + rows, np.zeros(rows, np.int32), np.full(rows, width // 2, np.int32)
    yield Case(
        "ssd_materialize", f"M={rows} entries={width // 2}",
        lambda: with_rings.call(
            lambda sp, *r: (None, ssd_materialize(sp, *r, a, slots, dst, starts, entries, backend=backend), *r)
        ),
        lambda: np_fold_ssd_ring(pool[slots], *(r[slots] for r in rings), a, heads // groups, width // 2), rows,
        state_bytes,
    )  # fmt: skip


def attention_case(rng, backend, prefill, rows, context=1024, block=16, q_heads=16, kv_heads=2, dim=256):
    lengths = [prefill] + [1] * (rows - 1)  # one prefill chunk + decode rows in one call
    cu, tokens, per_row = _rows(lengths), sum(lengths), context // block
    tables = (1 + np.arange(rows * per_row, dtype=np.int32)).reshape(rows, per_row)
    k_pool, v_pool = rng.standard_normal((2, rows * per_row + 1, block, kv_heads, dim)).astype(np.float32)
    positions = np.concatenate([np.arange(context - n, context) for n in lengths])
    row_of = np.repeat(np.arange(rows), lengths)
    slot_mapping = (tables[row_of, positions // block] * block + positions % block).astype(np.int32)
    q = rng.standard_normal((tokens, q_heads, dim), np.float32)
    k, v = rng.standard_normal((2, tokens, kv_heads, dim)).astype(np.float32)
    context_lens = np.array([context - n for n in lengths], np.int32)  # cached before this step
    scale = dim**-0.5
    keys = [k_pool[tables[r]].reshape(context, kv_heads, dim) for r in range(rows)]
    values = [v_pool[tables[r]].reshape(context, kv_heads, dim) for r in range(rows)]
    device = Pools(k_pool, v_pool)
    attend = lambda kp, vp: ragged_paged_attention(
        q, k, v, kp, vp, slot_mapping, tables, cu, context_lens, scale=scale, backend=backend
    )
    shape = f"prefill {prefill} + {rows - 1} decode, ctx={context} HQ={q_heads} HKV={kv_heads} Dh={dim}"
    baseline = lambda: np_attention(q, keys, values, cu, np.full(rows, context), scale)
    return Case("ragged_paged_attention", shape, lambda: device.call(attend), baseline, tokens)


def _plot(records, backend, path):
    with figure(path, figsize=(9, 0.4 * len(records) + 1.5)) as (fig, ax):
        ops = [r["op"] for r in records]
        ax.barh(ops, [r["numpy_ms"] / r["ms"] for r in records], color="tab:blue")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"speed-up of the {backend} backend over the NumPy baseline (same run)")
        ax.invert_yaxis()


TARGETS = {"hbm": 0.60, "tensor": 0.35}


def run_roofline(args) -> None:
    from roofline import model_cases, plot, roofline_fraction  # benchmarks/ is sys.path[0]
    from tqdm import tqdm

    if jax.default_backend() != "gpu" and args.kernel_backend != "interpret":
        raise SystemExit("--gpu needs a CUDA device (or --kernel-backend interpret for a CPU smoke run)")
    print(f"{'op':<18} {'shape':<58} {'kernel ms':>10} {'xla ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'roofline':>8} "
          f"{'xla roof':>8} {'target':>7}")
    records = []
    for case in tqdm(model_cases(args.dtype, divide=args.divide), desc="kernels", leave=False):
        seconds = {b: median_ms(case.call(b), args.repeats) / 1e3 for b in (args.kernel_backend, "reference")}
        kernel_s, xla_s = seconds[args.kernel_backend], seconds["reference"]
        fraction, xla_fraction = (roofline_fraction(case.flops, case.bytes, s) for s in (kernel_s, xla_s))
        target = TARGETS.get(case.target)
        verdict = "" if target is None else ("met" if fraction >= target else f"<{target:.0%}")
        print(f"{case.op:<18} {case.shape:<58} {1e3 * kernel_s:>10.3f} {1e3 * xla_s:>9.3f} "
              f"{case.flops / kernel_s / 1e12:>8.1f} {case.bytes / kernel_s / 1e9:>7.0f} {fraction:>8.1%} "
              f"{xla_fraction:>8.1%} {verdict:>7}")
        records.append(dict(op=case.op, shape=case.shape, flops=case.flops, bytes=case.bytes, kernel_s=kernel_s,
                            reference_s=xla_s, kernel_tflops=case.flops / kernel_s / 1e12,
                            reference_tflops=case.flops / xla_s / 1e12, roofline=fraction,
                            reference_roofline=xla_fraction, target=target))
    meta = dict(device=str(jax.devices()[0]), dtype=args.dtype, kernel_backend=args.kernel_backend,
                divide=args.divide)
    out = write_results(f"kernels_{jax.default_backend()}_roofline", records, meta)
    plot(records, out.with_suffix(".png"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="reference | pallas | interpret (default: per platform)")
    parser.add_argument("--scale", type=int, default=1, help="divide heads and tokens by this (quick runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="model shapes, Pallas vs XLA, H200 roofline")
    parser.add_argument("--dtype", default="bfloat16", help="(--gpu) activation dtype")
    parser.add_argument("--kernel-backend", default="pallas", help="(--gpu) interpret: a CPU smoke run")
    parser.add_argument("--divide", type=int, default=1, help="(--gpu) divide tokens, batch and context")
    args = parser.parse_args()
    if args.gpu:
        return run_roofline(args)
    rng, s = np.random.default_rng(0), args.scale
    cases = [
        *conv_case(rng, args.backend, 512 // s, 4),
        *gdn_cases(rng, args.backend, 512 // s, 4, 16 // s),
        *ssd_cases(rng, args.backend, 512 // s, 4, 128 // s),
        attention_case(rng, args.backend, 256 // s, 16),
    ]
    backend = args.backend or ("pallas" if jax.default_backend() == "gpu" else "reference")
    on_gpu = jax.default_backend() == "gpu"
    print(f"{'op':<26} {'shape':<58} {backend + ' ms':>13} {'numpy ms':>9} {'speed-up':>9} {'tok/s':>10} "
          f"{'state GB/s':>10}" + (f" {'HBM %':>6}" if on_gpu else ""))
    records = []
    for case in cases:
        ms, np_ms = median_ms(case.run, args.repeats), median_ms(case.baseline, args.repeats)
        gbps = case.state_bytes / ms / 1e6
        line = (f"{case.op:<26} {case.shape:<58} {ms:>13.2f} {np_ms:>9.2f} {np_ms / ms:>8.1f}x "
                f"{case.tokens / ms * 1e3:>10.0f} {gbps:>10.1f}")
        if on_gpu and case.state_bytes:
            line += f" {100 * gbps * 1e9 / H200_HBM_BYTES_PER_S:>5.1f}%"
        print(line)
        records.append(dict(op=case.op, shape=case.shape, backend=backend, ms=ms, numpy_ms=np_ms,
                            tokens_per_s=case.tokens / ms * 1e3, state_gb_per_s=gbps))
    out = write_results(f"kernels_{jax.default_backend()}", records, dict(device=str(jax.devices()[0]), scale=s))
    _plot(records, backend, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
