"""Offline scoring of 1 anchor x N candidates: `LLM.score_candidates` (what `python -m jaxhybrid.run_batch` runs) with
checkpoint reuse, without it, and HuggingFace transformers' full forwards, on one random ~40M-parameter
Qwen3-Next checkpoint.

The anchor has 2048 tokens, each candidate 64-256 (seeded), N in --candidates (default 16, 64, 256).
transformers runs in the Python given by `--hf-python` (never a dependency) through `benchmarks/hf_peer.py`,
which also writes the checkpoint; it scores in batches of 4, right-padded. Checks: every candidate token's
logprob agrees with transformers' to 1e-3. Reported per N: seconds per candidate of each method, the speedup
over transformers (target on CPU: >= 10x with reuse), and the speedup of reuse over no reuse against its
FLOP-ratio bound, the ratio of prompt tokens the engine computed without and with reuse (read from its
counters; target: >= 70% of the bound).

Prints a table, writes benchmarks/results/scoring.json and scoring.png (time per candidate against N).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]

from jaxhybrid import LLM

PEER = Path(__file__).parent / "hf_peer.py"
ANCHOR, SHORTEST, LONGEST, HF_BATCH = 2048, 64, 256, 4


def workload(vocab: int, count: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    anchor = rng.integers(1, vocab, ANCHOR).tolist()
    return anchor, [rng.integers(1, vocab, rng.integers(SHORTEST, LONGEST + 1)).tolist() for _ in range(count)]


def ours(llm: LLM, anchor: list[int], candidates: list[list[int]], reuse: bool) -> dict:
    before = llm.engine.stats.prefill_tokens
    start = time.perf_counter()
    scores = llm.score_candidates(anchor, candidates, reuse=reuse)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": llm.engine.stats.prefill_tokens - before,
            "values": [c.token_logprobs for c in scores.candidates]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-python", required=True, help="a Python with torch and transformers installed")
    parser.add_argument("--candidates", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        params = int(subprocess.run([args.hf_python, str(PEER), "write", str(directory)], check=True,
                                    capture_output=True, text=True).stdout.split()[-1])
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        jobs = {f"n{n}": dict(zip(("anchor", "candidates"), workload(vocab, n), strict=True), kind="score",
                              batch=HF_BATCH) for n in args.candidates}
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        subprocess.run([args.hf_python, str(PEER), "run", str(directory), str(Path(tmp) / "jobs.json"),
                        str(Path(tmp) / "hf.json")], check=True)
        hf = json.loads((Path(tmp) / "hf.json").read_text())
        llm = LLM(directory, skip_tokenizer_init=True, max_num_seqs=64, max_num_batched_tokens=2048,
                  max_model_len=ANCHOR + LONGEST + 16, num_blocks=64 * (ANCHOR + LONGEST + 16) // 16 + 512,
                  num_state_slots=160, mamba_block_size=16, token_buckets=(256, 2048), row_buckets=(16, 64))
        start = time.perf_counter()
        llm.engine.precompile()
        compile_s = time.perf_counter() - start
        warm_anchor, warm = workload(vocab, 2, seed=99)
        ours(llm, warm_anchor, warm, True)
        for n in args.candidates:
            anchor, candidates = jobs[f"n{n}"]["anchor"], jobs[f"n{n}"]["candidates"]
            reuse, plain = ours(llm, anchor, candidates, True), ours(llm, anchor, candidates, False)
            reference = hf[f"n{n}"]
            diff = max(float(np.abs(np.array(a) - np.array(b)).max())
                       for run in (reuse, plain) for a, b in zip(run["values"], reference["values"], strict=True))
            bound = plain["tokens"] / reuse["tokens"]
            speedup = plain["seconds"] / reuse["seconds"]
            rows.append({"candidates": n, "reuse_s_per_candidate": reuse["seconds"] / n,
                         "no_reuse_s_per_candidate": plain["seconds"] / n,
                         "transformers_s_per_candidate": reference["seconds"] / n,
                         "vs_transformers": reference["seconds"] / reuse["seconds"], "reuse_speedup": speedup,
                         "flop_ratio_bound": bound, "of_bound": speedup / bound, "max_logprob_diff": diff,
                         "tokens_reuse": reuse["tokens"], "tokens_no_reuse": plain["tokens"]})
    print(f"checkpoint: random Qwen3-Next, {params / 1e6:.1f}M parameters; anchor {ANCHOR} tokens, candidates "
          f"{SHORTEST}-{LONGEST}; jaxhybrid compile {compile_s:.0f} s")
    print(f"{'N':>5}{'reuse s/c':>11}{'no-reuse s/c':>14}{'HF s/c':>9}{'x HF':>7}{'reuse x':>9}{'bound':>7}"
          f"{'of bound':>10}{'max |dlp|':>11}")
    for r in rows:
        print(f"{r['candidates']:>5}{r['reuse_s_per_candidate']:>11.3f}{r['no_reuse_s_per_candidate']:>14.3f}"
              f"{r['transformers_s_per_candidate']:>9.3f}{r['vs_transformers']:>7.2f}{r['reuse_speedup']:>9.2f}"
              f"{r['flop_ratio_bound']:>7.2f}{r['of_bound']:>10.2f}{r['max_logprob_diff']:>11.1e}")
    write_results("scoring", rows, {"parameters": params, "compile_s": compile_s, "anchor": ANCHOR,
                                    "candidate_lengths": [SHORTEST, LONGEST], "hf_batch": HF_BATCH})
    plot(rows, RESULTS / "scoring.png")
    assert all(r["max_logprob_diff"] <= 1e-3 for r in rows), "scores disagree with transformers"


def plot(rows: list[dict], path: Path) -> None:


    n = [r["candidates"] for r in rows]
    with figure(path, figsize=(6, 4)) as (fig, ax):
        for key, label in (("reuse_s_per_candidate", "jaxhybrid, checkpoint reuse"),
                           ("no_reuse_s_per_candidate", "jaxhybrid, no reuse"),
                           ("transformers_s_per_candidate", "transformers")):
            ax.plot(n, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="candidates N", ylabel="seconds per candidate",
               title=f"1 anchor ({ANCHOR} tokens) x N candidates")
        ax.legend()


if __name__ == "__main__":
    main()
