"""The CPU FFI GDN kernels (pallas_kernels/gdn/cpu) against the XLA reference, per call of one layer's op.

Ops: `gdn_decode` (a row's state read, advanced by one token, written back) and `gdn_verify` as the engine runs
it on CPU without MTP (W = 1: each row folds the one committed entry, flushes it into its state and verifies one
token). Shapes: Qwen3-Next-80B's GDN layer (16 qk heads, 32 value heads, dk = dv = 128) whole and at TP 4, and the
embedded default model's (2, 4, 32); batches 1, 16 and 64. The floor is XLA scaling the rows' states in place, one
read and one write of every byte, on the same threads. Prints a table and writes benchmarks/results/gdn_ffi.json.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from common import write_results  # benchmarks/ is sys.path[0]
from kernels import Pools, median_ms

from pallas_kernels import cpu_ffi
from pallas_kernels.gdn import gdn_decode, gdn_verify

SHAPES = {"qwen3-next-80b": (16, 32, 128, 128), "qwen3-next-80b tp4": (4, 8, 128, 128), "embedded": (2, 4, 32, 32)}
BATCHES = (1, 16, 64)


def _inputs(rng, shape, batch):
    h, hv, k, v = shape
    tokens = (rng.standard_normal((batch, h, k), np.float32), rng.standard_normal((batch, h, k), np.float32),
              rng.standard_normal((batch, hv, v), np.float32), -rng.exponential(0.3, (batch, hv)).astype(np.float32),
              rng.uniform(0, 1, (batch, hv)).astype(np.float32))
    slots = rng.permutation(np.arange(1, batch + 1)).astype(np.int32)
    state = 0.1 * rng.standard_normal((batch + 1, hv, k, v), np.float32)
    rings = (rng.standard_normal((batch + 1, h, 2, k), np.float32),  # E = W + 1 = 2 entries
             rng.standard_normal((batch + 1, hv, 2, v), np.float32),
             -rng.exponential(0.3, (batch + 1, hv, 2)).astype(np.float32))
    return tokens, np.arange(batch + 1, dtype=np.int32), slots, state, rings


def _floor_ms(state, slots, repeats: int) -> float:
    """One read and one write of every byte of the rows' states, by XLA on its threads: a donated in-place scale."""
    rows, scale = Pools(state[slots]), jax.jit(lambda s: s * 2.0, donate_argnums=0)
    return median_ms(lambda: rows.call(lambda s: (None, scale(s))), repeats)


def run_case(name, shape, batch, repeats, rng):
    tokens, cu, slots, state, rings = _inputs(rng, shape, batch)
    trackers = (slots, np.zeros(batch, np.int32), np.ones(batch, np.int32), np.ones(batch, bool))
    row = {"shape": name, "H": shape[0], "HV": shape[1], "K": shape[2], "V": shape[3], "batch": batch,
           "state_mb": state[1:].nbytes / 2**20, "floor_ms": _floor_ms(state, slots, repeats)}
    for backend in ("reference", "ffi"):
        decode = Pools(state)
        row[f"decode_{backend}_ms"] = median_ms(
            lambda d=decode, b=backend: d.call(gdn_decode, *tokens, cu, slots=slots, backend=b), repeats)
        verify = Pools(state, *rings)
        row[f"verify_{backend}_ms"] = median_ms(
            lambda p=verify, b=backend: p.call(lambda *a, **kw: gdn_verify(*a, *trackers, **kw), *tokens, cu,
                                               backend=b), repeats)
    for op in ("decode", "verify"):
        row[f"{op}_speedup"] = row[f"{op}_reference_ms"] / row[f"{op}_ffi_ms"]
        row[f"{op}_ffi_vs_floor"] = row[f"{op}_ffi_ms"] / row["floor_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    args = parser.parse_args()
    if not cpu_ffi.available():
        raise SystemExit(f"the CPU FFI kernels cannot be built: {cpu_ffi.unavailable_reason()}")
    rng = np.random.default_rng(0)
    rows = [run_case(name, SHAPES[name], batch, args.repeats, rng) for name in args.shapes for batch in args.batches]
    print(f"{'shape':<20}{'batch':>6}{'MiB':>8}{'floor':>8}{'decode ref':>12}{'ffi':>8}{'x':>6}"
          f"{'verify ref':>12}{'ffi':>8}{'x':>6}  (ms)")
    for r in rows:
        print(f"{r['shape']:<20}{r['batch']:>6}{r['state_mb']:>8.1f}{r['floor_ms']:>8.2f}"
              f"{r['decode_reference_ms']:>12.2f}{r['decode_ffi_ms']:>8.2f}{r['decode_speedup']:>6.1f}"
              f"{r['verify_reference_ms']:>12.2f}{r['verify_ffi_ms']:>8.2f}{r['verify_speedup']:>6.1f}")
    write_results("gdn_ffi", rows, {"repeats": args.repeats})


if __name__ == "__main__":
    main()
