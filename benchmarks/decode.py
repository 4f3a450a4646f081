"""Decode throughput of the engine on the embedded default model, with MTP drafts verified by ReplaySSM.

Modes, at batch 1, 16 and 64 (every request: a code prompt from the held-out standard library, 96 new
tokens, greedy, eos ignored so every request decodes the same length):
  no_mtp          K = 0: one token per row per step, the default window (1 on CPU: plain decoding);
  replay_w16      MTP K = 3, ReplaySSM window W = 16: a verify row appends 1 + K ring entries and folds
                  them into S0 only every ~16 tokens (the default);
  replay_w4       MTP K = 3, W = 1 + K = 4: the smallest window, which folds (writes S0) at every step;
  snapshots       MTP K = 3 without ReplaySSM (`replayssm_window=0`): a verify row writes the whole state
                  after each of its 1 + K positions and the next step starts from the accepted one.
State memory per request is each mode's slot page (`jaxhybrid.worker.memory.slot_bytes`). The baseline, measured
in the same run, is no_mtp at the same batch: speedups are ratios to it.
Compilation is excluded (every bucket is compiled before the timed run).

Prints a table, writes benchmarks/results/decode.json and decode.png.

`--breakdown` instead splits a decode step of a random 40M-parameter Qwen3-Next MoE checkpoint (8 experts top-2,
head dims 64; written in bf16 through `jaxhybrid.models.export`, or `--checkpoint`) at each batch, bf16 and fp32:
  engine        serial steps (`async_scheduling=False`) of greedy decoding, split into host scheduling
                (schedule + update), plan transfer (packing and dispatch), device (the wait for the step) and
                output processing; and the tokens/s of the default engine (one step ahead);
  step          the jitted step alone on a prepared plan (packed once), device time;
  forward       the model alone on that plan: layers and LM head at the logits rows, no sampling;
  ops           the step's device time by op (a `jax.profiler` trace of the step; each XLA:CPU thunk
                attributed by its op's name to MoE, GDN, attention, LM head or the step's own work,
                sampling, history and plan included), as fractions scaled to the step's time.
Times are medians of wall time and of the process's CPU time (the CPU "device" computes on the same cores
the host runs on: on a shared machine the CPU time is the steadier of the two). Writes
benchmarks/results/decode_breakdown.json (with `--no-scan-layers`, decode_breakdown_unrolled.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]

import scheduler
from jaxhybrid import LLM, SamplingParams
from jaxhybrid.models.export import export_hf_checkpoint
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.model import init_params
from jaxhybrid.models.plan_transfer import pack_plan, unpack_plan
from jaxhybrid.models.stack import unflatten_params
from jaxhybrid.sample.sampler import ROW_DTYPE, batch_constraints
from jaxhybrid.tiny.corpus import HELD_OUT_MODULES, stdlib_dir
from jaxhybrid.worker.memory import slot_bytes
from scheduler import RowKind

TOKENIZER = Path(__file__).resolve().parent.parent / "jaxhybrid" / "assets" / "default_model"
# vLLM's CPU peer's checkpoint (docs/benchmarks.md#the-vllm-cpu-peer): 40,752,352 parameters
MOE_40M = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", dtype="bfloat16", vocab_size=4096,
    hidden_size=512, num_hidden_layers=8, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=0)
MODES = {"no_mtp": (0, None), "replay_w16": (3, 16), "replay_w4": (3, 4), "snapshots": (3, 0)}  # None: default W


def prompts(count: int, tokenizer, length: int = 48) -> list[list[int]]:
    """`count` prompts of `length` tokens cut from held-out standard-library modules."""
    ids = []
    for module in HELD_OUT_MODULES:
        ids += tokenizer.encode((stdlib_dir() / module).read_text(encoding="utf-8"))
        if len(ids) >= count * length * 3:
            break
    return [ids[i * length * 3:i * length * 3 + length] for i in range(count)]


def run(mode: str, batch: int, new_tokens: int) -> dict:
    k, window = MODES[mode]
    decode_bucket = max(16, batch * (1 + k))  # a decode step's tokens; prompts prefill in the 256 bucket
    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
              replayssm_window=window, num_blocks=2048, num_state_slots=4 * batch + 8, max_num_seqs=batch,
              max_num_batched_tokens=max(256, decode_bucket), max_model_len=256,
              token_buckets=tuple(sorted({decode_bucket, max(256, decode_bucket)})), row_buckets=(max(batch, 2),),
              enable_prefix_caching=False)
    llm.engine.precompile(progress=False)
    batch_prompts = prompts(batch, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(batch_prompts, params, use_tqdm=False)  # warm caches and allocator
    before = llm.engine.stats
    drafts, accepted, steps = before.draft_tokens, before.accepted_tokens, before.steps
    start = time.perf_counter()
    outputs = llm.generate(batch_prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cfg = llm.model.config
    window = llm.config.ring_size
    return {"mode": mode, "batch": batch, "k": k, "window": window, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "steps": stats.steps - steps,
            "acceptance": (stats.accepted_tokens - accepted) / max(stats.draft_tokens - drafts, 1),
            "state_bytes_per_request": slot_bytes(cfg, window, k, dtype_bytes=4),
            "kv_bytes_per_token": cfg.kv_bytes_per_token(4)}


def write_moe_checkpoint(directory: Path) -> Path:
    """The random MoE checkpoint (seeded, bf16) with the default model's tokenizer (4096 ids)."""
    params = init_params(parse_hf_config(MOE_40M), seed=0, dtype=jnp.bfloat16)
    export_hf_checkpoint(params, MOE_40M, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, directory / name)
    return directory


