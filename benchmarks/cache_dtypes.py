"""Cache dtypes against the auto pools: `--kv-cache-dtype fp8` and `--mamba-ssm-cache-dtype bfloat16`, alone and
together, on the embedded default model (or --model).

Each setting greedily continues the same N prompts (code, as the default model was trained on) by --new-tokens.
Against auto (KV in the model's dtype, fp32 states), per setting: the greedy agreeing prefix (the tokens before the
first that differs; mean and min over the prompts; --new-tokens where all agree), and the |logprob difference| of
the chosen tokens over that prefix (max and mean). Capacity: the KV blocks and state slots the pools get from the
same memory budget. Measured, not gated: fp8 KV and bf16 states round what they store.

Prints a table, writes benchmarks/results/cache_dtypes.json and cache_dtypes.png.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import numpy as np
from common import figure, write_results  # benchmarks/ is sys.path[0]
from tqdm import tqdm

from jaxhybrid import LLM
from jaxhybrid.sample.params import SamplingParams

SETTINGS = {"auto": ("auto", "auto"), "fp8 KV": ("fp8", "auto"), "bf16 states": ("auto", "bfloat16"),
            "fp8 KV + bf16 states": ("fp8", "bfloat16")}
SOURCES = sorted((Path(__file__).parents[1] / "jaxhybrid").rglob("*.py"))


def prompts(count: int, lines: int, seed: int = 0) -> list[str]:
    """`count` runs of `lines` lines of the repository's own Python, from seeded places."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        text = SOURCES[rng.integers(len(SOURCES))].read_text().splitlines()
        if len(text) > lines:
            start = int(rng.integers(len(text) - lines))
            out.append("\n".join(text[start:start + lines]) + "\n")
    return out


def run(model: str | None, kv: str, state: str, texts: list[str], new_tokens: int) -> dict:
    llm = LLM(model, kv_cache_dtype=kv, mamba_ssm_cache_dtype=state, max_model_len=1024, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(texts, params, use_tqdm=False)
    runs = [[(t, p[t].logprob) for t, p in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
            for o in outputs]
    result = {"num_blocks": llm.config.num_blocks - 1, "num_state_slots": llm.config.num_state_slots - 1,
              "runs": runs}
    del llm
    gc.collect()
    return result


def agreement(runs: list, auto: list) -> dict:
    """Agreeing prefix lengths and |logprob differences| of the tokens in them, against auto's runs."""
    prefixes, differences = [], []
    for ours, theirs in zip(runs, auto, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a[0] != b[0]), len(ours))
        prefixes.append(same)
        differences += [abs(a[1] - b[1]) for a, b in zip(ours[:same], theirs[:same], strict=True)]
    return {"prefix_mean": float(np.mean(prefixes)), "prefix_min": int(min(prefixes)),
            "all_agree": sum(p == len(r) for p, r in zip(prefixes, runs, strict=True)),
            "logprob_max": float(max(differences, default=0.0)), "logprob_mean": float(np.mean(differences or [0.0]))}


def plot(results: dict, prompts: int, new_tokens: int, path: Path) -> None:
    """Capacity against auto (left) and agreement with auto (right), per setting."""
    names, auto = list(results), results["auto"]
    x = np.arange(len(names))
    with figure(path, 1, 2, figsize=(10, 3.5)) as (fig, (capacity, agree)):
        for offset, key, label in ((-0.2, "num_blocks", "KV blocks"), (0.2, "num_state_slots", "state slots")):
            capacity.bar(x + offset, [results[n][key] / auto[key] for n in names], 0.4, label=label)
        capacity.set_ylabel("x auto's")
        capacity.set_title("pool capacity, same memory", fontsize=10)
        capacity.legend(fontsize=8)
        agree.bar(x, [results[n]["prefix_mean"] for n in names], 0.5, label="mean agreeing prefix")
        agree.plot(x, [results[n]["prefix_min"] for n in names], "kv", label="shortest")
        agree.set_ylim(0, new_tokens)
        agree.set_ylabel("greedy tokens equal to auto's")
        agree.set_title(f"agreement with auto, {prompts} prompts x {new_tokens} tokens", fontsize=10)
        agree.legend(fontsize=8, loc="lower left")
        for ax in (capacity, agree):
            ax.set_xticks(x, names, fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-lines", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    texts = prompts(args.prompts, args.prompt_lines)
    measured = {name: run(args.model, *dtypes, texts, args.new_tokens)
                for name, dtypes in tqdm(SETTINGS.items(), total=len(SETTINGS), desc="settings")}
    auto = measured["auto"]
    results = {}
    print(f"{'setting':<22} {'KV blocks':>10} {'slots':>7} {'prefix mean':>12} {'min':>4} {'all':>6} "
          f"{'max |dlogp|':>12} {'mean |dlogp|':>13}")
    for name, got in measured.items():
        results[name] = {"kv_cache_dtype": SETTINGS[name][0], "mamba_ssm_cache_dtype": SETTINGS[name][1],
                         "num_blocks": got["num_blocks"], "num_state_slots": got["num_state_slots"],
                         **agreement(got["runs"], auto["runs"])}
        r = results[name]
        print(f"{name:<22} {r['num_blocks']:>10} {r['num_state_slots']:>7} {r['prefix_mean']:>12.1f} "
              f"{r['prefix_min']:>4} {r['all_agree']:>3}/{len(texts):<2} {r['logprob_max']:>12.4f} "
              f"{r['logprob_mean']:>13.5f}")
    meta = {"model": args.model or "(embedded default)", "prompts": len(texts), "prompt_lines": args.prompt_lines,
            "new_tokens": args.new_tokens}
    plot(results, len(texts), args.new_tokens, write_results("cache_dtypes", results, meta).with_suffix(".png"))


if __name__ == "__main__":
    main()
