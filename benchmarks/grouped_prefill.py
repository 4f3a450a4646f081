"""Application-directed checkpoints at work: 1 anchor of P tokens x N candidates of S tokens.

Three ways to run the same prompts on the embedded default model (one new token each):
  marker       `anchor <|mamba_checkpoint|> candidate`: the anchor's state is computed once, by the
               producer, and every candidate starts from it (prefix caching on);
  no_marker    the plain prompts in one batch, prefix caching off: every candidate recomputes the anchor;
  one_by_one   the plain prompts one request at a time (the same work as no_marker, no batching).
The bound is the FLOP ratio of no_marker to marker, N (P + S) / (P + N S): what skipping the repeated
anchor can save at best. The speedup is measured time no_marker / marker, in the same run, and reported
as a fraction of the bound (target on CPU: >= 0.7 at N = 16 and 64, time per candidate near flat in N).
Every run uses a fresh random anchor, so no run hits another's cache; compilation happens before timing.

Prints a table, writes benchmarks/results/grouped_prefill.json and grouped_prefill.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER

PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def make_llm(caching: bool, anchor: int, candidate: int, max_n: int) -> LLM:
    llm = LLM(enable_prefix_caching=caching, num_blocks=max_n * (anchor + candidate + 64) // 16 + 64,
              num_state_slots=2 * max_n + 16, max_num_seqs=max_n, max_num_batched_tokens=2048,
              max_model_len=anchor + candidate + 16, mamba_block_size=64, token_buckets=(256, 2048),
              row_buckets=tuple(sorted({4, max_n})))
    llm.engine.precompile(progress=False)
    return llm


def job(rng: np.random.Generator, vocab: int, marker: int, anchor: int, candidate: int,
        n: int) -> tuple[list, list[list[int]]]:
    """Random tokens (never the marker itself) for an anchor and n candidates."""
    ids = lambda count: [t if t != marker else marker - 1 for t in rng.integers(0, vocab, count).tolist()]
    return ids(anchor), [ids(candidate) for _ in range(n)]


def timed(llm: LLM, prompts: list, one_by_one: bool = False) -> float:
    start = time.perf_counter()
    if one_by_one:
        for prompt in prompts:
            llm.generate([prompt], PARAMS, use_tqdm=False)
    else:
        llm.generate(prompts, PARAMS, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchor", type=int, default=2048)
    parser.add_argument("--candidate", type=int, default=128)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    cached, plain = (make_llm(caching, args.anchor, args.candidate, max(args.n)) for caching in (True, False))
    marker, vocab = cached.get_tokenizer().token_id(CHECKPOINT_MARKER), cached.model.config.vocab_size
    rng = np.random.default_rng(0)
    # warm-up: one small job through each engine
    anchor, candidates = job(rng, vocab, marker, args.anchor, args.candidate, 2)
    timed(cached, [anchor + [marker] + c for c in candidates])
    timed(plain, [anchor + c for c in candidates])
    results = []
    for n in args.n:
        anchor, candidates = job(rng, vocab, marker, args.anchor, args.candidate, n)
        computed = cached.engine.stats.prefill_tokens
        t_marker = timed(cached, [anchor + [marker] + c for c in candidates])
        computed = cached.engine.stats.prefill_tokens - computed
        anchor, candidates = job(rng, vocab, marker, args.anchor, args.candidate, n)
        t_plain = timed(plain, [anchor + c for c in candidates])
        t_single = timed(plain, [anchor + c for c in candidates], one_by_one=True)
        bound = n * (args.anchor + args.candidate) / (args.anchor + n * args.candidate)
        speedup = t_plain / t_marker
        results.append({"n": n, "marker_s": t_marker, "no_marker_s": t_plain, "one_by_one_s": t_single,
                        "marker_tokens_computed": computed, "bound": bound, "speedup": speedup,
                        "fraction_of_bound": speedup / bound, "marker_s_per_candidate": t_marker / n})
    print(f"{'N':>4}{'marker s':>10}{'no marker':>11}{'1-by-1':>9}{'tokens':>8}{'speedup':>9}{'bound':>7}"
          f"{'of bound':>10}{'s/cand':>8}")
    for r in results:
        print(f"{r['n']:>4}{r['marker_s']:>10.2f}{r['no_marker_s']:>11.2f}{r['one_by_one_s']:>9.2f}"
              f"{r['marker_tokens_computed']:>8}{r['speedup']:>9.2f}{r['bound']:>7.2f}{r['fraction_of_bound']:>10.2f}"
              f"{r['marker_s_per_candidate']:>8.3f}")
    write_results("grouped_prefill", results, {"anchor": args.anchor, "candidate": args.candidate,
                                               "model": "embedded default (qwen3_next, 1.7M params)"})
    plot(results, RESULTS / "grouped_prefill.png")


def plot(results: list[dict], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (left, right)):
        ns = [r["n"] for r in results]
        for key, label in (("marker_s", "marker"), ("no_marker_s", "no marker"), ("one_by_one_s", "one by one")):
            left.plot(ns, [r[key] / r["n"] for r in results], marker="o", label=label)
        left.set(xscale="log", yscale="log", xlabel="candidates N", ylabel="seconds per candidate")
        left.legend()
        right.plot(ns, [r["speedup"] for r in results], marker="o", label="measured speedup")
        right.plot(ns, [r["bound"] for r in results], linestyle="--", label="FLOP-ratio bound")
        right.set(xscale="log", xlabel="candidates N", ylabel="no marker / marker")
        right.legend()


if __name__ == "__main__":
    main()
