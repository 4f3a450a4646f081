"""Block sizes and warps by measurement: time each Pallas op's candidate launch parameters at model shapes and
record the fastest per shape class in pallas_kernels/tunings/<device>.yaml (read back by pallas_kernels.tuning), merged
into what earlier sweeps recorded.

Shapes are those of `kernels.py --gpu` at TP 1 (Qwen3-Next-80B-A3B and Nemotron-H-8B); shape classes are
head dims, which TP does not change. Before a candidate is timed, the compile check of
`benchmarks/aot_kernels.py` (`pallas_kernels.aot`) compiles its op at the same presets' shapes for this GPU and
drops it on a compile error, a register spill, or registers or shared memory over the limit; drops are counted.
`--kernel-backend interpret --divide 64` is a CPU smoke run (no compile check); it prints but writes nothing.
"""

from __future__ import annotations

import argparse
import copy
import itertools
from pathlib import Path

import jax
import yaml
from aot_kernels import KernelCase, all_cases
from kernels import median_ms
from roofline import model_cases
from tqdm import tqdm

from pallas_kernels import aot, tuning


def grid(**axes) -> list[dict]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


WARPS = dict(num_warps=(2, 4, 8), num_stages=(1, 2))
# op (the public function, as pallas_kernels.tuning knows it) -> candidates; cases name the op they time.
CANDIDATES = {
    "conv1d_prefill": grid(block_t=(16, 32, 64), block_d=(64, 128, 256), **WARPS),
    "gdn_prefill": grid(state_block_v=(16, 32, 64), output_block_v=(32, 64), **WARPS),
    "gdn_decode": grid(block_v=(16, 32, 64), **WARPS),
    "gdn_verify": grid(block_v=(16, 32, 64), **WARPS),
    "gdn_materialize": grid(block_v=(16, 32, 64), **WARPS),
    "ssd_prefill": grid(block_p=(16, 32, 64), block_t=(16, 32, 64), state_parts=(1, 2), **WARPS),
    "ssd_decode": grid(block_p=(16, 32, 64), **WARPS),
    "ssd_verify": grid(block_p=(16, 32, 64), **WARPS),
    "ssd_materialize": grid(block_p=(16, 32, 64), **WARPS),
    "ragged_paged_attention": grid(block_m=(16, 32, 64), **WARPS),
}
TIMED_OP = {"attention_prefill": "ragged_paged_attention", "attention_decode": "ragged_paged_attention"}
PRESETS = ("qwen3_next_80b_a3b_instruct", "nemotron_h_8b_base_8k")  # the models of roofline.model_cases


def compile_checks(dtype: str) -> dict[tuple[str, str], KernelCase]:
    """The compile check's case for each (op, shape class) at the sweep's presets, TP 1."""
    checks = {}
    for case in all_cases(PRESETS, (1,), (dtype,)):
        op = TIMED_OP.get(case.op, case.op)
        jax.eval_shape(case.fn, *case.specs)  # the op asks tuning for its shape class
        checks.setdefault((op, tuning.asked[op]), case)
    return checks


def compiles_cleanly(check: KernelCase | None) -> bool:
    """Whether the current launch parameters compile for this GPU without spills or limits exceeded."""
    if check is None:  # interpret mode: nothing is compiled for a GPU
        return True
    try:
        kernels = aot.compile_kernels(check.fn, check.specs, target=None)
    except Exception:  # noqa: BLE001 - a candidate that does not compile is a measured "no"
        return False
    return not any(k.problems() for k in kernels)


def sweep(case, op: str, backend: str, repeats: int, check: KernelCase | None) -> tuple[dict, float, int]:
    """(fastest candidate, its seconds, candidates dropped by the compile check or failing to run)."""
    best, best_s, failed = None, float("inf"), 0
    for params in CANDIDATES[op]:
        with tuning.override(op, **params):
            if not compiles_cleanly(check):
                failed += 1
                continue
            try:
                seconds = median_ms(case.call(backend), repeats) / 1e3
            except Exception:  # noqa: BLE001 - a candidate that does not run is a measured "no"
                failed += 1
                continue
        if seconds < best_s:
            best, best_s = params, seconds
    return best, best_s, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernel-backend", default="pallas")
    parser.add_argument("--divide", type=int, default=1)
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and args.kernel_backend != "interpret":
        raise SystemExit("the sweep needs a CUDA device (or --kernel-backend interpret for a CPU smoke run)")
    # earlier sweeps' other classes stay; a copy, since the recorded table is cached for the ops
    table = copy.deepcopy(tuning.recorded(jax.devices()[0].device_kind)) if on_gpu else {}
    checks = compile_checks(args.dtype) if args.kernel_backend == "pallas" else {}
    for case in tqdm(model_cases(args.dtype, tp_sizes=(1,), divide=args.divide), desc="sweep", leave=False):
        op = TIMED_OP.get(case.op, case.op)
        jax.block_until_ready(case.call(args.kernel_backend)())  # at the defaults: the op asks for its shape class
        shape_class = tuning.asked[op]
        check = checks[op, shape_class] if checks else None  # every Pallas case has its check
        best, seconds, failed = sweep(case, op, args.kernel_backend, args.repeats, check)
        print(f"{op:<24} {shape_class:<28} {case.shape:<56} {1e3 * seconds:9.3f} ms  {best}  ({failed} dropped)")
        if best is not None:
            table.setdefault(op, {})[shape_class] = best
            if on_gpu:  # after every case, so that a sweep cut short by a time limit keeps what it measured
                record(table, args.dtype)


def record(table: dict, dtype: str) -> None:
    device = jax.devices()[0].device_kind
    path = Path(tuning.CONFIGS) / tuning.device_file(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Measured by benchmarks/tune_kernels.py on {device}, jax {jax.__version__}, {dtype}.\n"
    path.write_text(header + yaml.safe_dump(table, sort_keys=True))


if __name__ == "__main__":
    main()
