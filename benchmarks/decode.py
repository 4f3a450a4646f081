"""Decode throughput of the engine on the embedded default model, with MTP drafts verified by ReplaySSM.

Modes, at batch 1, 16 and 64 (every request: a code prompt from the held-out standard library, 96 new
tokens, greedy, eos ignored so every request decodes the same length):
  no_mtp          K = 0: one token per row per step, the default window (1 on CPU: plain decoding);
  replay_w16      MTP K = 3, ReplaySSM window W = 16: a verify row appends 1 + K ring entries and folds
                  them into S0 only every ~16 tokens (the default);
  replay_w4       MTP K = 3, W = 1 + K = 4: the smallest window, which folds (writes S0) at every step;
  snapshots       MTP K = 3 without ReplaySSM (`replayssm_window=0`): a verify row writes the whole state
                  after each of its 1 + K positions and the next step starts from the accepted one.
State memory per request is each mode's slot page (`jaxhybrid.memory.slot_bytes`). The baseline, measured
in the same run, is no_mtp at the same batch: speedups are ratios to it.
Compilation is excluded (every bucket is compiled before the timed run).

Prints a table, writes benchmarks/results/decode.json and decode.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.memory import slot_bytes
from jaxhybrid.tiny.corpus import HELD_OUT_MODULES, stdlib_dir

RESULTS = Path(__file__).parent / "results"
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


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in results})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        values = [next(r["tokens_per_s"] for r in results if r["mode"] == mode and r["batch"] == b) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], values, width, label=mode)
    ax.set_xticks([j + width for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"embedded model, {jax.default_backend()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    results = [run(mode, batch, args.new_tokens) for batch in args.batches for mode in MODES]
    print(f"{'mode':<12}{'batch':>6}{'tok/s':>10}{'x no_mtp':>10}{'steps':>7}{'accept':>8}{'state B/req':>13}")
    for r in results:
        base = next(b for b in results if b["batch"] == r["batch"] and b["mode"] == "no_mtp")
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['mode']:<12}{r['batch']:>6}{r['tokens_per_s']:>10.1f}{r['speedup']:>10.2f}{r['steps']:>7}"
              f"{r['acceptance']:>8.2f}{r['state_bytes_per_request']:>13}")
    RESULTS.mkdir(exist_ok=True)
    meta = {"backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
            "new_tokens": args.new_tokens}
    (RESULTS / "decode.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, RESULTS / "decode.png")


if __name__ == "__main__":
    main()
