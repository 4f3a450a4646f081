"""The engine's whole jitted step compiled for an H100/H200 without a GPU, at a preset's real sizes.

For each preset, TP size, MTP K and ReplaySSM window W (0: the snapshot baseline), the engine is built as
`build_engine` builds it on a GPU over ABSTRACT params (`abstract_params`: ShapeDtypeStructs, nothing allocated):
`builder.scheduler_config` sizes the pools (`size_pools`) for `gpu_memory_utilization` of the target's HBM
less the weights and less the largest step's temporaries (`runner.step_temporaries`, one extra compile).
Its step is compiled (`Runner.lower`) for every bucket the engine compiles
(`plan_shapes`). At TP > 1 the step is compiled for a multi-device deviceless topology ("1x1x<tp>").

The device's memory is what jax's allocator holds, as the engine reads it (`memory_stats()["bytes_limit"]`):
`--mem-fraction` (XLA_CLIENT_MEM_FRACTION, XLA's default 0.75) of the target's HBM, not measured here.
Per bucket: compile ok or the error, seconds, and XLA's `memory_analysis()` per device (arguments,
outputs, aliased (donated) bytes, temporaries, generated code) and the peak against that limit.
Exits 1 on a compile error or a peak over the limit.

Needs the CUDA plugin (docs/kernels.md, "Compile check without a GPU"):
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/aot_step.py --preset nemotron_h_8b_base_8k
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import scheduler_config
from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import Model, abstract_params
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.tensor_parallel import AXIS
from jaxhybrid.worker.buckets import plan_shapes
from jaxhybrid.worker.memory import param_bytes, pool_budget
from jaxhybrid.worker.runner import Runner, step_temporaries
from pallas_kernels import aot
from scheduler.config import SchedulerConfig

PRESETS = Path(__file__).parents[1] / "configs" / "models"
GiB = 2**30
BUCKETS = {"all": lambda shapes: shapes, "extremes": lambda shapes: [shapes[0], shapes[-1]],
           "smallest": lambda shapes: shapes[:1], "largest": lambda shapes: shapes[-1:]}


class Setup(NamedTuple):
    preset: str
    tp: int
    k: int  # MTP drafts
    window: int  # ReplaySSM W; 0: the snapshot baseline

    def __str__(self) -> str:
        return f"{self.preset} tp{self.tp} K{self.k} W{self.window}"


class BucketResult(NamedTuple):
    setup: Setup
    bucket: tuple[int, int, int, int]  # (T, R, B, L)
    seconds: float
    memory: dict | None = None  # per device, bytes
    error: str | None = None

    @property
    def peak(self) -> int:
        """Bytes live at once on a device: the arguments, the outputs not aliased to donated arguments,
        temporaries and the generated code."""
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]

    def fits(self, limit: int) -> bool:
        return self.error is None and self.peak <= limit

    def line(self, limit: int) -> str:
        t, r, b, logits = self.bucket
        where = f"{self.setup!s:<44} T{t:<5} R{r:<4} B{b:<5} L{logits:<5} {self.seconds:6.1f} s"
        if self.error is not None:
            return f"{where}  COMPILE ERROR {self.error}"
        m = {name: value / GiB for name, value in self.memory.items()}
        verdict = "ok" if self.fits(limit) else "DOES NOT FIT"
        return (f"{where}  args {m['argument']:7.2f}  out {m['output']:7.2f}  alias {m['alias']:7.2f}  "
                f"temp {m['temp']:6.2f}  code {m['generated_code']:5.3f}  peak {self.peak / GiB:7.2f} / "
                f"{limit / GiB:.2f} GiB  {verdict}")


def device_limit(target: str, args: argparse.Namespace) -> int:
    """Bytes jax's allocator holds on one device of `target`: its `bytes_limit`."""
    return int(args.mem_fraction * aot.DEVICE_MEMORY[target])


def memory(compiled: jax.stages.Compiled) -> dict:
    analysis = compiled.memory_analysis()
    return dict(argument=analysis.argument_size_in_bytes, output=analysis.output_size_in_bytes,
                alias=analysis.alias_size_in_bytes, temp=analysis.temp_size_in_bytes,
                generated_code=analysis.generated_code_size_in_bytes)


