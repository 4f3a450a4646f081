"""The CPU FFI kernels (pallas_kernels/cpu_ffi.py) against the XLA reference, per call of one layer's op.

Ops: each recurrent mixer's decode (a row's state read, advanced by one token, written back) and its verify as
the engine runs it on CPU without MTP (W = 1: each row folds the one committed entry, flushes it into its state
and verifies one token). Shapes, batches 1, 16 and 64:
  gdn (H, HV, K, V): Qwen3-Next-80B's GDN layer (16, 32, 128, 128) whole and at TP 4, the embedded model's;
  ssd (NH, P, G, N): Nemotron-3-Nano-30B-A3B's Mamba2 layer (64, 64, 8, 128) and Nemotron-H-8B's (128, 64, 8, 128).
The floor is XLA scaling the rows' states in place, one read and one write of every byte, on the same threads.
Prints a table and writes benchmarks/results/cpu_kernels.json.

`--prefill` instead times each shape's prefill of one layer: a 1,024-token step of 8 fresh rows of 128 tokens
(vs_vllm.py's prompts), the reference's chunked form against the kernel's token recurrence; it writes
benchmarks/results/cpu_kernels_prefill.json.

`--experts` instead times the routed experts of 8 MoE layers of vs_vllm.py's checkpoint's shape (8 experts of
512 -> 256, SwiGLU, top 2, bf16, distinct weights per layer), chained in one jit, at 1, 16, 64 and 1,024 tokens: XLA's
layouts (`jaxhybrid.models.experts`) against the FFI kernel (`pallas_kernels.moe.cpu`), one after the other, with the
largest difference of their outputs; it writes benchmarks/results/cpu_kernels_experts.json.

`--matmuls` instead times vs_vllm.py's checkpoint's bf16 projection shapes at 2, 16, 64 and 512 rows, 8 distinct
weights of each in turn (as a layer stack reads them): XLA's dot against the kernel on packed weights
(`pallas_kernels.matmul.cpu`); it writes benchmarks/results/cpu_kernels_matmuls.json.

`--engine DIR` instead times the engine on a Qwen3-Next checkpoint (vs_vllm.py's), bf16, in two settings
(`--modes`, of: reference, `--cpu-kernels reference`; ffi, `--cpu-kernels ffi`; reference_unrolled and
ffi_unrolled, those with `--no-scan-layers`) built side by side in one process (prefill buckets of 1,024 tokens
only) and run alternately (A B A B): greedy generation of 64 tokens after prompts of 128 at batches 1, 16 and 64,
fresh prompts each time (vs_vllm.py's gen jobs). Writes benchmarks/results/cpu_kernels_engine_{A}_{B}.json.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peer_work as peer
from common import write_results  # benchmarks/ is sys.path[0]
from kernels import Pools, median_ms

from jaxhybrid import LLM
from jaxhybrid.models.experts import ExpertWeights, routed_experts
from pallas_kernels import cpu_ffi
from pallas_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify
from pallas_kernels.mamba2 import ssd_decode, ssd_prefill, ssd_verify
from pallas_kernels.matmul import cpu as matmul_cpu
from pallas_kernels.moe import cpu as experts_cpu

SHAPES = {
    "qwen3-next-80b": ("gdn", (16, 32, 128, 128)), "qwen3-next-80b tp4": ("gdn", (4, 8, 128, 128)),
    "embedded": ("gdn", (2, 4, 32, 32)), "vs_vllm 40m": ("gdn", (4, 8, 64, 64)),
    "nemotron-3-nano": ("ssd", (64, 64, 8, 128)), "nemotron-h-8b": ("ssd", (128, 64, 8, 128)),
}
BATCHES = (1, 16, 64)
RING = 2  # E = W + 1 entries
PREFILL_ROWS, PREFILL_LEN = 8, 128


def _gdn_inputs(rng, shape, batch, num_tokens=None):
    """`num_tokens` (default `batch`) tokens, and the state pool and rings of `batch` rows on slots 1..batch (slot 0
    the null slot)."""
    h, hv, k, v = shape
    t = num_tokens or batch
    tokens = (rng.standard_normal((t, h, k), np.float32), rng.standard_normal((t, h, k), np.float32),
              rng.standard_normal((t, hv, v), np.float32), -rng.exponential(0.3, (t, hv)).astype(np.float32),
              rng.uniform(0, 1, (t, hv)).astype(np.float32))
    state = 0.1 * rng.standard_normal((batch + 1, hv, k, v), np.float32)
    rings = (rng.standard_normal((batch + 1, h, RING, k), np.float32),
             rng.standard_normal((batch + 1, hv, RING, v), np.float32),
             -rng.exponential(0.3, (batch + 1, hv, RING)).astype(np.float32))
    return tokens, state, rings


def _ssd_inputs(rng, shape, batch, num_tokens=None):
    nh, p, g, n = shape
    t = num_tokens or batch
    tokens = (rng.standard_normal((t, nh, p), np.float32), rng.uniform(0.01, 0.5, (t, nh)).astype(np.float32),
              -np.exp(rng.uniform(-1, 1, nh)).astype(np.float32), rng.standard_normal((t, g, n), np.float32),
              rng.standard_normal((t, g, n), np.float32), rng.standard_normal(nh).astype(np.float32))
    state = 0.1 * rng.standard_normal((batch + 1, nh, p, n), np.float32)
    rings = (rng.standard_normal((batch + 1, nh, RING, p), np.float32),
             rng.uniform(0.01, 0.5, (batch + 1, nh, RING)).astype(np.float32),
             rng.standard_normal((batch + 1, g, RING, n), np.float32))
    return tokens, state, rings


OPS = {"gdn": (_gdn_inputs, gdn_decode, gdn_verify, gdn_prefill),
       "ssd": (_ssd_inputs, ssd_decode, ssd_verify, ssd_prefill)}


def _floor_ms(state, slots, repeats: int) -> float:
    """One read and one write of every byte of the rows' states, by XLA on its threads: a donated in-place scale."""
    rows, scale = Pools(state[slots]), jax.jit(lambda s: s * 2.0, donate_argnums=0)
    return median_ms(lambda: rows.call(lambda s: (None, scale(s))), repeats)


