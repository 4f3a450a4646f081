"""The engine's whole step for Nemotron-H-8B (random bf16 weights) on this GPU, at the buckets
`benchmarks/estimate.py` costs, next to the estimate's figure.

Run by `benchmarks/gpu_session.sh` on a lent H100/H200. The runner is the engine's `Runner` over random params
(`init_params`, bf16, Pallas kernels), its SchedulerConfig built as the estimate builds it (`aot_step.build_runner`
with the arguments recorded in benchmarks/results/estimate.json, so the same bucket ladders) with pools resized to
hold the plans measured here. Plans come from the scheduler's own `assemble`:

  decode   batch 1, 16, 64 and 256: each row's next token at position max_model_len - 1 (context 4096), its own
           blocks and state slot, W / 2 ReplaySSM entries committed (what the estimate's kernel costs assume)
  prefill  the largest token bucket (2,048) in rows of 64 tokens, from empty states (the estimate's prefill)

Per bucket: the first call (its compile, then one step), the step time with steps queued back to back, and the
estimate's step time for this GPU: its roofline over the nominal H100/H200 peaks (`estimate.PEAKS`, the figure in
estimate.txt) and over the copy bandwidth and GEMM rate measured in this run (`gpu_kernels.measure_peaks`). The
estimate's recorded bucket is shown where the ladders have since changed. Every finished bucket is written at once
(`--out`/gpu_step.json; benchmarks/results/gpu_step.json when run for real).

    PYTHONPATH=. python benchmarks/gpu_step.py --out "$OUT"              # on a GPU
    PYTHONPATH=. python benchmarks/gpu_step.py --dry-run --out /tmp/dry  # CPU: tiny_nemotron_h, reference ops
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, write_results  # benchmarks/ is sys.path[0]
from gpu_kernels import DRY, REAL, measure_peaks, per_call_seconds
from tqdm import tqdm

from benchmarks import aot_step
from benchmarks.estimate import MODELS, PEAKS, Stepper, model_config, step_seconds
from jaxhybrid.models.model import Model, init_params
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.tensor_parallel import AXIS
from jaxhybrid.sample.sampler import pack_row
from jaxhybrid.worker.runner import Runner
from pallas_kernels import aot
from pallas_kernels.cost import Cost
from scheduler import BatchPlan, SchedulerConfig
from scheduler.assemble import Copies, DecodeBatch, PrefillRow, assemble
from scheduler.replay import flush_flags
from scheduler.state import COMMITTED, INT_COLUMNS, LAST_TOKEN, NUM_COMPUTED, RUNNING_SLOT

ESTIMATE = Path(__file__).parent / "results" / "estimate.json"
PRESET = "nemotron_h_8b_base_8k"
# The dry run: the tiny model of the same family, few rows and positions, on CPU.
DRY_PRESET, DRY_ARGS = "tiny_nemotron_h", dict(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                                batch=[2], candidate=16)


class Bucket(NamedTuple):
    kind: str  # "decode" or "prefill"
    rows: int
    bucket: tuple[int, int, int, int]  # (T, R, B, L) as the estimate picks it
    plan: BatchPlan


def estimate_args(estimate: dict, dry_run: bool) -> argparse.Namespace:
    """The arguments the estimate ran with (its ladders and pool sizing), shrunk for the dry run."""
    return argparse.Namespace(**estimate["args"] | (DRY_ARGS if dry_run else {}))


def sized_config(setup: aot_step.Setup, args: argparse.Namespace, cfg, rows: int) -> SchedulerConfig:
    """The estimate's SchedulerConfig (`build_runner` sizing for an H200) with pools that hold `rows` rows of
    max_model_len positions each, on blocks and slots of their own. build_runner compiles for a deviceless
    topology; only its config is used here, so its abstract runner goes on this host's device."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (AXIS,))
    resize = lambda c: dataclasses.replace(c, num_blocks=1 + rows * c.block_table_buckets[-1], num_state_slots=1 + rows)
    with mock.patch.object(aot_step.aot, "topology_mesh", lambda *_, **__: mesh):
        runner, _, _ = aot_step.build_runner(setup, "h200", args, resize=resize, cfg=cfg)
    return runner.config


