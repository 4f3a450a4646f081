"""The model's GEMMs alone: XLA:CPU (what jaxhybrid's step runs) against torch's oneDNN (what vLLM's CPU build
runs), at the shapes of decode steps (batch 1, 16, 64) and of a 1024-token prefill step.

Every weight a step multiplies with is a GEMM: the Dense kernels `[T, in] x [in, out]`, the expert stacks in the
layout `plan_experts` picks for T tokens (capacity: `[E, C, in] x [E, in, out]`; tiles: `[tiles, tile, in]`), and
the LM head at the step's logits rows. Each GEMM runs CHAIN times with distinct operands in one call (XLA: one
jit; torch: a loop), so neither side's dispatch is counted; the fastest of REPEATS calls counts (other work on a
shared VM only slows a call), and the step's total is the sum over its GEMMs.
torch runs in the Python given by `--torch-python` (vLLM's venv; never a dependency of this project), with as
many threads as this machine has cores. `vs_vllm.py` runs this in the same run as the engines.

Prints a table, writes benchmarks/results/gemm_floor.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHAIN, REPEATS = 8, 20
STEPS = {"decode_b1": (2, 2), "decode_b16": (16, 16), "decode_b64": (64, 64), "prefill_1024": (1024, 16)}


def model_gemms(config, tokens: int, logits_rows: int) -> list[dict]:
    """One step's GEMMs over `tokens` tokens of a model of `config`: [{name, count, batch, m, k, n}]."""
    import jax
    import jax.numpy as jnp

    from jaxhybrid.models.experts import ExpertWeights, plan_experts
    from jaxhybrid.models.model import abstract_params

    gemms: dict[tuple, dict] = {}

    def add(name: str, batch: int, m: int, k: int, n: int, count: int) -> None:
        key = (name, batch, m, k, n)
        gemms.setdefault(key, dict(name=name, count=0, batch=batch, m=m, k=k, n=n))["count"] += count

    # a segment of repeating layers stacks its layers' weights on a leading axis: `repeats` GEMMs of one shape
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(config, jnp.bfloat16)):
        names = [str(getattr(p, "key", p)) for p in path]
        if names[-1] in ("kernel", "router"):  # a Dense layer (named by its module) or the router
            name = names[-2] if names[-1] == "kernel" else "router"
            *stack, k, n = leaf.shape
            add(name, 0, logits_rows if name == "lm_head" else tokens, k, n, math.prod(stack))
        elif names[-1] in ("up_proj", "gate_proj", "down_proj") and leaf.ndim >= 3:
            *stack, experts, k, n = leaf.shape
            weights = jax.ShapeDtypeStruct((experts, k, n), leaf.dtype)
            plan = plan_experts(tokens, config.moe.top_k, ExpertWeights(weights, weights, weights), "cpu")
            groups, rows = (experts, plan.capacity) if plan.capacity else (plan.num_tiles, plan.tile)
            add(f"experts.{names[-1]}", groups, rows, k, n, math.prod(stack))
    return list(gemms.values())


def time_xla(gemm: dict) -> float:
    """Seconds per GEMM in XLA:CPU, bf16."""
    import jax
    import jax.numpy as jnp

    batch = (gemm["batch"],) if gemm["batch"] else ()
    keys = jax.random.split(jax.random.key(0), 2 * CHAIN)  # separate arrays: slicing one stack would copy
    xs = [jax.random.normal(key, (*batch, gemm["m"], gemm["k"]), jnp.bfloat16) for key in keys[:CHAIN]]
    ws = [jax.random.normal(key, (*batch, gemm["k"], gemm["n"]), jnp.bfloat16) for key in keys[CHAIN:]]
    chain = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
    return fastest(lambda: jax.block_until_ready(chain(xs, ws))) / CHAIN


def time_torch(gemms: list[dict]) -> list[float]:
    """Seconds per GEMM in torch (run in the torch Python): `torch.matmul`, bf16, as many threads as cores."""
    import torch

    torch.set_num_threads(os.cpu_count())
    seconds = []
    for gemm in gemms:
        batch = (gemm["batch"],) if gemm["batch"] else ()
        xs = [torch.randn(*batch, gemm["m"], gemm["k"], dtype=torch.bfloat16) for _ in range(CHAIN)]
        ws = [torch.randn(*batch, gemm["k"], gemm["n"], dtype=torch.bfloat16) for _ in range(CHAIN)]
        seconds.append(fastest(lambda xs=xs, ws=ws: [torch.matmul(x, w) for x, w in zip(xs, ws, strict=True)]) / CHAIN)
    return seconds


def fastest(call) -> float:
    """Seconds of the fastest of REPEATS calls, after one to warm up (and compile)."""
    call()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def run(directory: Path, torch_python: str) -> list[dict]:
    """A row per step: its GEMMs' milliseconds in XLA and in torch, and the ratio."""
    from jaxhybrid.models.hf_config import load_config

    config = load_config(directory)
    steps = {step: model_gemms(config, *shape) for step, shape in STEPS.items()}
    every = [gemm for gemms in steps.values() for gemm in gemms]
    with tempfile.TemporaryDirectory() as tmp:  # one torch process for every step's GEMMs
        spec = Path(tmp) / "gemms.json"
        spec.write_text(json.dumps(every))
        torch_s = json.loads(subprocess.run([torch_python, __file__, "torch", str(spec)], check=True,
                                            capture_output=True, text=True).stdout)
    for gemm, t in zip(every, torch_s, strict=True):
        gemm |= {"xla_us": time_xla(gemm) * 1e6, "torch_us": t * 1e6}
    rows = []
    for step, gemms in steps.items():
        xla_ms = sum(g["count"] * g["xla_us"] for g in gemms) / 1e3
        torch_ms = sum(g["count"] * g["torch_us"] for g in gemms) / 1e3
        rows.append(dict(step=step, tokens=STEPS[step][0], xla_ms=xla_ms, torch_ms=torch_ms,
                         xla_over_torch=xla_ms / torch_ms, gemms=gemms))
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'step':14s} {'XLA:CPU ms':>10s} {'torch ms':>9s} {'ratio':>6s}   slowest GEMMs in XLA against torch")
    for row in rows:
        worst = sorted(row["gemms"], key=lambda g: g["count"] * (g["torch_us"] - g["xla_us"]))[:2]
        names = ", ".join(f"{g['name']} {g['m']}x{g['k']}x{g['n']} {g['xla_us']:.0f}/{g['torch_us']:.0f} us"
                          for g in worst)
        print(f"{row['step']:14s} {row['xla_ms']:10.2f} {row['torch_ms']:9.2f} {row['xla_over_torch']:6.2f}   {names}")


def main() -> None:
    if sys.argv[1:2] == ["torch"]:  # the torch side, in the torch Python
        print(json.dumps(time_torch(json.loads(Path(sys.argv[2]).read_text()))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-python", required=True, help="a Python with torch (vLLM's venv)")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint whose GEMMs to time")
    args = parser.parse_args()
    from common import write_results  # benchmarks/ is sys.path[0]

    rows = run(Path(args.checkpoint), args.torch_python)
    report(rows)
    write_results("gemm_floor", rows, {"torch_python": args.torch_python})


if __name__ == "__main__":
    main()
