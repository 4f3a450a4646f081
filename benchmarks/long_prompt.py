"""Long prompts: prefill tokens/s and time to first token, jaxhybrid against vLLM (its CPU build), same checkpoint.

One prompt at a time of each length (random token ids, no prefix-cache hit: every prompt is fresh), one new token
(greedy), so a request's time is its time to first token, and prompt tokens / that time its prefill rate. Both
sides: bf16, the checkpoint's max_position_embeddings raised by `--hf-overrides` to the longest prompt (+ 64), so
that each engine's max_model_len is the model's own (jaxhybrid sizes its pools for it), prompts prefilled in chunks
of CHUNK tokens (`max_num_batched_tokens`), tcmalloc preloaded. vLLM runs through `vs_vllm.run_vllm` (its
`vllm_peer.py`, the OpenMP binding of `vs_vllm.vllm_env`) on both cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`), as
jaxhybrid; each side runs an untimed warm-up prompt (the shortest length, 8,192 at most) before each length's.

  python benchmarks/long_prompt.py --vllm-python /work/scratch/vllm-venv/bin/python [--checkpoint DIR]
      [--lengths 8192 32768 131072] [--repeats 2]

Without --checkpoint, the Python given as --vllm-python writes vs_vllm's random ~40M Qwen3-Next MoE
(`hf_peer.py write DIR moe`). Prints a table, writes benchmarks/results/long_prompt.json and long_prompt.png
(other --lengths: long_prompt_<lengths>.json and .png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import peer_work as peer
import vs_vllm
from common import figure, write_results  # benchmarks/ is sys.path[0]

from jaxhybrid import LLM
from jaxhybrid.malloc import preload_tcmalloc

CHUNK = 2048  # prompt tokens per step, both sides
DEFAULT_LENGTHS = [8192, 32768]
WARMUP = 8192  # tokens of the untimed prompt: several chunks, every compiled shape
BINDING = vs_vllm.BINDINGS["vllm_both"]


def work(vocab: int, lengths: list[int], repeats: int) -> dict:
    """One job per length: a warm-up prompt (WARMUP tokens at most) and `repeats` timed prompts of that length."""
    rng = np.random.default_rng(0)
    ids = lambda n: peer.random_ids(rng, vocab, n)  # noqa: E731
    return {f"prompt_{n}": {"kind": "generate", "new_tokens": 1, "warmup": [ids(min(*lengths, WARMUP))],
                            "repeats": [[ids(n)] for _ in range(repeats)]} for n in lengths}


def run_ours(directory: Path, overrides: dict, jobs: dict) -> tuple[dict, float]:
    """jaxhybrid's results for `jobs` (vllm_peer.py's format) and its start-up seconds (every bucket compiled)."""
    start = time.perf_counter()
    llm = LLM(str(directory), dtype="bfloat16", skip_tokenizer_init=True, hf_overrides=overrides, max_num_seqs=2,
              max_num_batched_tokens=CHUNK, token_buckets=(2, CHUNK), row_buckets=(2,))
    llm.engine.precompile(progress=False)
    startup = time.perf_counter() - start
    results = {}
    for name, job in jobs.items():
        peer.generate(llm, job["warmup"], 1)
        results[name] = [dict(zip(("seconds", "values"), peer.generate(llm, prompts, 1), strict=True))
                         for prompts in job["repeats"]]
    return results, startup


def rows(jobs: dict, ours: dict, theirs: dict) -> list[dict]:
    out = []
    for name, job in jobs.items():
        length = len(job["repeats"][0][0])
        ttft = {side: float(np.mean([r["seconds"] for r in results[name]]))
                for side, results in (("jaxhybrid", ours), ("vllm", theirs))}
        out.append({"prompt_tokens": length, "ttft_s": ttft,
                    "prefill_tokens_per_s": {side: length / seconds for side, seconds in ttft.items()},
                    "same_first_token": float(np.mean([a["values"] == b["values"]
                                                       for a, b in zip(ours[name], theirs[name], strict=True)]))})
    return out


def report(results: list[dict], meta: dict) -> None:
    print(f"checkpoint {meta['checkpoint']}; bf16; chunks of {CHUNK}; both sides on the same {os.cpu_count()} "
          f"cores (shared with other users: load average {os.getloadavg()[0]:.1f}); vLLM {meta['vllm_version']}")
    print(f"{'prompt':>8}{'TTFT jaxhybrid s':>18}{'TTFT vLLM s':>13}{'prefill tok/s jaxhybrid':>25}"
          f"{'prefill tok/s vLLM':>20}{'ratio':>7}{'same token':>12}")
    for r in results:
        rate = r["prefill_tokens_per_s"]
        print(f"{r['prompt_tokens']:>8}{r['ttft_s']['jaxhybrid']:>18.2f}{r['ttft_s']['vllm']:>13.2f}"
              f"{rate['jaxhybrid']:>25.0f}{rate['vllm']:>20.0f}{rate['jaxhybrid'] / rate['vllm']:>7.2f}"
              f"{r['same_first_token']:>12.2f}")


def plot(results: list[dict], path: Path) -> None:
    with figure(path, figsize=(6, 3.5)) as (fig, ax):
        x = np.arange(len(results))
        for offset, side, label in ((-0.2, "jaxhybrid", "jaxhybrid"), (0.2, "vllm", "vLLM (CPU)")):
            ax.bar(x + offset, [r["prefill_tokens_per_s"][side] for r in results], 0.4, label=label)
        ax.set_xticks(x, [f"{r['prompt_tokens'] // 1024}k" for r in results])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens/s (one prompt)")
        ax.set_title("long-prompt prefill, bf16, CPU, same cores")
        ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed")
    parser.add_argument("--checkpoint", type=Path, help="a Qwen3-Next checkpoint (default: vs_vllm's, written)")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="long_prompt_") as tmp:
        tmp = Path(tmp)
        directory = args.checkpoint
        if directory is None:
            directory = tmp / "ckpt"
            subprocess.run([args.vllm_python, str(vs_vllm.HERE / "hf_peer.py"), "write", str(directory), "moe"],
                           check=True, capture_output=True)
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        overrides = {"max_position_embeddings": max(args.lengths) + 64}
        jobs = work(vocab, args.lengths, args.repeats)
        print(f"vLLM (VLLM_CPU_OMP_THREADS_BIND={BINDING})", flush=True)
        theirs = vs_vllm.run_vllm(args.vllm_python, BINDING, directory, jobs, tmp, engine={
            "hf_overrides": overrides, "max_model_len": None, "max_num_seqs": 2, "max_num_batched_tokens": CHUNK,
            "skip_tokenizer_init": True})
        print("jaxhybrid", flush=True)
        ours, startup = run_ours(directory, overrides, jobs)
    results = rows(jobs, ours, theirs)
    meta = {"checkpoint": str(args.checkpoint or "hf_peer.py moe (random)"), "chunk": CHUNK, "repeats": args.repeats,
            "hf_overrides": overrides, "vllm_omp_bind": BINDING, "jaxhybrid_startup_s": startup,
            "jaxhybrid_ld_preload": os.environ.get("LD_PRELOAD", ""),
            "vllm_ld_preload": vs_vllm.vllm_env(args.vllm_python, BINDING).get("LD_PRELOAD", ""),
            "vllm_version": subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                           capture_output=True, text=True).stdout.strip()}
    report(results, meta)
    # other lengths keep the default run's results
    name = "_".join(["long_prompt", *([] if args.lengths == DEFAULT_LENGTHS else map(str, args.lengths))])
    plot(results, write_results(name, results, meta).with_suffix(".png"))


if __name__ == "__main__":
    preload_tcmalloc()  # vLLM gets tcmalloc too (vs_vllm.vllm_env): both sides on the same allocator
    main()
