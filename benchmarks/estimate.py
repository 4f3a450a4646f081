"""Roofline ESTIMATE of the engine's step on an H200 or H100, per device: XLA's cost model plus the Pallas
kernels' CostEstimates. Nothing here runs on a GPU; every figure is labelled an estimate.

Step cost. For each (preset, TP, MTP drafts K, ReplaySSM window W) the engine is built as
`benchmarks/aot_step.py` builds it (`build_runner`: abstract params, `EngineArgs.scheduler_config`, `Runner`), and the
step of a bucket (T tokens, R rows, B block-table width, L logits) is traced and compiled deviceless for the
H200. Its cost, per device:

    flops, transcendentals, bytes = xla_cost(compiled step) + kernel_cost(step jaxpr)

`xla_cost`: XLA's HloCostAnalysis of the compiled, SPMD-partitioned module (one device's program), which
counts each Triton custom call, i.e. each pallas_call, as 0 FLOPs and 0 bytes; `kernel_cost`: the summed
`pl.CostEstimate`s of the step's pallas_calls (`pallas_kernels/*/cost.py`), which inside shard_map see one
device's heads (`pallas_kernels/cost.py`). Compiled, not lowered: on qwen3_5_0_8b's (8, 8, 256, 8) bucket
the lowered (unoptimised) module has the compiled one's FLOPs within 1.3% (12.52 vs 12.68 G) but counts
8.75 GB against 3.38 GB (every unfused elementwise op's operands and outputs), and at TP 2 it is the global
program (12.49 GFLOP) where the compiled one is a device's (8.67 GFLOP). A compile takes 1-2.5 min a
bucket on two busy cores (Nemotron-H-8B 52 s, Qwen3-Next-80B-A3B at TP 4 136 s), a lowering 4-7 s. The
step is built with the fewest pool pages (2 KV blocks, 4 state slots): XLA counts a scatter into a pool as
reading and writing all of it (361 GB on that bucket's lowered module with real pools), where the GPU
updates the rows in place; the kernels' estimates count only the slots and blocks their rows touch, and no
other shape depends on the pools.

XLA's model is static: a MoE layer counts its whole expert stack (Qwen3-Next's 512 experts) as read every
step, where a small batch reads only its tokens' top-10, so Qwen3-Next's estimate at small batches is
pessimistic; a while loop's body counts once (materialisation, grouped prefill's second phase).

Roofline: step seconds = max(flops / peak, bytes / bandwidth), H200 989 TFLOP/s dense bf16 and 4.8 TB/s,
H100 989 TFLOP/s and 3.35 TB/s (the H100 figures reuse the H200 compile: both sm_90a). It ignores kernel
launch overhead and the host's share of a step, TP all-reduces, imperfect overlap of compute and traffic
(max, not sum), caches (every byte from HBM) and how far each kernel and GEMM runs from peak.

Decode at batch b, K drafts accepted at rate a: the smallest bucket holding b rows of 1 + K tokens, every row
at context max_model_len (the attention estimate's rows end at the block table's span), no prefill rows (the
step's prefill cond not taken); tokens/s = b x E / step seconds, E = (1 - a^(K+1)) / (1 - a) tokens a verify
step emits (K = 0: 1). W = 16 (ReplaySSM) against W = 0 (the snapshot baseline). Prefill: T / step seconds
at the largest token bucket (max_num_batched_tokens) in rows of C tokens (2048 / 64: 32 rows), its
prefill path taken. A bucket's padding rows and tokens count as real ones (the shapes are static; the
kernels skip them on the GPU), so batch 1 is costed as the smallest row bucket's rows. One anchor
of A tokens x N candidates of C: with the checkpoint the anchor runs once and each candidate from it (grouped
prefill puts both in one step), ceil((A + N C) / T) steps; without, ceil(N (A + C) / T) steps; each costed as
the largest prefill step.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /work/cuda-venv/bin/python -m benchmarks.estimate
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import NamedTuple

import yaml
from tqdm import tqdm

from benchmarks.aot_step import PRESETS, Setup, build_runner
from benchmarks.common import figure
from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.worker.runner import fewest_pages
from pallas_kernels import aot
from pallas_kernels.cost import Cost, kernel_cost, xla_cost

RESULTS = Path(__file__).parent / "results"
LABEL = "estimate (XLA cost model + kernel CostEstimates)"
PEAKS = {"h200": dict(flops=989e12, bandwidth=4.8e12), "h100": dict(flops=989e12, bandwidth=3.35e12)}
MODELS = {"qwen3_next_80b_a3b_instruct": 4, "nemotron_h_8b_base_8k": 1}  # preset: TP
# The seeds' measured ratios, shown next to the estimated ratio each corresponds to.
SEEDS = {
    "mtp": ("seed 003, measured: 2.20x output tok/s, MTP 3 with ReplaySSM (W=16) against without, "
            "Nemotron-Super-3 on GB300, batch 512 (vLLM #55688); compare MTP K=3 W=16 vs W=0", 2.20),
    "checkpoint": ("seed 001, measured: 7.58x, one grouped prefill call against sequential per-range calls, "
                   "1 x 512 + N x 64 tokens on L40S (kernel level; no anchor recomputed); compare the checkpoint "
                   "ratios", 7.58),
}


def step_seconds(cost: Cost, peak: dict) -> float:
    """The roofline time of a step: its FLOPs at peak or its bytes at full bandwidth, whichever is longer."""
    return max(cost.flops / peak["flops"], cost.bytes_accessed / peak["bandwidth"])


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verify step of `drafts` drafts emits when each is accepted with probability `acceptance`, in
    order: 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)."""
    if acceptance == 1:
        return drafts + 1.0
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