def build_runner(setup: Setup, target: str, args: argparse.Namespace,
                 resize: Callable[[SchedulerConfig], SchedulerConfig] | None = None, cfg: ModelConfig | None = None,
                 scan_layers: bool = True) -> tuple[Runner, jax.sharding.Mesh, str]:
    """The engine's runner for `setup` on `target` over abstract params, and how its pools were sized.
    `benchmarks/estimate.py` passes `resize` (replaces the sized config: pools of the fewest pages), `cfg` (the
    model, in place of the preset's) and `scan_layers=False` (XLA's cost analysis counts a loop's body once)."""
    cfg, dtype = cfg or load_config(PRESETS / f"{setup.preset}.yaml"), jnp.dtype(args.dtype)
    topology = aot.topology_mesh(target, setup.tp, AXIS)
    params = abstract_params(cfg, dtype)
    if setup.tp == 1:  # one device: the params live on it, as the engine's do (no mesh)
        replicated = jax.sharding.NamedSharding(topology, jax.sharding.PartitionSpec())
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated), params)
    mesh = topology if setup.tp > 1 else None
    budget = pool_budget(args.gpu_memory_utilization, device_limit(target, args), param_bytes(params, cfg, mesh))
    mtp = {"method": "mtp", "num_speculative_tokens": setup.k} if setup.k else None
    engine_args = EngineArgs(tensor_parallel_size=setup.tp, speculative_config=mtp, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                             replayssm_window=setup.window, backend="pallas")
    ops = ModelOps(backend="pallas", scan_layers=scan_layers)
    model = Model(cfg, params, ops=ops, block_size=engine_args.block_size)

    def temporaries(config: SchedulerConfig) -> int:  # as build_engine measures them on a GPU
        with aot.lowering_for(target, topology):
            return step_temporaries(model, config, mesh)

    # pools resized after sizing need no room measured for them
    config = scheduler_config(engine_args, cfg, lambda: budget, dtype=dtype,
                              step_temporaries=temporaries if resize is None else None)
    config = config if resize is None else resize(config)
    pools = (f"budget {budget / GiB:.2f} GiB: {config.num_blocks} KV blocks, {config.num_state_slots} state slots, "
             f"max_num_seqs {config.max_num_seqs}, max_model_len {config.max_model_len}")
    return Runner(model, config, mesh=mesh), topology, pools


def check(runner: Runner, topology: jax.sharding.Mesh, setup: Setup, target: str, bucket) -> BucketResult:
    start = time.perf_counter()
    try:
        with aot.lowering_for(target, topology):
            compiled = runner.lower(bucket).compile()
    except Exception as error:  # noqa: BLE001 - a step that does not compile is a result, and fails the run
        message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        return BucketResult(setup, bucket, time.perf_counter() - start, error=message)
    return BucketResult(setup, bucket, time.perf_counter() - start, memory(compiled))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    presets = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    parser.add_argument("--preset", nargs="+", required=True, choices=presets)
    parser.add_argument("--tp", nargs="+", type=int, default=(1,), help="tensor-parallel sizes")
    parser.add_argument("--k", nargs="+", type=int, default=(0,), help="MTP drafts (presets without MTP: 0 only)")
    parser.add_argument("--window", nargs="+", type=int, default=(16,), help="ReplaySSM W; 0: snapshot baseline")
    parser.add_argument("--target", default="h200", choices=tuple(aot.TARGETS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--mem-fraction", type=float, default=0.75, help="XLA_CLIENT_MEM_FRACTION: allocator's share")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096, help="the engine's default is the model's own")
    parser.add_argument("--buckets", default="all", choices=tuple(BUCKETS),
                        help="all the engine compiles, its smallest and largest (the memory peak), or one of them")
    parser.add_argument("--unrolled", action="store_true",
                        help="every repeat of a layer segment its own copy in the program, not one scan over them")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args()
    limit, results, lines = device_limit(args.target, args), [], []
    for preset in args.preset:
        for tp in args.tp:
            for k in args.k:
                for window in args.window:
                    setup = Setup(preset, tp, k, window)
                    try:
                        runner, topology, pools = build_runner(setup, args.target, args, scan_layers=not args.unrolled)
                    except ValueError as error:  # pools that cannot hold one request: a plan that does not fit
                        lines.append(f"{setup!s:<44} NO PLAN: {error}")
                        print(lines[-1], flush=True)
                        results.append(BucketResult(setup, (0, 0, 0, 0), 0.0, error=f"no plan: {error}"))
                        continue
                    lines.append(f"{setup!s:<44} {args.target} {args.dtype}, {pools}")
                    print(lines[-1], flush=True)
                    for bucket in BUCKETS[args.buckets](plan_shapes(runner.config)):
                        results.append(check(runner, topology, setup, args.target, bucket))
                        lines.append(results[-1].line(limit))
                        print(lines[-1], flush=True)
    failed = sum(not r.fits(limit) for r in results)
    lines.append(f"{len(results)} buckets, {failed} failed, {sum(r.seconds for r in results):.0f} s compiling")
    print(lines[-1])
    if args.json:
        args.json.write_text(json.dumps([dict(setup=r.setup._asdict(), bucket=r.bucket, seconds=round(r.seconds, 2),
                                              memory=r.memory, error=r.error, fits=r.fits(limit)) for r in results],
                                        indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