def decode_plan(config: SchedulerConfig, tables: tuple, batch: int, rng: np.random.Generator) -> BatchPlan:
    """`batch` decode rows, row i in slot 1 + i, each about to write position max_model_len - 1."""
    cols = np.zeros((len(INT_COLUMNS), batch), np.int32)
    cols[NUM_COMPUTED] = config.max_model_len - 1
    cols[RUNNING_SLOT] = 1 + np.arange(batch)
    cols[COMMITTED] = config.ring_size // 2
    cols[LAST_TOKEN] = rng.integers(1, 1000, batch)
    query = 1 + config.num_spec_tokens
    decode = DecodeBatch(np.arange(batch), [f"decode-{i}" for i in range(batch)], cols,
                         np.zeros((batch, config.num_spec_tokens), np.int32),
                         flush_flags(cols[COMMITTED], query, config.ring_size))
    return assemble(config, 0, decode, [], Copies([], [], [], []), *tables)


def prefill_plan(config: SchedulerConfig, tables: tuple, rows: int, row_tokens: int,
                 rng: np.random.Generator) -> BatchPlan:
    """`rows` first chunks of `row_tokens` tokens, row i in slot 1 + i, each ending its prefill (one logit)."""
    prefills = [PrefillRow(i, f"prefill-{i}", 0, rng.integers(1, 1000, row_tokens).astype(np.int32), 1, 2, False,
                           1 + i, np.zeros(0, np.int32)) for i in range(rows)]
    no_decode = DecodeBatch(np.zeros(0, np.int64), [], np.zeros((len(INT_COLUMNS), 0), np.int32),
                            np.zeros((0, config.num_spec_tokens), np.int32), np.zeros(0, bool))
    return assemble(config, 0, no_decode, prefills, Copies([], [], [], []), *tables)