def run_case(name, batch, repeats, rng):
    family, shape = SHAPES[name]
    make_inputs, decode_op, verify_op, _ = OPS[family]
    tokens, state, rings = make_inputs(rng, shape, batch)
    cu, slots = np.arange(batch + 1, dtype=np.int32), rng.permutation(np.arange(1, batch + 1)).astype(np.int32)
    trackers = (slots, np.zeros(batch, np.int32), np.ones(batch, np.int32), np.ones(batch, bool))
    row = {"shape": name, "op": family, "dims": list(shape), "batch": batch, "state_mb": state[1:].nbytes / 2**20,
           "floor_ms": _floor_ms(state, slots, repeats)}
    for backend in ("reference", "ffi"):
        decode = Pools(state)
        row[f"decode_{backend}_ms"] = median_ms(
            lambda d=decode, b=backend: d.call(decode_op, *tokens, cu, slots=slots, backend=b), repeats)
        verify = Pools(state, *rings)
        row[f"verify_{backend}_ms"] = median_ms(
            lambda p=verify, b=backend: p.call(lambda *a, **kw: verify_op(*a, *trackers, **kw), *tokens, cu,
                                               backend=b), repeats)
    for op in ("decode", "verify"):
        row[f"{op}_speedup"] = row[f"{op}_reference_ms"] / row[f"{op}_ffi_ms"]
        row[f"{op}_ffi_vs_floor"] = row[f"{op}_ffi_ms"] / row["floor_ms"]
    return row


def run_prefill_case(name, repeats, rng):
    """One layer's prefill of PREFILL_ROWS fresh rows of PREFILL_LEN tokens, reference and kernel."""
    family, shape = SHAPES[name]
    make_inputs, *_, prefill_op = OPS[family]
    tokens, state, _ = make_inputs(rng, shape, PREFILL_ROWS, PREFILL_ROWS * PREFILL_LEN)
    cu = np.arange(PREFILL_ROWS + 1, dtype=np.int32) * PREFILL_LEN
    slots, fresh = np.arange(1, PREFILL_ROWS + 1, dtype=np.int32), np.zeros(PREFILL_ROWS, bool)
    row = {"shape": name, "op": family, "dims": list(shape), "rows": PREFILL_ROWS, "tokens": int(cu[-1])}
    for backend in ("reference", "ffi"):
        pools = Pools(state)
        row[f"prefill_{backend}_ms"] = median_ms(
            lambda p=pools, b=backend: p.call(lambda *a, **kw: prefill_op(*a, slots, fresh, **kw), *tokens, cu,
                                              backend=b), repeats)
    row["prefill_speedup"] = row["prefill_reference_ms"] / row["prefill_ffi_ms"]
    return row


def prefill_table(shapes: list[str], repeats: int) -> None:
    rng = np.random.default_rng(0)
    rows = [run_prefill_case(name, repeats, rng) for name in shapes]
    print(f"{'shape':<20}{'tokens':>8}{'reference':>11}{'ffi':>8}{'x':>6}  (ms; {os.cpu_count()} cores)")
    for r in rows:
        print(f"{r['shape']:<20}{r['tokens']:>8}{r['prefill_reference_ms']:>11.2f}{r['prefill_ffi_ms']:>8.2f}"
              f"{r['prefill_speedup']:>6.1f}")
    write_results("cpu_kernels_prefill", rows, {"repeats": repeats})


