"""Roofline ESTIMATE of the engine's step on an H200, H100 or B200: XLA's cost model plus the Pallas kernels'
CostEstimates, a byte count per kernel and kind, and the same step at the bandwidth published kernels reach.
Nothing here runs on a GPU; every figure is labelled an estimate.

Units. Every cost is one device's: under TP N each device runs its shard of the same step at the same time. A
decode rate is the batch's tokens over that step time, so it is the rate of the TP GROUP (N GPUs together);
the table, the JSON (`tokens_per_s_per_tp_group`, `tokens_per_s_per_gpu`) and the plot give both, per GPU =
per TP group / N.

Step cost. For each (preset, TP, MTP drafts K, ReplaySSM window W) the engine is built as
`benchmarks/aot_step.py` builds it (`build_runner`: abstract params, `builder.scheduler_config`, `Runner`) with
pools of the fewest pages (2 KV blocks, 4 state slots: XLA counts a scatter into a pool as reading and writing
all of it, where the GPU updates the rows in place; the kernels' estimates count only the slots and blocks their
rows touch, and no other shape depends on the pools). A bucket (T tokens, R rows, B block-table width, L logits)
costs, per device:

    bytes = xla (the compiled step, XLA's HloCostAnalysis) + kernels (every pallas_call's pl.CostEstimate)

`kernels`: `pallas_kernels.cost.kernel_costs` of the full model's traced step, per kernel name; inside shard_map a
kernel sees one device's heads. A decode step takes every cond's cheapest branch (no prefill path), a prefill
step its costliest.

`xla`: XLA counts each Triton custom call (each pallas_call) as 0 bytes, and a `conditional` as the maximum over
its branches, property by property. Its sum therefore charges a decode step with every GDN layer's prefill path,
every MoE layer's overflow layout (tiles) and the costliest sampling mode, none of which runs in it: 35 GB of
Qwen3-Next-80B's 130 GB at TP 4, batch 256 (docs/benchmarks.md). So each top-level instruction of the compiled
module is costed by the same analysis on its own (`pallas_kernels.cost.xla_costs`) and each conditional counts the
branch the step runs: decode the cheapest (`cheapest`), prefill the one launching the most kernels
(`most_kernels`: the mixers' prefill path, everything else its cheapest). Each instruction's op_name puts its
bytes in a part of the model (`op_group`: MoE, GDN, attention, LM head, embedding, sampling ...); a fusion
that only gathers from an operand is charged the slices it gathers, where XLA charges the whole operand (the
embedding table; at small batches a MoE layer's whole expert stack, gathered tile by tile). Compiled, not
lowered: the lowered module counts every unfused op's operands and outputs (8.75 GB against 3.38 on qwen3_5_0_8b's
(8, 8, 256, 8) bucket, FLOPs within 1.3%) and at TP > 1 is the global program. XLA's model is static: a while
loop's body counts once (materialization, grouped prefill's second phase).

Depth. The step is compiled unrolled (`scan_layers=False`: XLA counts a loop's body once), and a compile of the
whole stack takes 5-8 min a bucket on two busy cores. XLA's cost is linear in the layers, so the step is compiled
for a model of one layer of each kind (Qwen3-Next: a GDN and an attention layer, each with its MoE) and for that
model with one more layer of each kind, placed where it repeats no period (`depth_models`), and the full depth's
cost is base + sum over kinds of (n_kind - 1) x (one more - base): 3 compiles of 2-3 layers (20-50 s each)
instead of one of 48 layers. On Qwen3-Next-80B at TP 4, batch 256 it gave the bytes of the 4- and 8-layer
models' compiled steps within 0.05% (docs/benchmarks.md#gpu-estimate). The whole stack unrolled
reads each layer's weights out of their stacked params as a copy, which the scanned engine does not (it reads
them in place, `ModelOps.compiler_options`); the few-layer models repeat no period, so their params are not
stacked. `--depth full` compiles the whole stack instead.

Bytes by kind: expert weights and dense weights (what the step reads of each param, `weight_bytes`: every param
once per pass that uses it, the MTP layer and the LM head once per draft, the embedding's rows, and of each routed
expert stack the experts T tokens of top-k routing touch on average), recurrent state (the GDN, SSD and conv1d
kernels' estimates), KV cache (the attention kernel's), activations and other (what XLA counts beyond the
weights: activations, the MoE layout's padded rows, sampling over the vocabulary, all-reduce buffers, state
plumbing done by XLA ops).

Roofline: step seconds = max(flops / peak, bytes / bandwidth), H200 989 TFLOP/s dense bf16 and 4.8 TB/s, H100
989 TFLOP/s and 3.35 TB/s, B200 2250 TFLOP/s and 8 TB/s (the H100 and B200 figures reuse the H200 compile).
Expected: max(flops / peak, sum over kinds of bytes / (bandwidth x the fraction of it published kernels of that
kind reach, `EFFICIENCY`)). Neither counts kernel launches and the host's share of a step, TP all-reduce time,
imperfect overlap of compute and traffic (max, not sum), caches (every byte from HBM); the expected figure keeps
FLOPs at peak.

Decode at batch b, K drafts accepted at rate a: the smallest bucket holding b rows of 1 + K tokens, every row
at context max_model_len (the attention estimate's rows end at the block table's span), no prefill rows; tokens
per step = b x E, E = (1 - a^(K+1)) / (1 - a) tokens a verify step emits (K = 0: 1). W = 16 (ReplaySSM) against
W = 0 (the snapshot baseline). Prefill: T tokens a step at the largest token bucket (max_num_batched_tokens) in
rows of C tokens (2048 / 64: 32 rows). A bucket's padding rows and tokens count as real ones (the shapes are
static; the kernels skip them on the GPU), so batch 1 is costed as the smallest row bucket's rows. One anchor
of A tokens x N candidates of C: with the checkpoint the anchor runs once and each candidate from it (grouped
prefill puts both in one step), ceil((A + N C) / T) steps; without, ceil(N (A + C) / T) steps; each costed as
the largest prefill step.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /work/cuda-venv/bin/python -m benchmarks.estimate \\
        --cache /tmp/estimate-costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import yaml
from tqdm import tqdm

from benchmarks.aot_step import PRESETS, Setup, build_runner
from benchmarks.common import figure
from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.stack import layer_segments
from jaxhybrid.worker.runner import fewest_pages
from pallas_kernels import aot
from pallas_kernels.cost import Cost, cheapest, kernel_costs, most_kernels, xla_costs

RESULTS = Path(__file__).parent / "results"
LABEL = "estimate (XLA cost model + kernel CostEstimates)"
PEAKS = {"h200": dict(flops=989e12, bandwidth=4.8e12), "h100": dict(flops=989e12, bandwidth=3.35e12),
         "b200": dict(flops=2250e12, bandwidth=8e12)}
MODELS = {"qwen3_next_80b_a3b_instruct": 4, "nemotron_h_8b_base_8k": 1}  # preset: TP
UNITS = {"tokens_per_s_per_tp_group": "the batch's tokens over one device's step time: the TP group's rate",
         "tokens_per_s_per_gpu": "tokens_per_s_per_tp_group / TP", "bytes": "per device (one GPU) per step",
         "flops": "per device (one GPU) per step"}
# Published measured ratios (vLLM pull requests), shown next to the estimated ratio each corresponds to.
SEEDS = {
    "mtp": ("vLLM #55688, measured: 2.20x output tok/s, MTP 3 with ReplaySSM (W=16) against without, "
            "Nemotron-Super-3 on GB300, batch 512; compare MTP K=3 W=16 vs W=0", 2.20),
    "checkpoint": ("vLLM #55876, measured: 7.58x, one grouped prefill call against sequential per-range calls, "
                   "1 x 512 + N x 64 tokens on L40S (kernel level; no anchor recomputed); compare the checkpoint "
                   "ratios", 7.58),
}

EXPERTS, DENSE, STATE, KV, OTHER = ("expert weights", "dense weights", "recurrent state", "KV cache",
                                    "activations & other")
KINDS = (EXPERTS, DENSE, STATE, KV, OTHER)
# The fraction of HBM bandwidth published kernels of each kind reach; sources and arithmetic in docs/benchmarks.md.
EFFICIENCY = {
    EXPERTS: (0.35, "fused MoE, FP8, Qwen3-Next-80B TP 4 shapes: 1.57 TB/s (vllm-project/vllm#45142, H20-3e), "
                    "33-39% of its 4.0-4.8 TB/s"),
    DENSE: (0.69, "16-bit GEMM at one row, 8192 x 8192: 2.30 TB/s of the H100's 3.35 (inclusionAI/humming#2)"),
    STATE: (0.46, "Triton GDN decode, Qwen3-Next TP 4, batch 256: 60.3 us for 134 MB of bf16 state read and "
                  "written, 2.2 TB/s of the H200's 4.8 (vllm-project/vllm#31722)"),
    KV: (0.55, "FA3 paged decode: 1.85 TB/s of the H100's 3.35 (Dao-AILab/flash-attention#1572)"),
    OTHER: (0.69, "assumed as for dense weights: no published figure for XLA's fusions at these shapes"),
}


# --- units, kinds and the roofline: pure functions ----------------------------------------------------------

def step_seconds(cost: Cost, peak: dict) -> float:
    """The roofline time of a step: its FLOPs at peak or its bytes at full bandwidth, whichever is longer."""
    return max(cost.flops / peak["flops"], cost.bytes_accessed / peak["bandwidth"])


def expected_seconds(flops: float, by_kind: Mapping[str, float], peak: dict,
                     efficiency: Mapping[str, tuple[float, str]] = EFFICIENCY) -> float:
    """A step's FLOPs at peak or each kind's bytes at the fraction of the bandwidth its kernels reach, summed,
    whichever is longer."""
    moved = sum(b / (peak["bandwidth"] * efficiency[kind][0]) for kind, b in by_kind.items())
    return max(flops / peak["flops"], moved)


def rates(tokens: float, seconds: float, tp: int) -> dict[str, float]:
    """Tokens/s of a step of `seconds` (one device's time) emitting `tokens`: the TP group's, and per GPU."""
    group = tokens / seconds
    return {"tokens_per_s_per_tp_group": group, "tokens_per_s_per_gpu": group / tp}


def group_label(tp: int) -> str:
    return "GPU" if tp == 1 else f"{tp}-GPU group"


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


_PARTS = {"moe": "MoE", "gdn": "GDN", "attention": "attention", "mamba2": "Mamba2", "mamba": "Mamba2",
          "mlp": "MLP"}


def op_group(op_name: str) -> str:
    """The part of the model an XLA instruction belongs to, from its op_name (jax's name stack)."""
    layer = re.search(r"/(mtp/)?layers_\d+/([^/]+)", op_name)
    if layer:
        return ("MTP " if layer.group(1) else "") + _PARTS.get(layer.group(2), "norms, residuals")
    if "embed_tokens" in op_name:
        return "embedding"
    if "lm_head" in op_name or ".logits" in op_name:
        return "LM head"
    if "HybridLM" in op_name:
        return "model, other"
    if not op_name.startswith("jit("):
        return "unnamed (XLA's copies, fills)"
    return "sampling, plan"


def kernel_kind(name: str) -> str:
    """The kind of bytes a Pallas kernel moves, from its name."""
    if name.startswith(("gdn_", "ssd_", "conv1d")):
        return STATE
    if "attention" in name:
        return KV
    return OTHER


def bytes_by_kind(xla_bytes: float, kernels: Mapping[str, Cost], weights: Mapping[str, float]) -> dict[str, float]:
    """A step's bytes by kind: the weights it reads (`weight_bytes`), the kernels' bytes by `kernel_kind`, and what
    XLA counts beyond the weights. The kinds add up to XLA's bytes plus the kernels'."""
    found = {kind: 0.0 for kind in KINDS}
    found[EXPERTS], found[DENSE] = weights[EXPERTS], weights[DENSE]
    found[OTHER] = xla_bytes - weights[EXPERTS] - weights[DENSE]
    for name, cost in kernels.items():
        found[kernel_kind(name)] += cost.bytes_accessed
    return found


def expert_fraction(tokens: int, top_k: int, num_experts: int) -> float:
    """The share of the experts `tokens` tokens, each routed to `top_k` distinct experts uniformly, touch on
    average: 1 - (1 - k/E)^T."""
    return 1 - (1 - top_k / num_experts) ** tokens


def weight_bytes(params: Any, cfg: ModelConfig, tokens: int, rows: int, drafts: int) -> dict[str, float]:
    """Bytes of the params one device reads in a step of `tokens` tokens over `rows` rows with `drafts` MTP
    drafts (their per-device shards): the trunk once, the MTP layer once per draft (its first pass over the
    tokens, the others over the rows), the LM head once per pass (1 + drafts), the embedding's rows; of a routed
    expert stack ([..., E, d, i] under a `moe` path, a stack of layers' stacks too) the `expert_fraction` of the
    pass's tokens."""
    passes = {"trunk": [tokens], "mtp": [tokens] + [rows] * (drafts - 1) if drafts else [],
              "lm_head": [tokens] * (1 + drafts)}
    found = {EXPERTS: 0.0, DENSE: 0.0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        size = math.prod(shape) * leaf.dtype.itemsize
        if "embed_tokens" in name and not cfg.tie_word_embeddings:
            found[DENSE] += min(size, (tokens * (1 + bool(drafts)) + rows * max(drafts - 1, 0))
                                * shape[-1] * leaf.dtype.itemsize)
            continue
        where = "mtp" if "mtp" in name else "lm_head" if ("lm_head" in name or "embed_tokens" in name) else "trunk"
        if cfg.moe is not None and "moe" in name and "shared" not in name and shape[-3:][:1] == (cfg.moe.num_experts,):
            found[EXPERTS] += sum(size * expert_fraction(t, cfg.moe.top_k, cfg.moe.num_experts) for t in passes[where])
        else:
            found[DENSE] += size * len(passes[where])
    return found


# --- depth: the full stack's XLA cost from models of a few layers --------------------------------------------

def _sub(a: Mapping[str, Cost], b: Mapping[str, Cost]) -> dict[str, Cost]:
    return {k: a.get(k, Cost()) + b.get(k, Cost()).times(-1) for k in {*a, *b}}


def extrapolate(base: Mapping[str, Cost], one_more: Mapping[Any, Mapping[str, Cost]],
                counts: Mapping[Any, int]) -> dict[str, Cost]:
    """Costs (by part) of a stack of `counts[kind]` layers of each kind, from a model of one layer of each kind
    (`base`) and, per kind, that model with one more layer of it: base + sum (n - 1) (one_more - base)."""
    total = dict(base)
    for kind, n in counts.items():
        if n > 1:
            for part, cost in _sub(one_more[kind], base).items():
                total[part] = total.get(part, Cost()) + cost.times(n - 1)
    return total


def depth_models(layers: tuple) -> tuple[tuple, dict[Any, tuple], dict[Any, int]]:
    """The few-layer stacks `extrapolate` needs for `layers`: one layer of each kind in order of appearance,
    and for each kind that occurs more than once, that stack with one more layer of the kind, placed where it
    repeats no period (`layer_segments`: a stack without a repeat is one segment, its params unstacked, where a
    repeat would stack them and an unrolled step would copy each layer's weights out of the stack); and the
    counts."""
    kinds = tuple(dict.fromkeys(layers))
    counts = {kind: layers.count(kind) for kind in kinds}
    one_more = {}
    for kind in (k for k in kinds if counts[k] > 1):
        options = [kinds[:i] + (kind,) + kinds[i:] for i in range(len(kinds) + 1)]
        one_more[kind] = next((o for o in options if len(layer_segments(o)) == 1 and layer_segments(o)[0].repeats == 1),
                              options[kinds.index(kind)])
    return kinds, one_more, counts


def grouped(costs: Iterable[tuple[str, Cost]]) -> dict[str, Cost]:
    """(op_name, cost) pairs summed by `op_group`."""
    found: dict[str, Cost] = {}
    for op_name, cost in costs:
        part = op_group(op_name)
        found[part] = found.get(part, Cost()) + cost
    return found


def _total(costs: Mapping[str, Cost]) -> Cost:
    return sum(costs.values(), Cost())


# --- the engine, compiled ------------------------------------------------------------------------------------

class StepCost(NamedTuple):
    """One bucket's cost on one device: XLA's by part of the model, the kernels' by name."""

    xla: dict[str, Cost]
    kernels: dict[str, Cost]

    @property
    def total(self) -> Cost:
        return _total(self.xla) + _total(self.kernels)

    def to_json(self) -> dict:
        return {"xla": {k: list(v) for k, v in self.xla.items()},
                "kernels": {k: list(v) for k, v in self.kernels.items()}}

    @classmethod
    def from_json(cls, found: dict) -> StepCost:
        return cls({k: Cost(*v) for k, v in found["xla"].items()}, {k: Cost(*v) for k, v in found["kernels"].items()})


class Stepper(NamedTuple):
    """One engine set-up: its full model's runner (the kernels, the weights), the few-layer runners its XLA cost
    is extrapolated from, and each bucket's cost computed once."""

    setup: Setup
    runner: Any
    topology: Any
    depth: dict  # "full": None, or base/one_more/counts: few-layer runners and the layer counts
    costs: dict
    cache: Path | None  # where `costs` is kept, after every bucket

    def cost(self, bucket: tuple[int, int, int, int], prefill: bool) -> StepCost:
        """The step's per-device cost with the prefill path taken or not (kept in `costs` under the set-up and
        bucket: a rerun with the same cache compiles only what it has not)."""
        key = f"{self.setup} {bucket} {'prefill' if prefill else 'decode'}"
        if not isinstance(self.costs.get(key), dict):
            with aot.lowering_for("h200", self.topology):
                kernels = kernel_costs(self.runner.trace(bucket).jaxpr, max if prefill else min)
                policy = most_kernels if prefill else cheapest
                compiled = lambda runner: grouped(xla_costs(runner.trace(bucket).lower().compile(), policy))
                if self.depth["full"]:
                    parts = compiled(self.runner)
                else:
                    base = compiled(self.depth["base"])
                    more = {kind: compiled(runner) for kind, runner in self.depth["one_more"].items()}
                    parts = extrapolate(base, more, self.depth["counts"])
            self.costs[key] = StepCost(parts, kernels).to_json()
            if self.cache:
                self.cache.write_text(json.dumps(self.costs, indent=1))
        return StepCost.from_json(self.costs[key])

    def weights(self, bucket: tuple[int, int, int, int]) -> dict[str, float]:
        return weight_bytes(self.runner.params, self.runner.model.config, bucket[0], bucket[1], self.setup.k)

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
    depth: dict[str, Any] = {"full": args.depth == "full"}
    if args.depth != "full":
        # the few-layer models take the full model's config: the same buckets, pools and window
        same = lambda _: runner.config
        few = lambda layers: build_runner(setup, "h200", args, resize=same, scan_layers=False,
                                          cfg=dataclasses.replace(cfg, layers=layers))[0]
        kinds, one_more, counts = depth_models(cfg.layers)
        depth.update(base=few(kinds), one_more={kind: few(layers) for kind, layers in one_more.items()},
                     counts=counts)
    return Stepper(setup, runner, topology, depth, costs, args.cache)


def figures(cost: StepCost, weights: Mapping[str, float], tokens: float, tp: int) -> dict:
    """A bucket's record: its cost per device, its bytes by kind and by part, and per target the roofline and
    expected step seconds and rates (per TP group and per GPU)."""
    total = cost.total
    by_kind = bytes_by_kind(_total(cost.xla).bytes_accessed, cost.kernels, weights)
    by_part = {f"xla: {k}": v.bytes_accessed for k, v in cost.xla.items()}
    by_part.update({f"kernel: {k}": v.bytes_accessed for k, v in cost.kernels.items()})
    seconds = {t: {"roofline": step_seconds(total, p), "expected": expected_seconds(total.flops, by_kind, p)}
               for t, p in PEAKS.items()}
    record = dict(cost_per_device=total._asdict(), bytes_per_device_by_kind=by_kind,
                  bytes_per_device_by_part=dict(sorted(by_part.items(), key=lambda kv: -kv[1])),
                  step_seconds=seconds)
    for unit in ("tokens_per_s_per_tp_group", "tokens_per_s_per_gpu"):
        record[unit] = {t: {m: rates(tokens, s, tp)[unit] for m, s in ms.items()} for t, ms in seconds.items()}
    return record


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
            out["decode"].append(dict(k=setup.k, window=setup.window, batch=batch, bucket=bucket,
                                      **figures(cost, steps.weights(bucket), emitted, tp)))
        if setup.k == 0:
            bucket = steps.prefill_bucket(args.candidate)
            cost = steps.cost(bucket, prefill=True)
            progress.update()
            out["prefill"] = dict(bucket=bucket, **figures(cost, steps.weights(bucket), bucket[0], tp))
            for n in args.candidates:
                with_steps, without_steps = checkpoint_steps(args.anchor, n, args.candidate, bucket[0])
                seconds = {t: {m: with_steps * s for m, s in ms.items()}
                           for t, ms in out["prefill"]["step_seconds"].items()}
                out["checkpoint"].append(dict(candidates=n, steps_with=with_steps, steps_without=without_steps,
                                              seconds_with=seconds, speedup=without_steps / with_steps))
    return out


# --- output ----------------------------------------------------------------------------------------------------

def _rate(d: dict, target: str, unit: str) -> str:
    r = d[unit][target]
    return f"{r['roofline']:>9.0f} {r['expected']:>9.0f}"


def table(results: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"# {LABEL}; acceptance a = {args.acceptance}; decode at context {args.max_model_len}",
             "# GFLOP and GB: one device's (one GPU's) per step. tok/s per TP group: the batch's tokens over that "
             "step time, the rate of the TP GPUs together; per GPU = per TP group / TP.",
             "# roofline: 100% of peak FLOP/s and HBM bandwidth; expected: each kind of bytes at the bandwidth "
             "published kernels reach (" + ", ".join(f"{k} {v[0]:.0%}" for k, v in EFFICIENCY.items()) + ")",
             f"{'':<48} {'':>9} {'':>8} | {'H200 tok/s per TP group':^19} | {'H200 tok/s per GPU':^19} | "
             f"{'H100 tok/s per GPU':^19} | {'B200 tok/s per GPU':^19}",
             f"{'model':<31} {'K':>2} {'W':>3} {'batch':>5} {'bucket':<22} {'GFLOP/dev':>9} {'GB/dev':>8} |"
             + " roofline  expected |" * 4]
    unit = ("tokens_per_s_per_tp_group", "tokens_per_s_per_gpu", "tokens_per_s_per_gpu", "tokens_per_s_per_gpu")
    for r in results:
        name = f"{r['preset']} tp{r['tp']}"
        rows = [(f"{d['k']:>2} {d['window']:>3} {d['batch']:>5}", d) for d in r["decode"]]
        rows.append(("prefill     ", r["prefill"]))
        for what, d in rows:
            c = d["cost_per_device"]
            cells = " | ".join(_rate(d, t, u) for t, u in zip(("h200", "h200", "h100", "b200"), unit, strict=True))
            lines.append(f"{name:<31} {what} {str(tuple(d['bucket'])):<22} {c['flops'] / 1e9:>9.1f} "
                         f"{c['bytes_accessed'] / 1e9:>8.2f} | {cells} |")
        for ratio in mtp_ratios(r):
            lines.append(f"{'':<31} MTP K={ratio['k']} W={ratio['window']} vs {ratio['vs']}, "
                         f"batch {ratio['batch']:>3}: {ratio['speedup']:.2f}x (estimate, H200 roofline)")
        for c in r["checkpoint"]:
            lines.append(f"{'':<31} 1 anchor x {c['candidates']:>3} candidates: {c['steps_with']} steps with the "
                         f"checkpoint, {c['steps_without']} without: {c['speedup']:.2f}x (estimate)")
    lines += [f"# {label}" for label, _ in SEEDS.values()]
    lines += breakdown(results)
    return lines


def breakdown(results: list[dict]) -> list[str]:
    """Bytes per step per device, by kind and by part (XLA's parts of the model, the kernels by name)."""
    lines = ["", "# bytes per step, one device's (GB), by kind; and by part: XLA's count of each part of the model "
             "(conditionals at the branch the step runs) and each kernel's CostEstimate",
             f"{'model':<31} {'K':>2} {'W':>3} {'batch':>5} " + " ".join(f"{k:>19}" for k in KINDS) + f" {'total':>8}"]
    for r in results:
        name = f"{r['preset']} tp{r['tp']}"
        rows = [(f"{d['k']:>2} {d['window']:>3} {d['batch']:>5}", d) for d in r["decode"]]
        for what, d in [*rows, ("prefill     ", r["prefill"])]:
            kinds = d["bytes_per_device_by_kind"]
            lines.append(f"{name:<31} {what} " + " ".join(f"{kinds[k] / 1e9:>19.2f}" for k in KINDS)
                         + f" {sum(kinds.values()) / 1e9:>8.2f}")
            parts = [f"{k} {v / 1e9:.2f}" for k, v in d["bytes_per_device_by_part"].items() if abs(v) >= 0.005e9]
            lines.append(f"{'':<31}   by part: " + ", ".join(parts))
    return lines


def mtp_ratios(result: dict) -> list[dict]:
    """Estimated H200 roofline decode speed-ups at each batch: every K > 0 set-up over K = 0 ("vs": "K=0"), and
    ReplaySSM over the snapshot baseline at the same K ("vs": "W=0")."""
    rate = {(d["k"], d["window"], d["batch"]): d["tokens_per_s_per_tp_group"]["h200"]["roofline"]
            for d in result["decode"]}
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
                for mode, style in (("roofline", "-"), ("expected", "--")):
                    decode.plot([d["batch"] for d in rows], [d["tokens_per_s_per_gpu"]["h200"][mode] for d in rows],
                                style, marker="o", color=f"C{series}", label=f"{name} K={k} W={window} H200 {mode}")
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
        decode.set(xscale="log", yscale="log", xlabel="batch (rows)",
                   ylabel="decode tokens/s per GPU (per TP group = x TP)",
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
    parser.add_argument("--depth", default="extrapolate", choices=("extrapolate", "full"),
                        help="XLA's cost from few-layer models (fast) or from the whole stack compiled")
    parser.add_argument("--out", type=Path, default=RESULTS / "estimate", help="writes OUT.txt, .json and .png")
    parser.add_argument("--cache", type=Path, help="keep each bucket's cost here, and reuse it on a rerun")
    args = parser.parse_args()
    per_model = len(args.batch) + 1
    total = sum(per_model + (2 * len(args.batch) if args.drafts and p in args.mtp_presets else 0) for p in args.preset)
    costs = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    start, results = time.perf_counter(), []
    with tqdm(total=total, desc="steps costed", unit="bucket") as progress:
        for preset in args.preset:
            results.append(estimate_model(preset, MODELS[preset], args, costs, progress))
    lines = table(results, args)
    lines.append(f"# {time.perf_counter() - start:.0f} s")
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    record = dict(label=LABEL, units=UNITS,
                  args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, peaks=PEAKS,
                  efficiency={k: dict(fraction=f, source=s) for k, (f, s) in EFFICIENCY.items()},
                  seeds=SEEDS, results=results)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    plot(results, args.out.with_suffix(".png"), args.max_model_len)


if __name__ == "__main__":
    main()