def row_tables(config: SchedulerConfig, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scheduler state's per-row tables `assemble` reads: block tables (row i on blocks of its own, every row
    at the block-table bucket's full width), block counts and greedy sampling records."""
    width = config.block_table_buckets[-1]
    block_table = (1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width)
    row_data = np.frombuffer(pack_row(prompt_len=config.max_model_len), np.uint8)
    return block_table, np.full(rows, width, np.int32), np.tile(row_data, (rows, 1))


def buckets(setup: aot_step.Setup, config: SchedulerConfig, batches: list[int], candidate: int) -> list[Bucket]:
    """The estimate's buckets (`Stepper`'s choice, which reads only the set-up and its runner's config), each with
    a plan of real rows that fills it."""
    choice, rng = SimpleNamespace(setup=setup, runner=SimpleNamespace(config=config)), np.random.default_rng(0)
    prefill = Stepper.prefill_bucket(choice, candidate)
    rows = prefill[0] // candidate
    tables = row_tables(config, max(*batches, rows))
    decode = [Bucket("decode", b, Stepper.decode_bucket(choice, b), decode_plan(config, tables, b, rng))
              for b in sorted(batches, reverse=True)]
    prefill_item = Bucket("prefill", rows, prefill, prefill_plan(config, tables, rows, candidate, rng))
    # the largest batch and the prefill first: if the step's time runs out, the small batches are what is lost
    return [*decode[:1], prefill_item, *decode[1:]]


def plan_bucket(plan: BatchPlan) -> tuple[int, int, int, int]:
    return plan.token_bucket, plan.row_bucket, plan.block_table_bucket, plan.logits_bucket


def estimate_figures(estimate: dict, preset: str) -> dict[tuple[str, int], dict]:
    """The estimate's K = 0, W = 16 costs of `preset`: ("decode", batch) and ("prefill", 0) -> record."""
    model = next((r for r in estimate["results"] if r["preset"] == preset), None)
    if model is None:
        return {}
    found = {("decode", d["batch"]): d for d in model["decode"] if d["k"] == 0 and d["window"] == 16}
    return found | {("prefill", 0): model["prefill"]}


def estimate_ms(figure: dict, target: str | None, peaks: dict) -> dict:
    """The estimate's step time of a bucket: on this GPU's nominal peaks (estimate.txt's figure; where the estimate
    records it, also its expected time at published kernels' bandwidth) and on the peaks measured in this run."""
    cost = figure.get("cost_per_device", figure.get("cost"))
    cost = Cost(flops=cost["flops"], bytes_accessed=cost["bytes_accessed"])
    measured = dict(flops=peaks["gemm_flops"], bandwidth=peaks["copy_bandwidth"])
    found = dict(estimate_bucket=tuple(figure["bucket"]), estimate_ms_measured_peaks=1e3 * step_seconds(cost, measured))
    if target:
        recorded = figure.get("step_seconds", {}).get(target, {})
        found["estimate_ms"] = 1e3 * recorded.get("roofline", step_seconds(cost, PEAKS[target]))
        if "expected" in recorded:
            found["estimate_expected_ms"] = 1e3 * recorded["expected"]
    return found


def target_of(device: Any) -> str | None:
    """The estimate's target this device is ("h100", "h200"), or None."""
    return next((t for t, kind in aot.DEVICE_KINDS.items() if getattr(device, "device_kind", "") == kind), None)


def measure(runner: Runner, item: Bucket, figure: dict | None, target: str | None, peaks: dict) -> dict:
    record = dict(kind=item.kind, rows=item.rows, bucket=item.bucket, plan_bucket=plan_bucket(item.plan))
    if figure:
        record |= estimate_ms(figure, target, peaks)
    try:
        start = time.perf_counter()
        runner.step(item.plan)
        record["first_call_s"] = time.perf_counter() - start
        seconds, _ = per_call_seconds(lambda: runner.dispatch(item.plan), runner.fetch, min_seconds=0.2)
    except Exception as error:  # noqa: BLE001 - a bucket that fails (memory, compile) is a result
        record["error"] = f"{type(error).__name__}: {error}"[:500]
        traceback.print_exc()
        try:
            runner.reset_state()  # the failed step may have consumed the donated pools
        except Exception as reset_error:  # noqa: BLE001 - the next buckets then record their own errors
            record["error"] += f"; fresh pools failed too: {type(reset_error).__name__}: {reset_error}"[:300]
        return record
    tokens = item.plan.num_tokens if item.kind == "prefill" else item.rows
    return record | dict(step_ms=1e3 * seconds, tokens_per_s=tokens / seconds)


def row(r: dict) -> str:
    where = f"{r['kind']:<8} {r['rows']:>5} {str(r['plan_bucket']):<22}"
    if "error" in r:
        return f"{where} ERROR {r['error']}"
    est = lambda key: f"{r[key]:>9.2f}" if key in r else f"{'-':>9}"
    ratio = f"{r['step_ms'] / r['estimate_ms']:>7.2f}" if "estimate_ms" in r else f"{'-':>7}"
    estimated = r.get("estimate_bucket", r["plan_bucket"])
    changed = "" if estimated == r["plan_bucket"] else f"  (the estimate costed {estimated})"
    return (f"{where} {r['first_call_s']:>8.1f} {r['step_ms']:>9.2f} {r['tokens_per_s']:>10.0f} {est('estimate_ms')} "
            f"{est('estimate_expected_ms')} {est('estimate_ms_measured_peaks')} {ratio}{changed}")


# est. ms: the estimate's roofline on this GPU's nominal peaks; expected: at published kernels' bandwidth;
# @meas: the roofline on this run's measured copy bandwidth and GEMM rate; x est.: measured / est. ms
HEADER = (f"{'step':<8} {'rows':>5} {'bucket (T, R, B, L)':<22} {'first s':>8} {'ms/step':>9} {'tok/s':>10} "
          f"{'est. ms':>9} {'expected':>9} {'est.@meas':>9} {'x est.':>7}")


class Writer(NamedTuple):
    out: Path | None
    real: bool
    meta: dict

    def __call__(self, records: list[dict]) -> None:
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_step.json").write_text(json.dumps(dict(meta=machine() | self.meta, results=records),
                                                               indent=1))
        if self.real:
            write_results("gpu_step", records, self.meta)