EXPERT_LAYERS, EXPERT_TOKENS = 8, (1, 16, 64, 1024)


def _chained(path, x, weights, experts, layers):
    for params in layers:
        x = x + path(x, weights, experts, params)
    return x


def experts_rows(repeats: int) -> list[dict]:
    """ms per call of EXPERT_LAYERS chained MoE layers' routed experts, XLA's layouts against the kernel."""
    key = jax.random.key(0)
    num_experts, dim, inter = 8, 512, 256
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * shape[1] ** -0.5
    layers = [ExpertWeights(normal(3 * i, (num_experts, dim, inter)), normal(3 * i + 1, (num_experts, inter, dim)),
                            normal(3 * i + 2, (num_experts, dim, inter))) for i in range(EXPERT_LAYERS)]
    packed = [ExpertWeights(*map(matmul_cpu.pack, (p.up, p.down, p.gate))) for p in layers]  # as the runner packs
    paths = {"xla": (lambda x, w, e, p: routed_experts(x, w, e, p, jax.nn.silu), layers),
             "ffi": (lambda x, w, e, p: experts_cpu.routed_experts(x, w, e, p.up, p.down, p.gate), packed)}
    rows = []
    for tokens in EXPERT_TOKENS:
        keys = jax.random.split(jax.random.fold_in(key, tokens), 3)
        x = jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16)
        first = jax.random.randint(keys[1], (tokens,), 0, num_experts)
        experts = jnp.stack([first, (first + jax.random.randint(keys[2], (tokens,), 1, num_experts)) % num_experts], 1)
        weights = jax.random.uniform(keys[2], (tokens, 2), jnp.float32)

        args = {name: (x, weights, experts, stack) for name, (_, stack) in paths.items()}
        calls = {name: jax.jit(functools.partial(_chained, path)) for name, (path, _) in paths.items()}
        outputs = {name: np.asarray(call(*args[name]), np.float32) for name, call in calls.items()}
        row = {"tokens": tokens, "layers": EXPERT_LAYERS,
               "max_abs_difference": float(np.abs(outputs["xla"] - outputs["ffi"]).max())}
        for name, call in calls.items():
            row[f"{name}_ms"] = median_ms(lambda c=call, a=args[name]: c(*a), repeats)
        row["speedup"] = row["xla_ms"] / row["ffi_ms"]
        rows.append(row)
        print(f"{tokens:>6} tokens: XLA {row['xla_ms']:8.2f} ms  FFI {row['ffi_ms']:8.2f} ms  x{row['speedup']:.2f}  "
              f"max |difference| {row['max_abs_difference']:.3g}  ({os.cpu_count()} cores)")
    return rows


# vs_vllm.py's checkpoint's projections (in, out): GDN in_proj_qkvz and out_proj, attention q_proj, the shared
# expert's up and down, the LM head
MATMUL_SHAPES = ((512, 1536), (512, 512), (512, 1024), (512, 256), (256, 512), (512, 4096))
MATMUL_ROWS = (2, 16, 64, 512)


def matmuls_rows(repeats: int) -> list[dict]:
    """ms per weight of EXPERT_LAYERS distinct weights of each projection shape, applied one after the other as a
    layer stack reads them (out of the caches between layers): XLA's dot against the kernel on packed weights."""
    key, rows = jax.random.key(1), []
    for dim, out in MATMUL_SHAPES:
        weights = [jax.random.normal(jax.random.fold_in(key, i), (dim, out), jnp.bfloat16) * dim**-0.5
                   for i in range(EXPERT_LAYERS)]
        paths = {"xla": (jnp.dot, weights), "ffi": (matmul_cpu.matmul, [matmul_cpu.pack(w) for w in weights])}
        for count in MATMUL_ROWS:
            x = jax.random.normal(jax.random.fold_in(key, count), (count, dim), jnp.bfloat16)
            calls = {name: jax.jit(lambda x, ws, f=f: [f(x, w) for w in ws]) for name, (f, _) in paths.items()}
            outputs = {name: np.asarray(calls[name](x, ws)[-1], np.float32) for name, (_, ws) in paths.items()}
            row = {"in": dim, "out": out, "rows": count, "weights": EXPERT_LAYERS,
                   "max_abs_difference": float(np.abs(outputs["xla"] - outputs["ffi"]).max())}
            for name, (_, ws) in paths.items():
                row[f"{name}_ms"] = median_ms(lambda c=calls[name], x=x, ws=ws: c(x, ws), repeats) / EXPERT_LAYERS
            row["speedup"] = row["xla_ms"] / row["ffi_ms"]
            row["ffi_gb_s"] = dim * out * 2 / row["ffi_ms"] / 1e6
            rows.append(row)
            print(f"{dim:>5} x {out:<5} {count:>4} rows: XLA {row['xla_ms'] * 1e3:7.0f} us  FFI "
                  f"{row['ffi_ms'] * 1e3:7.0f} us  x{row['speedup']:.2f}  {row['ffi_gb_s']:5.1f} GB/s  "
                  f"max |difference| {row['max_abs_difference']:.3g}  ({os.cpu_count()} cores)")
    return rows


