"""Server start-up: seconds from launch to `/health` 200, and the latency of the first completion request after
it, with an empty compilation cache (cold) and again with the cache the cold start filled (warm); jaxhybrid on
the embedded default model beside vLLM-CPU on a 40M checkpoint.

jaxhybrid is the README's first command, `python -m jaxhybrid.serve`, with its compilation cache in a fresh
temporary directory. It answers `/health` once the engine is built and compiles its buckets on a worker thread
meanwhile: the first request waits for its buckets' compiles only, and the cold start is left running until
every bucket is compiled (its log says so), so that the warm start finds all of them in the cache. Each start
reports how many programs it added to the cache (a warm start that adds none recompiled nothing) and when every
bucket was ready. `--baseline PATH` adds another checkout (e.g. `git archive` of the commit before a change),
measured in the same run.

vLLM is `vllm.entrypoints.openai.api_server` as `vs_vllm.py` starts it (bf16, tcmalloc and its libiomp5
preloaded, 2 GiB of KV cache) with its OpenMP threads bound to both cores, as jaxhybrid computes on both, on
`--vllm-checkpoint` or else on vs_vllm.py's random ~40M-parameter checkpoint (`hf_peer.py write DIR moe`);
cold means fresh `VLLM_CACHE_ROOT` and `TORCHINDUCTOR_CACHE_DIR` (its torch.compile caches), warm reuses them.

    python benchmarks/startup.py --vllm-python PY [--vllm-checkpoint DIR] [--baseline /tmp/before]

Prints a table, writes benchmarks/results/startup.json and startup.png. The machine's other load shows in the
timings: run it on a quiet machine and compare sides of one run only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import serve_load
from common import figure, write_results  # benchmarks/ is sys.path[0]
from vs_vllm import BINDINGS, HERE, vllm_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def read_config(path):"
MAX_TOKENS = 16
ALL_COMPILED = re.compile(r"every bucket compiled: ")  # the background compile's last line
COMPILED_BEFORE_SERVING = re.compile(r"compiled \d+ buckets in ")  # a checkout that precompiles before it listens


def cache_entries(folder: Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file())


def wait_healthy(proc, base_url: str, timeout: float, log_path: Path) -> float:
    """Seconds from now until /health answers 200, polled every 0.1 s (`serve_load.wait_ready` polls each second)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{serve_load.tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no /health 200 within {timeout:.0f} s:\n{serve_load.tail(log_path)}")


def completion_seconds(base_url: str, timeout: float) -> float:
    """Latency of one greedy completion of MAX_TOKENS tokens (the served model's first name)."""
    model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return time.perf_counter() - start


def all_compiled_seconds(log_path: Path, launched: float, timeout: float, proc) -> float | None:
    """Seconds from launch until the server logged that every bucket is compiled; None for a server that
    compiled them all before it answered /health (or never says so)."""
    while time.perf_counter() - launched < timeout and proc.poll() is None:
        text = log_path.read_text(errors="replace")
        if ALL_COMPILED.search(text):
            return time.perf_counter() - launched
        if COMPILED_BEFORE_SERVING.search(text):
            return None
        time.sleep(0.5)
    return None


def start_once(command: list[str], env: dict[str, str], cwd: Path, log_path: Path, args: argparse.Namespace,
               background: bool) -> dict:
    """One start: seconds to /health 200, the first and a second request's latency, and (`background`) the
    seconds until every bucket was compiled; the server is stopped afterwards."""
    port = serve_load.free_port()
    base_url = f"http://{serve_load.HOST}:{port}"
    command = [*command, "--host", serve_load.HOST, "--port", str(port)]
    with serve_load.server(command, log_path, cwd, env) as proc:
        launched = time.perf_counter()
        row = {"health_s": wait_healthy(proc, base_url, args.timeout, log_path)}
        row["first_request_s"] = completion_seconds(base_url, args.timeout)
        row["second_request_s"] = completion_seconds(base_url, args.timeout)
        if background:
            row["all_compiled_s"] = all_compiled_seconds(log_path, launched, args.timeout, proc)
    return {name: None if value is None else round(value, 2) for name, value in row.items()}


def jaxhybrid_side(name: str, checkout: Path, args: argparse.Namespace, tmp: Path) -> dict:
    """The README's first command from `checkout`, cold then warm on one fresh compilation cache."""
    cache = tmp / f"{name}-xla"
    cache.mkdir()
    command = [sys.executable, "-m", "jaxhybrid.serve", "--compilation-cache-dir", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    row = {"side": name, "checkout": str(checkout), "cores": os.cpu_count()}
    for start in ("cold", "warm"):
        before = cache_entries(cache)
        measured = start_once(command, env, checkout, tmp / f"{name}-{start}.log", args, background=True)
        if measured["all_compiled_s"] is None:  # a checkout that compiles everything before it answers
            measured["all_compiled_s"] = measured["health_s"]
        row |= {f"{start}_{key}": value for key, value in measured.items()}
        row[f"{start}_new_programs"] = cache_entries(cache) - before
        print(f"{name} {start}: {measured}", flush=True)
    return row


def vllm_side(args: argparse.Namespace, tmp: Path) -> dict:
    """vLLM-CPU's server on the peer checkpoint, cold then warm on fresh torch.compile caches."""
    if args.vllm_checkpoint is None:
        args.vllm_checkpoint = tmp / "peer40m"
        subprocess.run([args.vllm_python, str(HERE / "hf_peer.py"), "write", str(args.vllm_checkpoint), "moe"],
                       check=True, capture_output=True)
    binding = BINDINGS["vllm_both"]
    env = vllm_env(args.vllm_python, binding) | {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
                                                 "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-cache")}
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.vllm_checkpoint),
               "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"]
    row = {"side": "vLLM-CPU", "checkout": str(args.vllm_checkpoint), "cores": f"2 (OMP bind {binding})"}
    for start in ("cold", "warm"):
        # vLLM compiles and captures everything before it answers: ready when healthy
        measured = start_once(command, env, tmp, tmp / f"vllm-{start}.log", args, background=False)
        row |= {f"{start}_{key}": value for key, value in measured.items()} | {f"{start}_all_compiled_s":
                                                                                 measured["health_s"]}
        print(f"vLLM {start}: {measured}", flush=True)
    return row