def checkpoint_steps(anchor: int, candidates: int, candidate: int, tokens: int) -> tuple[int, int]:
    """Prefill steps of `tokens` tokens for one anchor x `candidates` candidates: (with the checkpoint,
    without it)."""
    with_checkpoint = math.ceil((anchor + candidates * candidate) / tokens)
    return with_checkpoint, math.ceil(candidates * (anchor + candidate) / tokens)


def first_at_least(ladder, need: int) -> int:
    return next(b for b in ladder if b >= need)


class Stepper(NamedTuple):
    """One engine set-up, lowered and compiled for the target; each bucket's cost computed once."""

    setup: Setup
    runner: object
    topology: object
    costs: dict
    cache: Path | None  # where `costs` is kept, after every bucket

    def cost(self, bucket: tuple[int, int, int, int], prefill: bool) -> Cost:
        """The step's per-device cost: XLA's for its compiled module, plus its kernels' estimates with the
        prefill cond taken or not (kept in `costs` under the set-up and bucket: a rerun with the same cache
        compiles only what it has not)."""
        key = f"{self.setup} {bucket} {'prefill' if prefill else 'decode'}"
        if key not in self.costs:
            with aot.lowering_for("h200", self.topology):
                traced = self.runner.trace(bucket)
                compiled = traced.lower().compile()
            self.costs[key] = xla_cost(compiled) + kernel_cost(traced.jaxpr, max if prefill else min)
            if self.cache:
                self.cache.write_text(json.dumps(self.costs, indent=1))
        return Cost(*self.costs[key])

    def decode_bucket(self, batch: int) -> tuple[int, int, int, int]:
        config = self.runner.config
        tokens = batch * (1 + self.setup.k)
        return (first_at_least(config.token_buckets, tokens), first_at_least(config.row_buckets, max(batch, 2)),
                config.block_table_buckets[-1], first_at_least(config.logits_buckets, tokens))

    def prefill_bucket(self, row_tokens: int) -> tuple[int, int, int, int]:
        """The largest token bucket, in rows of `row_tokens` tokens."""
        config = self.runner.config
        tokens = config.token_buckets[-1]
        rows = first_at_least(config.row_buckets, tokens // row_tokens)
        return tokens, rows, config.block_table_buckets[-1], first_at_least(config.logits_buckets, rows)


def model_config(preset: str, drafts: int) -> ModelConfig:
    """The preset, with the one MTP layer vLLM defaults Qwen3-Next to (qwen3_next_mtp.py) where the preset
    declares none and drafts are asked for."""
    raw = yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    cfg = parse_hf_config(raw)
    if drafts and not cfg.mtp_layers:
        cfg = parse_hf_config({**raw, "num_nextn_predict_layers": 1})
    return cfg


def stepper(setup: Setup, args: argparse.Namespace, costs: dict) -> Stepper:
    cfg = model_config(setup.preset, setup.k)
    # unrolled: XLA's cost analysis counts a scanned loop's body once
    runner, topology, _ = build_runner(setup, "h200", args, resize=fewest_pages, cfg=cfg, scan_layers=False)
    return Stepper(setup, runner, topology, costs, args.cache)


def estimate_model(preset: str, tp: int, args: argparse.Namespace, costs: dict, progress: tqdm) -> dict:
    """Every figure of one model, in seconds per step and tokens/s per target."""
    setups = [Setup(preset, tp, 0, 16)]
    if args.drafts and (preset in args.mtp_presets):
        setups += [Setup(preset, tp, args.drafts, 16), Setup(preset, tp, args.drafts, 0)]
    out = dict(preset=preset, tp=tp, decode=[], prefill=None, checkpoint=[])
    for setup in setups:
        steps = stepper(setup, args, costs)
        for batch in args.batch:
            bucket = steps.decode_bucket(batch)
            cost = steps.cost(bucket, prefill=False)
            progress.update()
            emitted = batch * expected_tokens(args.acceptance, setup.k)
            out["decode"].append(dict(k=setup.k, window=setup.window, batch=batch, bucket=bucket, cost=cost._asdict(),
                                      tokens_per_s={t: emitted / step_seconds(cost, p) for t, p in PEAKS.items()}))
        if setup.k == 0:
            bucket = steps.prefill_bucket(args.candidate)
            cost = steps.cost(bucket, prefill=True)
            progress.update()
            seconds = {t: step_seconds(cost, p) for t, p in PEAKS.items()}
            out["prefill"] = dict(bucket=bucket, cost=cost._asdict(),
                                  tokens_per_s={t: bucket[0] / s for t, s in seconds.items()})
            for n in args.candidates:
                with_steps, without_steps = checkpoint_steps(args.anchor, n, args.candidate, bucket[0])
                out["checkpoint"].append(dict(candidates=n, steps_with=with_steps, steps_without=without_steps,
                                              seconds_with={t: with_steps * s for t, s in seconds.items()},
                                              speedup=without_steps / with_steps))
    return out


def table(results: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"# {LABEL}; per device; acceptance a = {args.acceptance}; decode at context {args.max_model_len}"]
    lines.append(f"{'model':<30} {'K':>2} {'W':>3} {'batch':>5} {'bucket':<22} {'GFLOP':>9} {'GB':>8} "
                 f"{'H200 tok/s':>11} {'H100 tok/s':>11}")
    for r in results:
        for d in r["decode"]:
            c = d["cost"]
            lines.append(f"{r['preset'] + ' tp' + str(r['tp']):<30} {d['k']:>2} {d['window']:>3} {d['batch']:>5} "
                         f"{str(d['bucket']):<22} {c['flops'] / 1e9:>9.1f} {c['bytes_accessed'] / 1e9:>8.2f} "
                         f"{d['tokens_per_s']['h200']:>11.0f} {d['tokens_per_s']['h100']:>11.0f}")
        p = r["prefill"]
        lines.append(f"{r['preset'] + ' tp' + str(r['tp']):<30} prefill {str(p['bucket']):<22} "
                     f"{p['cost']['flops'] / 1e9:>9.1f} GFLOP {p['cost']['bytes_accessed'] / 1e9:>8.2f} GB  "
                     f"H200 {p['tokens_per_s']['h200']:.0f} tok/s  H100 {p['tokens_per_s']['h100']:.0f} tok/s")
        for ratio in mtp_ratios(r):
            lines.append(f"{'':<30} MTP K={ratio['k']} W={ratio['window']} vs {ratio['vs']}, "
                         f"batch {ratio['batch']:>3}: {ratio['speedup']:.2f}x (estimate)")
        for c in r["checkpoint"]:
            lines.append(f"{'':<30} 1 anchor x {c['candidates']:>3} candidates: {c['steps_with']} steps with the "
                         f"checkpoint, {c['steps_without']} without: {c['speedup']:.2f}x (estimate)")
    lines += [f"# {label}" for label, _ in SEEDS.values()]
    return lines


def mtp_ratios(result: dict) -> list[dict]:
    """Estimated H200 decode speed-ups at each batch: every K > 0 set-up over K = 0 ("vs": "K=0"), and ReplaySSM
    over the snapshot baseline at the same K ("vs": "W=0")."""
    rate = {(d["k"], d["window"], d["batch"]): d["tokens_per_s"]["h200"] for d in result["decode"]}
    ratios = []
    for (k, window, batch), value in rate.items():
        if k > 0:
            ratios.append(dict(k=k, window=window, batch=batch, vs="K=0", speedup=value / rate[0, 16, batch]))
        if k > 0 and window > 0 and (k, 0, batch) in rate:
            ratios.append(dict(k=k, window=window, batch=batch, vs="W=0", speedup=value / rate[k, 0, batch]))
    return ratios


def plot(results: list[dict], path: Path, context: int) -> None:
    with figure(path, 1, 2, figsize=(14, 5.5)) as (fig, (decode, ratios)):
        series = 0
        for i, r in enumerate(results):
            name = r["preset"].split("_")[0] + f" tp{r['tp']}"
            for k, window in sorted({(d["k"], d["window"]) for d in r["decode"]}, key=lambda kw: (kw[0], -kw[1])):
                rows = [d for d in r["decode"] if (d["k"], d["window"]) == (k, window)]
                for target, style in (("h200", "-"), ("h100", ":")):
                    decode.plot([d["batch"] for d in rows], [d["tokens_per_s"][target] for d in rows], style,
                                marker="o", color=f"C{series}", label=f"{name} K={k} W={window} {target.upper()}")
                series += 1
            marks = {("K=0", 16): "s", ("K=0", 0): "x", ("W=0", 16): "*"}
            for (vs, window), marker in marks.items():
                found = [m for m in mtp_ratios(r) if (m["vs"], m["window"]) == (vs, window)]
                if found:
                    ratios.plot([m["batch"] for m in found], [m["speedup"] for m in found], marker=marker,
                                color=f"C{i}", label=f"{name}: MTP K={found[0]['k']} W={window} vs {vs}, by batch")
            ratios.plot([c["candidates"] for c in r["checkpoint"]], [c["speedup"] for c in r["checkpoint"]], "--",
                        color=f"C{i}", marker="^", label=f"{name}: checkpoint vs none, by N candidates")
        for (label, value), colour in zip(SEEDS.values(), ("C3", "C4"), strict=True):
            ratios.axhline(value, color=colour, linewidth=1, label=label.split(", ")[0] + f": {value}x measured")
        decode.set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="decode tokens/s per device",
                   title=f"decode at context {context}, {LABEL}")
        ratios.set(xscale="log", xlabel="batch, or N candidates", ylabel="speed-up", title=f"speed-ups, {LABEL}")
        decode.legend(fontsize=6)
        ratios.legend(fontsize=6)
        for ax in (decode, ratios):
            ax.grid(True, which="both", alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=tuple(MODELS), choices=tuple(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=(1, 16, 64, 256))
    parser.add_argument("--drafts", type=int, default=3, help="MTP drafts K of the speculative set-ups (0: none)")
    parser.add_argument("--mtp-presets", nargs="*", default=("qwen3_next_80b_a3b_instruct",),
                        help="presets with an MTP layer (Nemotron-H-8B has none)")
    parser.add_argument("--acceptance", type=float, default=0.7, help="per-draft acceptance rate a")
    parser.add_argument("--anchor", type=int, default=512)
    parser.add_argument("--candidate", type=int, default=64)
    parser.add_argument("--candidates", nargs="+", type=int, default=(16, 64, 256))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--mem-fraction", type=float, default=0.75)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=RESULTS / "estimate", help="writes OUT.txt, .json and .png")
    parser.add_argument("--cache", type=Path, help="keep each bucket's cost here, and reuse it on a rerun")
    args = parser.parse_args()
    per_model = len(args.batch) + 1
    total = sum(per_model + (2 * len(args.batch) if args.drafts and p in args.mtp_presets else 0) for p in args.preset)
    costs = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    start, results = time.perf_counter(), []
    with tqdm(total=total, desc="steps compiled", unit="bucket") as progress:
        for preset in args.preset:
            results.append(estimate_model(preset, MODELS[preset], args, costs, progress))
    lines = table(results, args)
    lines.append(f"# {time.perf_counter() - start:.0f} s")
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    record = dict(label=LABEL, args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  peaks=PEAKS, seeds=SEEDS, results=results)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    plot(results, args.out.with_suffix(".png"), args.max_model_len)


if __name__ == "__main__":
    main()
