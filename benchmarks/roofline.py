"""Kernel cases at real model shapes, with the FLOPs and HBM bytes of each call: the sum of its kernels'
CostEstimates (`pallas_kernels/*/cost.py`, read from the op's jaxpr by `pallas_kernels.cost.kernel_cost`).

Used by `kernels.py --gpu`. Shapes come from the presets in configs/models (Qwen3-Next-80B-A3B for GDN and
gated attention, Nemotron-H-8B for Mamba2, conv1d and GQA attention), with heads divided by the
tensor-parallel size as each rank sees them (KV heads replicated when tp exceeds them, as vLLM does).
Activations are in `dtype`; recurrent states and rings are f32, as in the engine's pools.

A case's roofline fraction is its achieved rate over the rate the roofline allows at its arithmetic
intensity: flops / time / min(peak, AI x bandwidth), i.e. the bandwidth fraction for memory-bound ops and
the tensor-core fraction for compute-bound ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from common import figure  # benchmarks/ is sys.path[0]

from jaxhybrid.models.hf_config import load_config
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import conv1d_prefill
from pallas_kernels.cost import kernel_cost
from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill, gdn_verify
from pallas_kernels.mamba2 import ssd_decode, ssd_materialize, ssd_prefill, ssd_verify

PRESETS = Path(__file__).parents[1] / "configs" / "models"
H200 = dict(bf16_flops=989e12, hbm_bytes=4.8e12)


class Case(NamedTuple):
    op: str
    shape: str
    call: object  # backend -> (() -> result): the public op, pools threaded from call to call
    flops: float
    bytes: float
    target: str  # "hbm" (>= 60% bandwidth), "tensor" (>= 35% bf16 peak) or "" (reported only)


def roofline_fraction(flops: float, bytes_moved: float, seconds: float, peak=H200) -> float:
    attainable = min(peak["bf16_flops"], flops / bytes_moved * peak["hbm_bytes"])
    return flops / seconds / attainable


def threaded(op, pools):
    """backend -> (() -> result): `op(backend, *pools)` returns (..., *new pools); each call gets the pools
    the previous call returned, as the engine's step does, since the ops donate them. Each backend starts
    from its own copy."""

    def make(backend):
        held = [jnp.array(p, copy=True) for p in pools]

        def call():
            result = op(backend, *held)
            held[:] = result[len(result) - len(held):]
            return result

        return call

    return make


def kernel_case(op: str, shape: str, call, pools, target: str) -> Case:
    """A Case of `call(backend, *pools)` whose FLOPs and bytes are its kernels' CostEstimates at these shapes
    (traced in interpret mode: the same pallas_calls, nothing run)."""
    estimate = kernel_cost(jax.make_jaxpr(lambda *p: call("interpret", *p))(*pools))
    return Case(op, shape, threaded(call, pools), estimate.flops, estimate.bytes_accessed, target)


def _rows(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class Inputs:
    """Random inputs: activations in `dtype`, everything recurrent in f32."""

    def __init__(self, dtype, seed=0):
        self.rng, self.dtype = np.random.default_rng(seed), jnp.dtype(dtype)

    def act(self, *shape, scale=1.0):
        return jnp.asarray(self.rng.standard_normal(shape, np.float32) * scale, self.dtype)

    def f32(self, *shape, scale=1.0):
        return jnp.asarray(self.rng.standard_normal(shape, np.float32) * scale)

    def decay(self, *shape):
        return jnp.asarray(-self.rng.exponential(0.1, shape).astype(np.float32))

    def unit(self, *shape, low=0.0, high=1.0):
        return jnp.asarray(self.rng.uniform(low, high, shape).astype(np.float32))


def _per_rank(heads: int, tp: int) -> int:
    return max(1, heads // tp)


def conv_cases(inputs: Inputs, model: str, conv_dim: int, kernel: int, tokens: int):
    x, weight = inputs.act(tokens, conv_dim), inputs.act(conv_dim, kernel, scale=0.5)
    pool, cu, slots, ones = inputs.act(2, kernel - 1, conv_dim), _rows([tokens]), np.ones(1, np.int32), np.ones(1, bool)
    yield kernel_case("conv1d_prefill", f"{model} T={tokens} D={conv_dim}",
                      lambda b, p: conv1d_prefill(x, weight, None, cu, p, slots, ones, backend=b), [pool], "")


def gdn_cases(inputs: Inputs, model: str, cfg, tp: int, tokens: int, batch: int, width=8, drafts=3):
    """Rings of E = W + 1 + K entries; verify rows commit W / 2 of them and materialize folds E // 2, as the
    kernels' estimates assume (`pallas_kernels.estimates.folded_entries`)."""
    h, hv = _per_rank(cfg.num_k_heads, tp), _per_rank(cfg.num_v_heads, tp)
    dk, dv = cfg.head_k_dim, cfg.head_v_dim
    shape = f"{model} tp{tp} H={h} HV={hv}"

    def tokens_of(n):
        return (inputs.act(n, h, dk), inputs.act(n, h, dk), inputs.act(n, hv, dv), inputs.decay(n, hv),
                inputs.unit(n, hv))  # fmt: skip

    pool = inputs.f32(2 * batch + 1, hv, dk, dv, scale=0.1)
    slots, ones = np.arange(1, batch + 1, dtype=np.int32), np.ones(batch, bool)
    prefill = tokens_of(tokens)
    yield kernel_case(
        "gdn_prefill", f"{shape} T={tokens}",
        lambda b, p: gdn_prefill(*prefill, _rows([tokens]), p, slots[:1], ones[:1], backend=b), [pool], "tensor",
    )  # fmt: skip
    decode = tokens_of(batch)
    yield kernel_case("gdn_decode", f"{shape} R={batch}",
                      lambda b, p: gdn_decode(*decode, _rows([1] * batch), p, slots, backend=b), [pool], "hbm")
    verify, entries = tokens_of(batch * (1 + drafts)), width + 1 + drafts
    rings = (inputs.f32(2 * batch + 1, h, entries, dk), inputs.f32(2 * batch + 1, hv, entries, dv),
             inputs.decay(2 * batch + 1, hv, entries))  # fmt: skip
    committed = width // 2
    trackers = (slots, np.zeros(batch, np.int32), np.full(batch, committed, np.int32), np.zeros(batch, bool))
    yield kernel_case(
        "gdn_verify", f"{shape} R={batch} T/row={1 + drafts} committed={committed}",
        lambda b, *p: gdn_verify(*verify, _rows([1 + drafts] * batch), *p, *trackers, backend=b), [pool, *rings],
        "hbm",
    )  # fmt: skip
    dst, starts, live = slots + batch, np.zeros(batch, np.int32), np.full(batch, entries // 2, np.int32)
    yield kernel_case(
        "gdn_materialize", f"{shape} M={batch} entries={entries // 2}",
        lambda b, p: (gdn_materialize(p, *rings, slots, dst, starts, live, backend=b),), [pool], "hbm",
    )  # fmt: skip


def ssd_cases(inputs: Inputs, model: str, cfg, tp: int, tokens: int, batch: int, width=8, drafts=3):
    """Rings and committed entries as `gdn_cases`."""
    nh, g = _per_rank(cfg.num_heads, tp), _per_rank(cfg.n_groups, tp)
    p, n = cfg.head_dim, cfg.state_size
    shape = f"{model} tp{tp} NH={nh} G={g}"
    a, d = -jnp.exp(inputs.unit(nh, low=-1.0)), inputs.f32(nh)

    def tokens_of(m):
        return inputs.act(m, nh, p), inputs.unit(m, nh, low=0.001, high=0.1), inputs.act(m, g, n), inputs.act(m, g, n)

    pool = inputs.f32(2 * batch + 1, nh, p, n, scale=0.1)
    slots, ones = np.arange(1, batch + 1, dtype=np.int32), np.ones(batch, bool)
    x, dt, bb, cc = tokens_of(tokens)
    yield kernel_case(
        "ssd_prefill", f"{shape} T={tokens}",
        lambda b, p: ssd_prefill(x, dt, a, bb, cc, d, _rows([tokens]), p, slots[:1], ones[:1], backend=b), [pool],
        "tensor",
    )  # fmt: skip
    x1, dt1, b1, c1 = tokens_of(batch)
    yield kernel_case("ssd_decode", f"{shape} R={batch}",
                      lambda b, p: ssd_decode(x1, dt1, a, b1, c1, d, _rows([1] * batch), p, slots, backend=b), [pool],
                      "hbm")
    xv, dtv, bv, cv = tokens_of(batch * (1 + drafts))
    entries = width + 1 + drafts
    rings = (inputs.f32(2 * batch + 1, nh, entries, p), inputs.unit(2 * batch + 1, nh, entries, low=0.001, high=0.1),
             inputs.f32(2 * batch + 1, g, entries, n))  # fmt: skip
    committed = width // 2
    trackers = (slots, np.zeros(batch, np.int32), np.full(batch, committed, np.int32), np.zeros(batch, bool))
    yield kernel_case(
        "ssd_verify", f"{shape} R={batch} T/row={1 + drafts} committed={committed}",
        lambda b, *p: ssd_verify(xv, dtv, a, bv, cv, d, _rows([1 + drafts] * batch), *p, *trackers, backend=b),
        [pool, *rings], "hbm",
    )  # fmt: skip
    dst, starts, live = slots + batch, np.zeros(batch, np.int32), np.full(batch, entries // 2, np.int32)
    yield kernel_case(
        "ssd_materialize", f"{shape} M={batch} entries={entries // 2}",
        lambda b, p: (ssd_materialize(p, *rings, a, slots, dst, starts, live, backend=b),), [pool], "hbm",
    )  # fmt: skip


def attention_cases(inputs: Inputs, model: str, cfg, tp: int, tokens: int, batch: int, context: int, block=16):
    """Rows that end at their block table's span, as the kernel's estimate assumes (`attention/cost.py`)."""
    hq, hkv, dh = _per_rank(cfg.num_heads, tp), _per_rank(cfg.num_kv_heads, tp), cfg.head_dim
    shape = f"{model} tp{tp} HQ={hq} HKV={hkv} Dh={dh}"

    def case(op, new_tokens, rows, total, target):  # `rows` rows of `new_tokens` each, `total` tokens after
        per_row = -(-total // block)
        tables = (1 + np.arange(rows * per_row, dtype=np.int32)).reshape(rows, per_row)
        k_pool, v_pool = (inputs.act(rows * per_row + 1, block, hkv, dh) for _ in range(2))
        positions = np.tile(np.arange(total - new_tokens, total), rows)
        row_of = np.repeat(np.arange(rows), new_tokens)
        slot_mapping = (tables[row_of, positions // block] * block + positions % block).astype(np.int32)
        q, k, v = inputs.act(rows * new_tokens, hq, dh), *(inputs.act(rows * new_tokens, hkv, dh) for _ in range(2))
        context_lens, cu = np.full(rows, total - new_tokens, np.int32), _rows([new_tokens] * rows)
        return kernel_case(
            op, f"{shape} {new_tokens} x{rows} ctx={total}",
            lambda b, kp, vp: ragged_paged_attention(q, k, v, kp, vp, slot_mapping, tables, cu, context_lens,
                                                     scale=dh**-0.5, backend=b),
            [k_pool, v_pool], target,
        )  # fmt: skip

    yield case("attention_prefill", tokens, 1, tokens, "")
    yield case("attention_decode", 1, batch, context, "hbm")


def model_cases(dtype, tokens=8192, batch=64, context=8192, tp_sizes=(1, 4), divide=1):
    """Every op at Qwen3-Next-80B-A3B and Nemotron-H-8B shapes; `divide` shrinks tokens/batch/context
    for a smoke run on CPU (interpret mode)."""
    qwen = load_config(PRESETS / "qwen3_next_80b_a3b_instruct.yaml")
    nemotron = load_config(PRESETS / "nemotron_h_8b_base_8k.yaml")
    tokens, batch, context = tokens // divide, max(1, batch // divide), context // divide
    inputs = Inputs(dtype)
    for tp in tp_sizes:
        gdn_conv = (2 * qwen.gdn.num_k_heads * qwen.gdn.head_k_dim + qwen.gdn.num_v_heads * qwen.gdn.head_v_dim) // tp
        m = nemotron.mamba2
        ssd_conv = (m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size) // tp
        yield from conv_cases(inputs, f"Qwen3-Next tp{tp}", gdn_conv, qwen.gdn.conv_kernel, tokens)
        yield from conv_cases(inputs, f"Nemotron-H tp{tp}", ssd_conv, m.conv_kernel, tokens)
        yield from gdn_cases(inputs, "Qwen3-Next", qwen.gdn, tp, tokens, batch)
        yield from ssd_cases(inputs, "Nemotron-H", m, tp, tokens, batch)
        yield from attention_cases(inputs, "Qwen3-Next", qwen.attention, tp, tokens, batch, context)
        yield from attention_cases(inputs, "Nemotron-H", nemotron.attention, tp, tokens, batch, context)


def plot(records, path: Path, peak=H200) -> None:
    """Log-log roofline: each case's kernel (filled) and XLA reference (hollow) at its arithmetic intensity."""
    with figure(path, figsize=(10, 6.5)) as (fig, ax):
        intensity = np.logspace(-1, 4, 200)
        ax.plot(intensity, np.minimum(peak["bf16_flops"], intensity * peak["hbm_bytes"]) / 1e12, "k-", linewidth=1,
                label="H200 roofline (989 TFLOP/s bf16, 4.8 TB/s)")
        colours = {}
        for r in records:
            new = r["op"] not in colours
            colour = colours.setdefault(r["op"], f"C{len(colours) % 10}")
            ai = r["flops"] / r["bytes"]
            ax.scatter(ai, r["kernel_tflops"], color=colour, label=r["op"] if new else None)
            ax.scatter(ai, r["reference_tflops"], facecolors="none", edgecolors=colour)
        ax.legend(fontsize=7, loc="lower right")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte, the kernels' CostEstimates)")
        ax.set_ylabel("achieved TFLOP/s (filled: Pallas kernel, hollow: XLA reference)")
        ax.grid(True, which="both", alpha=0.3)