def checked_figures(estimate: dict, path: Path) -> dict[tuple[str, int], dict]:
    """`estimate_figures` of Nemotron-H-8B, which must hold every bucket the real run measures."""
    figures = estimate_figures(estimate, PRESET)
    missing = [b for b in estimate["args"]["batch"] if ("decode", b) not in figures]
    if missing or ("prefill", 0) not in figures:
        raise SystemExit(f"{path} has no K=0 W=16 figure of {PRESET} for decode batches {missing} or its prefill")
    return figures


def random_runner(setup: aot_step.Setup, eargs: argparse.Namespace, backend: str) -> tuple[Runner, float]:
    """The engine's runner over random params of the set-up's preset, and the seconds the params took (one jitted
    init: the f32 draws are cast on the device as they are made)."""
    cfg, dtype = model_config(setup.preset, 0), jnp.dtype(eargs.dtype)
    start = time.perf_counter()
    params = jax.block_until_ready(jax.jit(functools.partial(init_params, cfg, 0, dtype))())
    init_s = time.perf_counter() - start
    config = sized_config(setup, eargs, cfg, max(*eargs.batch, eargs.max_num_batched_tokens // eargs.candidate))
    return Runner(Model(cfg, params, ops=ModelOps(backend=backend), block_size=config.block_size), config), init_s


def run(args: argparse.Namespace) -> list[dict]:
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.dry_run:
        raise SystemExit("needs a CUDA GPU (or --dry-run: tiny_nemotron_h on CPU)")
    estimate = json.loads(args.estimate.read_text())
    figures, eargs = checked_figures(estimate, args.estimate), estimate_args(estimate, args.dry_run)
    preset, backend = (DRY_PRESET, "reference") if args.dry_run else (PRESET, "pallas")
    setup, target = aot_step.Setup(preset, MODELS[PRESET], 0, 16), target_of(device)
    peaks = measure_peaks(DRY if args.dry_run else REAL)
    runner, init_s = random_runner(setup, eargs, backend)
    config, items = runner.config, buckets(setup, runner.config, eargs.batch, eargs.candidate)
    write = Writer(args.out, not args.dry_run, dict(
        device=str(device), target=target, preset=preset, dtype=eargs.dtype, backend=backend, peaks=peaks,
        params_init_s=init_s, num_blocks=config.num_blocks, num_state_slots=config.num_state_slots,
        max_model_len=config.max_model_len, estimate_label=estimate.get("label")))
    print(f"{preset} on {device} ({target or 'no estimate target'}): random {eargs.dtype} params in {init_s:.1f} s, "
          f"{config.num_blocks} KV blocks, {config.num_state_slots} state slots\n{HEADER}", flush=True)
    records = []
    # the dry run steps its first bucket only (each compile takes seconds on CPU); every plan was built above
    for item in tqdm(items[:1] if args.dry_run else items, desc="buckets", unit="bucket"):
        figure = figures.get((item.kind, item.rows if item.kind == "decode" else 0)) if preset == PRESET else None
        records.append(measure(runner, item, figure, target, peaks))
        tqdm.write(row(records[-1]))
        write(records)
    ordered = sorted(records, key=lambda r: (r["kind"] == "prefill", r["rows"]))  # as the estimate's table
    print("\n".join([HEADER, *map(row, ordered)]))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimate", type=Path, default=ESTIMATE, help="the estimate's JSON (its args and costs)")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") and Path(os.environ["OUT"]),
                        help="also write gpu_step.json here (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny_nemotron_h, few rows, the reference ops")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