def report(rows: list[dict]) -> None:
    print(f"{'side':<14}{'start':>6}{'/health s':>11}{'1st request s':>15}{'2nd request s':>15}"
          f"{'all compiled s':>16}{'programs':>10}")
    for row in rows:
        for start in ("cold", "warm"):
            print(f"{row['side']:<14}{start:>6}{row[f'{start}_health_s']:>11}{row[f'{start}_first_request_s']:>15}"
                  f"{row[f'{start}_second_request_s']:>15}{row[f'{start}_all_compiled_s']:>16}"
                  f"{row.get(f'{start}_new_programs', '-'):>10}")


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 4)) as (_, axes):
        for ax, start in zip(axes, ("cold", "warm"), strict=True):
            sides = [row["side"] for row in rows]
            health = [row[f"{start}_health_s"] for row in rows]
            first = [row[f"{start}_first_request_s"] for row in rows]
            ax.bar(sides, health, label="launch to /health 200")
            ax.bar(sides, first, bottom=health, label="then the first request")
            ax.set_title(f"{start} start, seconds")
            ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="a Python with vllm-cpu installed (without it: jaxhybrid only)")
    parser.add_argument("--vllm-checkpoint", type=Path, help="vLLM's checkpoint (default: `hf_peer.py write DIR moe`)")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for each phase")
    args = parser.parse_args()
    sides = [lambda tmp: jaxhybrid_side("jaxhybrid", ROOT, args, tmp)]
    sides += [lambda tmp: vllm_side(args, tmp)] if args.vllm_python else []
    sides += [lambda tmp: jaxhybrid_side("baseline", args.baseline.resolve(), args, tmp)] if args.baseline else []
    rows, meta = [], {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    with tempfile.TemporaryDirectory(prefix="startup_") as folder:
        for side in sides:
            rows.append(side(Path(folder)))
            path = write_results("startup", rows, meta)  # after each side: a long run keeps what it measured
    report(rows)
    plot(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