def timed(fn, repeats: int) -> dict:
    """Medians of `fn`'s wall and process CPU time (ms), after two warm-up calls."""
    fn(), fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"wall_ms": float(np.median(wall)) * 1e3, "cpu_ms": float(np.median(cpu)) * 1e3}


class EngineClock:
    """Serial engine steps split by phase: the functions each phase runs, wrapped with timers."""

    PHASES = ("host", "transfer", "device", "outputs")

    def __init__(self, llm: LLM) -> None:
        engine, runner = llm.engine, llm.engine.runner
        self.totals, self.plans, self._originals = defaultdict(float), [], []
        for owner, name, phase in ((scheduler, "schedule", "host"), (scheduler, "update", "host"),
                                   (runner, "dispatch", "transfer"), (runner, "fetch", "device"),
                                   (engine.output_processor, "process", "outputs")):
            self._wrap(owner, name, phase)

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        def wrapper(*args, **kwargs):
            if name == "dispatch":
                self.plans.append(args)  # (plan, constraints)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    def close(self) -> None:
        """Put the wrapped functions back (the scheduler module's are shared by every engine)."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)


def engine_split(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[dict, tuple]:
    """Per-step ms of each phase over serial decoding, the default engine's tokens/s, and a decode plan."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    for ahead in (True, False):  # warm both loops
        engine.async_scheduling = ahead
        llm.generate(prompts, params, use_tqdm=False)
    clock = EngineClock(llm)
    start, steps = time.perf_counter(), engine.stats.steps
    llm.generate(prompts, params, use_tqdm=False)
    wall, steps = time.perf_counter() - start, engine.stats.steps - steps
    clock.close()
    split = {phase: clock.totals[phase] / steps * 1e3 for phase in EngineClock.PHASES}
    split["wall"] = wall / steps * 1e3
    split["other"] = split["wall"] - sum(clock.totals.values()) / steps * 1e3
    engine.async_scheduling = True
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    split["tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    batch = len(prompts)
    decode = [args for args in clock.plans if args[0].num_tokens == batch
              and int(np.sum(args[0].row_kind == RowKind.DECODE)) == batch]
    return split, decode[len(decode) // 2]


def op_category(op_name: str) -> str:
    """An XLA op's share of the step, from its name (the jitted step's module path)."""
    # a layer's module path, scanned or unrolled: HybridLM/L/<sublayer>
    path = re.sub(r"(?:(?:segment_\d+|while/body|eval_jaxpr)/)*layers_\d+", "L", op_name.removeprefix("jit(_step_fn)/"))
    if re.search(r"while/body/jit\(dynamic_index_in_dim\)", path):  # a scanned layer's weights, copied out
        return "layer scan: weight slices"
    if "HybridLM/L/moe" in path:
        return "moe: expert matmuls (routed, shared)" if "dot_general" in path or "ffi_call" in path else (
            "moe: expert weight gathers" if path.endswith("gather") else "moe: routing, combine")
    if "HybridLM/L/gdn" in path:
        recurrent = any(op in path for op in ("gdn_verify", "gdn_prefill", "gdn_decode", "conv1d", "/jit(_verify)/",
                                              "/jit(_rows)/"))  # the last two: the CPU FFI kernels' calls
        return "gdn: state (conv, recurrence)" if recurrent else "gdn: projections"
    if "HybridLM/L/attention" in path:
        return "attention: projections" if "proj" in path else "attention: kernel"
    if "lm_head" in path:
        return "lm head"
    if "HybridLM" in path:
        return "norms, embedding"
    return "step: sampling, history, plan"


def op_split(step, repeats: int) -> dict[str, float]:
    """Fractions of the step's traced thunk time by `op_category`, each op counted once: a conditional, loop or
    call's thunk spans the ops inside it, which are traced themselves."""
    names = {}
    for line in step.compiled_text.splitlines():
        match = re.match(r'\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"', line)
        # a conditional, loop or call spans its ops; a custom call (an FFI kernel) is an op of its own
        if match and not re.search(r"(?<![\w-])(conditional|while|call)\(", line):
            names.setdefault(match.group(1), match.group(2))
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory, create_perfetto_trace=True)
        for _ in range(repeats):
            step()
        jax.profiler.stop_trace()
        trace = next(Path(directory).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    totals = defaultdict(float)
    for event in events:
        if event.get("ph") == "X" and event["name"] in names:
            totals[op_category(names[event["name"]])] += event["dur"]
    whole = sum(totals.values())
    return {name: value / whole for name, value in sorted(totals.items(), key=lambda item: -item[1])}


class PreparedStep:
    """The runner's jitted step on one packed plan (its pools donated and replaced, as the engine does)."""

    def __init__(self, runner, plan, constraints) -> None:
        self.runner = runner
        self.buffer, self.layout = pack_plan(plan)
        self.constraints = batch_constraints([], plan.row_kind.shape[0]) if constraints is None else constraints
        self.compiled_text = runner._step.lower(runner.param_leaves, runner.state, runner.carried, self.layout,
                                                self.buffer, self.constraints).compile().as_text()

    def __call__(self) -> None:
        r = self.runner
        r.state, r.carried, out = r._step(r.param_leaves, r.state, r.carried, self.layout, self.buffer,
                                          self.constraints)
        out.tokens.block_until_ready()


class PreparedForward:
    """The model alone on the step's plan: layers, then the LM head at the plan's logits rows."""

    def __init__(self, runner, step: PreparedStep) -> None:
        self.runner, self.step = runner, step
        param_layout, module = runner._param_layout, runner.module

        def forward(leaves, state, buffer):
            plan = unpack_plan(buffer, step.layout, ROW_DTYPE.itemsize)
            variables = {"params": unflatten_params(leaves, param_layout)}
            hidden, state = module.apply(variables, plan.token_ids, plan, state)
            return state, module.apply(variables, hidden[plan.logits_indices], method=HybridLM.logits)

        self._forward = jax.jit(forward, donate_argnums=1)

    def __call__(self) -> None:
        r = self.runner
        r.state, logits = self._forward(r.param_leaves, r.state, self.step.buffer)
        logits.block_until_ready()


def breakdown(checkpoint: Path, dtype: str, batch: int, new_tokens: int, repeats: int, scan_layers: bool) -> dict:
    llm = LLM(str(checkpoint), dtype=dtype, max_num_seqs=max(batch, 16), max_num_batched_tokens=256, max_model_len=256,
              num_blocks=512, num_state_slots=2 * max(batch, 16) + 8, enable_prefix_caching=False,
              scan_layers=scan_layers)
    rng = np.random.default_rng(0)
    # 16-token prompts: the whole batch prefills in one step and then decodes together
    prompts = [rng.integers(3, llm.model.config.vocab_size, 16).tolist() for _ in range(batch)]
    engine, (plan, constraints) = engine_split(llm, prompts, new_tokens)
    step = PreparedStep(llm.engine.runner, plan, constraints)
    forward = PreparedForward(llm.engine.runner, step)
    step_time = timed(step, repeats)
    shares = op_split(step, max(repeats // 2, 1))
    return {"dtype": dtype, "batch": batch, "scan_layers": scan_layers,
            "bucket": [plan.token_bucket, plan.row_bucket, plan.logits_bucket],
            "engine_ms": engine, "step": step_time, "forward": timed(forward, repeats),
            "ops_ms": {name: share * step_time["wall_ms"] for name, share in shares.items()}}


def print_breakdown(rows: list[dict]) -> None:
    for r in rows:
        e, s, f = r["engine_ms"], r["step"], r["forward"]
        print(f"{r['dtype']} batch {r['batch']} (T, R, L buckets {tuple(r['bucket'])}): engine {e['tokens_per_s']:.0f} "
              f"tok/s one step ahead; serial step {e['wall']:.2f} ms = host {e['host']:.2f} + transfer "
              f"{e['transfer']:.2f} + device {e['device']:.2f} + outputs {e['outputs']:.2f} + other {e['other']:.2f}")
        print(f"  jitted step alone {s['wall_ms']:.2f} ms (CPU {s['cpu_ms']:.2f}); model forward alone "
              f"{f['wall_ms']:.2f} ms (CPU {f['cpu_ms']:.2f})")
        for name, ms in r["ops_ms"].items():
            print(f"    {ms:7.2f} ms {ms / s['wall_ms']:6.1%}  {name}")


def run_breakdown(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else write_moe_checkpoint(Path(tmp) / "moe_40m")
        rows = []
        for dtype in args.dtypes:
            for batch in args.batches:
                rows.append(breakdown(checkpoint, dtype, batch, args.new_tokens, args.repeats, args.scan_layers))
                print_breakdown(rows[-1:])
    write_results("decode_breakdown" if args.scan_layers else "decode_breakdown_unrolled", rows,
                  {"new_tokens": args.new_tokens, "scan_layers": args.scan_layers})


def plot(results: list[dict], path: Path) -> None:


    batches = sorted({r["batch"] for r in results})
    with figure(path, figsize=(7, 4)) as (fig, ax):
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            values = [next(r["tokens_per_s"] for r in results if r["mode"] == mode and r["batch"] == b)
                      for b in batches]
            ax.bar([j + i * width for j in range(len(batches))], values, width, label=mode)
        ax.set_xticks([j + width for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"embedded model, {jax.default_backend()}")
        ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--breakdown", action="store_true", help="split a decode step of a 40M MoE checkpoint")
    parser.add_argument("--checkpoint", help="with --breakdown: a Qwen3-Next MoE checkpoint (else a random one)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="with --breakdown: the engine's --scan-layers (--no-: each layer reads its weights "
                        "in place)")
    args = parser.parse_args()
    if args.breakdown:
        run_breakdown(args)
        return
    results = [run(mode, batch, args.new_tokens) for batch in args.batches for mode in MODES]
    print(f"{'mode':<12}{'batch':>6}{'tok/s':>10}{'x no_mtp':>10}{'steps':>7}{'accept':>8}{'state B/req':>13}")
    for r in results:
        base = next(b for b in results if b["batch"] == r["batch"] and b["mode"] == "no_mtp")
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['mode']:<12}{r['batch']:>6}{r['tokens_per_s']:>10.1f}{r['speedup']:>10.2f}{r['steps']:>7}"
              f"{r['acceptance']:>8.2f}{r['state_bytes_per_request']:>13}")
    write_results("decode", results, {"new_tokens": args.new_tokens})
    plot(results, RESULTS / "decode.png")


if __name__ == "__main__":
    main()