ENGINE_MODES = {"reference": dict(cpu_kernels="reference"), "ffi": dict(cpu_kernels="ffi"),
                "reference_unrolled": dict(cpu_kernels="reference", scan_layers=False),
                "ffi_unrolled": dict(cpu_kernels="ffi", scan_layers=False)}


def engine_rows(checkpoint: Path, rounds: int, modes: list[str]) -> list[dict]:
    """Tokens/s of greedy generation per batch, each mode's best of `rounds`, the modes alternating; the speedup
    is the second mode's over the first's."""
    # vs_vllm.py's engine with fewer prefill buckets: both engines' compiled steps within the host's memory maps
    llms = {mode: LLM(str(checkpoint), dtype="bfloat16", skip_tokenizer_init=True, num_blocks=4096, num_state_slots=160,
                      max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512,
                      token_buckets=(2, 16, 64, 1024), row_buckets=(2, 16, 64), **ENGINE_MODES[mode])
            for mode in modes}
    for llm in llms.values():
        llm.engine.precompile(progress=False)
    vocab, rng = llms[modes[0]].model.config.vocab_size, np.random.default_rng(0)
    rows = []
    for batch in BATCHES:
        rates = {mode: [] for mode in llms}
        for _ in range(1 + rounds):  # the first round warms both up
            for mode, llm in llms.items():
                seconds, _ = peer.generate(llm, [peer.random_ids(rng, vocab, 128) for _ in range(batch)], 64)
                rates[mode].append(batch * 64 / seconds)
        best = {mode: max(values[1:]) for mode, values in rates.items()}
        rows.append({"batch": batch, **{f"{mode}_tok_s": rate for mode, rate in best.items()},
                     "rounds": {mode: values[1:] for mode, values in rates.items()},
                     "speedup": best[modes[1]] / best[modes[0]]})
        print(f"batch {batch:>3}: " + "  ".join(f"{mode} {best[mode]:8.1f}" for mode in modes) +
              f" tok/s  x{rows[-1]['speedup']:.2f}  ({os.cpu_count()} cores)")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--prefill", action="store_true", help="time one layer's 1,024-token prefill instead")
    parser.add_argument("--experts", action="store_true", help="time 8 MoE layers' routed experts instead")
    parser.add_argument("--matmuls", action="store_true", help="time the checkpoint's bf16 projections instead")
    parser.add_argument("--engine", type=Path, help="a Qwen3-Next checkpoint: time the engine A B A B instead")
    parser.add_argument("--rounds", type=int, default=2, help="with --engine: timed rounds per mode and batch")
    parser.add_argument("--modes", nargs=2, default=["reference", "ffi"], choices=list(ENGINE_MODES),
                        help="with --engine: the two settings timed")
    args = parser.parse_args()
    if not cpu_ffi.available():
        raise SystemExit(f"the CPU FFI kernels cannot be built: {cpu_ffi.unavailable_reason()}")
    if args.engine:
        write_results("_".join(["cpu_kernels_engine", *args.modes]), engine_rows(args.engine, args.rounds, args.modes),
                      {"checkpoint": str(args.engine), "modes": args.modes})
        return
    if args.experts:
        write_results("cpu_kernels_experts", experts_rows(args.repeats), {"repeats": args.repeats})
        return
    if args.matmuls:
        write_results("cpu_kernels_matmuls", matmuls_rows(args.repeats), {"repeats": args.repeats})
        return
    if args.prefill:
        prefill_table(args.shapes, args.repeats)
        return
    rng = np.random.default_rng(0)
    rows = [run_case(name, batch, args.repeats, rng) for name in args.shapes for batch in args.batches]
    print(f"{'shape':<20}{'batch':>6}{'MiB':>8}{'floor':>8}{'decode ref':>12}{'ffi':>8}{'x':>6}"
          f"{'verify ref':>12}{'ffi':>8}{'x':>6}  (ms; {os.cpu_count()} cores)")
    for r in rows:
        print(f"{r['shape']:<20}{r['batch']:>6}{r['state_mb']:>8.1f}{r['floor_ms']:>8.2f}"
              f"{r['decode_reference_ms']:>12.2f}{r['decode_ffi_ms']:>8.2f}{r['decode_speedup']:>6.1f}"
              f"{r['verify_reference_ms']:>12.2f}{r['verify_ffi_ms']:>8.2f}{r['verify_speedup']:>6.1f}")
    write_results("cpu_kernels", rows, {"repeats": args.repeats})


if __name__ == "__main__":
    main()
