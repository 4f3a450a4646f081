"""Adversarial requests against `python -m jaxhybrid.serve` and vLLM's OpenAI server (its CPU build), side by side.

Both serve the same random ~40M-parameter Qwen3-Next MoE checkpoint (`hf_peer.py write DIR moe`, written by
`--vllm-python` as in vs_vllm.py, or `--checkpoint DIR`), bf16, behind `--api-key`, on 127.0.0.1 and a free port,
one server at a time on the same cores (no taskset, as vs_vllm.py; vLLM with its recommended preloads and
`VLLM_CPU_OMP_THREADS_BIND=--vllm-binding`, jaxhybrid with tcmalloc: this script re-executes itself with it). Ours
runs with the tests' small buckets (tests/jaxhybrid/serve/server_process.py) so it compiles in seconds; vLLM with
vs_vllm.py's flags.

PROBES, one row each: absurd `n` (2**63, 2**64, 10**20, 20000), a 50 MB prompt, 5 MB to /tokenize without the
key, long token lists (`allowed_token_ids`, `logit_bias`, `bad_words`, a million zeros), 32- and 64-bit `top_k`, a
lone surrogate (the JSON escape \\ud800) in each text field, a malformed / 10,000-deep / non-UTF-8 body, an unknown
route and a wrong method, and an X-Request-Id that must not come back in an error. For each, on each server:
  status      the HTTP status, "timeout" (no answer in --timeout s) or "connection error";
  seconds     until the answer;
  openai      whether the body is `{"error": {"message": str, "type": str, "param": ..., "code": ...}}`;
  health_max  the slowest GET /health of a poller asking every 50 ms, from the probe's start until both it and
              the canary have answered (each capped at --timeout);
  canary      seconds for `{"prompt": "Hello", "max_tokens": 4, "temperature": 0}` (with the key), sent 0.5 s
              after the probe;
  rss         the resident memory of the server's process group (vLLM: API server + engine core) before and after;
  after       the server afterwards: "ok" when /health is 200 and a canary answers, else "died ..." or
              "unhealthy ..."/"hung ...", and then it is restarted (within --start-timeout) for the next probes.
After the last probe each server's /health is recorded, then it is stopped.

  python benchmarks/abuse.py --vllm-python PY   # both: ~4 min on 2 cores, 2 of them vLLM's start (torch.compile)
  python benchmarks/abuse.py --checkpoint DIR    # ours only

Prints a table, writes benchmarks/results/abuse.json and abuse.png (canary latency and the slowest /health per
probe, both servers, log scale). Server logs stay in a temporary folder whose path is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import serve_load
from common import figure, write_results  # benchmarks/ is sys.path[0]
from tqdm import tqdm
from vs_vllm import vllm_env

from jaxhybrid.malloc import preload_tcmalloc

HERE = Path(__file__).resolve().parent
# tests/jaxhybrid/serve/server_process.py's SMALL buckets, with room for a 1024-token context
OURS_FLAGS = ["--dtype", "bfloat16", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "32",
              "--row-buckets", "4", "--num-blocks", "160", "--num-state-slots", "24", "--max-model-len", "1024"]
VLLM_FLAGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"]  # vs_vllm.py's
CANARY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
CANARY_DELAY_S, POLL_S, SETTLE_S = 0.5, 0.05, 30.0
LEAK = "abc'def"


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    path: str
    body: Callable[[], bytes | None]  # built just before it is sent: the 50 MB prompt lives for one probe
    key: bool = True
    headers: dict[str, str] = field(default_factory=dict)


def as_json(**fields) -> Callable[[], bytes]:
    return lambda: json.dumps(fields).encode()


def raw(text: str | bytes) -> Callable[[], bytes]:
    return lambda: text if isinstance(text, bytes) else text.encode()


def probes(vocab: int) -> list[Probe]:
    """The requests, in order; token ids below the checkpoint's vocabulary."""
    hi = dict(prompt="Hi", max_tokens=1)
    completion = lambda name, body, **kw: Probe(name, "POST", "/v1/completions", body, **kw)
    return [
        *(completion(f"n={label}", as_json(**hi, n=n)) for label, n in (("2**63", 2**63), ("2**64", 2**64),
                                                                        ("10**20", 10**20), ("20000", 20000))),
        completion("prompt 50 MB", as_json(prompt="a b " * 12_500_000, max_tokens=1)),
        Probe("tokenize 5 MB, no key", "POST", "/tokenize", as_json(prompt="a b " * 1_250_000), key=False),
        completion("allowed_token_ids 1k", as_json(**hi, allowed_token_ids=list(range(min(1000, vocab))))),
        completion("logit_bias 4096 ids", as_json(**hi, logit_bias={str(i): 1.0 for i in range(min(4096, vocab))})),
        completion("bad_words 10k", as_json(**hi, bad_words=[f"w{i}" for i in range(10_000)])),
        completion("allowed_token_ids [0]*1e6", as_json(**hi, allowed_token_ids=[0] * 10**6)),
        completion("top_k=2**31", as_json(**hi, top_k=2**31)),
        completion("top_k=2**63-1", as_json(**hi, top_k=2**63 - 1)),
        # the six characters \ud800 in the body: a lone surrogate once decoded
        completion("surrogate prompt", raw('{"prompt": "\\ud800", "max_tokens": 1}')),
        Probe("surrogate chat content", "POST", "/v1/chat/completions",
              raw('{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}')),
        completion("surrogate bad_words", raw('{"prompt": "Hi", "max_tokens": 1, "bad_words": ["\\ud800"]}')),
        completion("surrogate request_id", raw('{"prompt": "Hi", "max_tokens": 1, "request_id": "\\ud800"}')),
        Probe("surrogate tokenize, no key", "POST", "/tokenize", raw('{"prompt": "\\ud800"}'), key=False),
        completion("malformed JSON", raw('{"prompt": "Hi", "max_tokens": 1')),
        completion("10k-deep array prompt", raw('{"prompt": ' + "[" * 10_000 + "]" * 10_000 + ', "max_tokens": 1}')),
        completion("invalid UTF-8", raw(b'{"prompt": "\xff\xfe\xc3", "max_tokens": 1}')),
        Probe("GET /v1/nope", "GET", "/v1/nope", raw(b"")),
        Probe("GET /v1/completions", "GET", "/v1/completions", raw(b"")),
        completion("X-Request-Id echo", as_json(prompt="Hi", max_tokens=-3), headers={"X-Request-Id": LEAK}),
    ]


# -- one request, and what it answered ------------------------------------------------------------------------

async def call(client: httpx.AsyncClient, method: str, url: str, timeout: float, content: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int | str, float, bytes]:
    """(status or "timeout"/"connection error", seconds, body); never longer than `timeout` in all."""
    start = time.perf_counter()
    try:
        response = await asyncio.wait_for(client.request(method, url, content=content or None, headers=headers,
                                                         timeout=timeout), timeout)
        return response.status_code, time.perf_counter() - start, response.content
    except (TimeoutError, httpx.TimeoutException):
        return "timeout", time.perf_counter() - start, b""
    except (httpx.HTTPError, OSError) as error:
        return "connection error", time.perf_counter() - start, f"{type(error).__name__}: {error}".encode()


def openai_error(body: bytes) -> bool:
    try:
        document = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return False
    error = document.get("error") if isinstance(document, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error)


def group_rss_mb(pgid: int) -> float:
    """VmRSS summed over the processes of a process group (the server runs in a session of its own)."""
    total_kb = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:  # after the name: state ppid pgrp
                continue
            line = next(x for x in (stat.parent / "status").read_text().splitlines() if x.startswith("VmRSS:"))
            total_kb += int(line.split()[1])
    return total_kb / 1024


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def canary(client: httpx.AsyncClient, base_url: str, key: str, timeout: float,
                 delay: float = 0.0) -> tuple[int | str, float]:
    await asyncio.sleep(delay)
    status, seconds, _ = await call(client, "POST", f"{base_url}/v1/completions", timeout,
                                    json.dumps(CANARY).encode(), auth(key))
    return status, seconds


async def poll_health(client: httpx.AsyncClient, base_url: str, until: list[asyncio.Task],
                      deadline: float) -> dict:
    """GET /health every POLL_S until every task in `until` is done: the slowest answer and the non-200s."""
    slowest, polls, bad = 0.0, 0, {}
    while not all(t.done() for t in until) and (now := time.perf_counter()) < deadline:
        status, seconds, _ = await call(client, "GET", f"{base_url}/health", max(0.1, deadline - now))
        polls, slowest = polls + 1, max(slowest, seconds)
        if status != 200:
            bad[str(status)] = bad.get(str(status), 0) + 1
        await asyncio.sleep(max(0.0, POLL_S - seconds))
    return {"health_max_s": slowest, "health_polls": polls, "health_not_200": bad}


async def measure(base_url: str, probe: Probe, key: str, timeout: float) -> dict:
    """The probe, the /health poller and the canary at once."""
    content = probe.body()
    headers = (auth(key) if probe.key else {"Content-Type": "application/json"}) | probe.headers
    async with httpx.AsyncClient() as a, httpx.AsyncClient() as b, httpx.AsyncClient() as c:
        start = time.perf_counter()
        sent = asyncio.create_task(call(a, probe.method, base_url + probe.path, timeout, content, headers))
        canaried = asyncio.create_task(canary(b, base_url, key, timeout, CANARY_DELAY_S))
        health = await poll_health(c, base_url, [sent, canaried], start + CANARY_DELAY_S + timeout + 1)
        (status, seconds, body), (canary_status, canary_s) = await sent, await canaried
    del content
    return {"status": status, "seconds": seconds, "openai": openai_error(body), "body": body[:300].decode(
        errors="replace"), "body_bytes": len(body), **health, "canary_status": canary_status, "canary_s": canary_s,
        **({"leak": LEAK.encode() in body} if LEAK in probe.headers.values() else {})}


# -- a server that can be restarted ---------------------------------------------------------------------------

class Server:
    """One side's server (serve_load.server: its own session, SIGTERM then SIGKILL to the group on stop)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str] | None, logs: Path, cwd: Path,
                 start_timeout: float):
        self.name, self.command, self.env, self.logs, self.cwd = name, command, env, logs, cwd
        self.start_timeout, self.starts, self.proc = start_timeout, [], None
        self._stack = contextlib.ExitStack()

    def start(self, key: str, timeout: float) -> dict:
        """Started, healthy, and warmed up by one untimed canary (a first request may compile or load more)."""
        port = serve_load.free_port()
        self.base_url = f"http://{serve_load.HOST}:{port}"
        self.log = self.logs / f"{self.name}.{len(self.starts)}.log"
        self.proc = self._stack.enter_context(serve_load.server(
            [*self.command, "--host", serve_load.HOST, "--port", str(port)], self.log, self.cwd, self.env))
        try:
            ready = serve_load.wait_ready(self.proc, self.base_url, self.start_timeout, self.log)
        except RuntimeError:
            self.stop()
            raise
        status, warmup = asyncio.run(canary_once(self.base_url, key, timeout))
        self.starts.append({"ready_s": ready, "warmup_s": warmup, "warmup_status": status})
        return self.starts[-1]

    def stop(self) -> None:
        self._stack.close()
        self.proc = None

    def log_tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback") if self.log.exists() else 0


async def canary_once(base_url: str, key: str, timeout: float) -> tuple[int | str, float]:
    async with httpx.AsyncClient() as client:
        return await canary(client, base_url, key, timeout)


async def health(base_url: str) -> int | str:
    async with httpx.AsyncClient() as client:
        return (await call(client, "GET", f"{base_url}/health", 10.0))[0]


async def settled(server: Server, key: str, timeout: float) -> str:
    """"ok" when the process lives, /health turns 200 within SETTLE_S and a canary answers 200."""
    async with httpx.AsyncClient() as client:
        deadline = time.perf_counter() + SETTLE_S
        while True:
            if server.proc.poll() is not None:
                return f"died (exit {server.proc.returncode})"
            status, _, _ = await call(client, "GET", f"{server.base_url}/health", 5.0)
            if status == 200:
                break
            if time.perf_counter() > deadline:
                return f"unhealthy (/health {status})"
            await asyncio.sleep(0.5)
        status, _ = await canary(client, server.base_url, key, timeout)
    return "ok" if status == 200 else f"hung (canary {status})"


def run_side(server: Server, todo: list[Probe], key: str, timeout: float, progress: tqdm) -> tuple[list[dict], dict]:
    """Every probe against one server, restarting it after one that killed or hung it."""
    rows, meta = [], {"command": shlex.join(server.command), "restarts": []}
    try:
        meta["start"] = server.start(key, timeout)
    except RuntimeError as error:
        progress.update(len(todo))
        return [{"status": "not run", "error": str(error)[-500:]} for _ in todo], meta | {"final_health": None}
    for probe in todo:
        progress.set_postfix_str(f"{server.name}: {probe.name}")
        if server.proc is None:
            rows.append({"status": "not run", "after": "server down"})
            progress.update()
            continue
        rss_before, tracebacks = group_rss_mb(server.proc.pid), server.log_tracebacks()
        row = asyncio.run(measure(server.base_url, probe, key, timeout))
        row |= {"rss_before_mb": rss_before, "rss_after_mb": group_rss_mb(server.proc.pid)}
        row["after"] = asyncio.run(settled(server, key, timeout))
        row["tracebacks"] = server.log_tracebacks() - tracebacks
        if row["after"] != "ok":
            tqdm.write(f"{server.name}: {row['after']} after {probe.name!r}; restarting (log {server.log})")
            server.stop()
            try:
                meta["restarts"].append({"after": probe.name, **server.start(key, timeout)})
            except RuntimeError as error:
                meta["restarts"].append({"after": probe.name, "error": str(error)[-500:]})
        rows.append(row)
        progress.update()
    if server.proc is not None:
        meta["final_health"] = asyncio.run(health(server.base_url))
        server.stop()
    else:
        meta["final_health"] = None
    return rows, meta


# -- the run --------------------------------------------------------------------------------------------------

def checkpoint(args: argparse.Namespace, tmp: Path) -> tuple[Path, int | None]:
    if args.checkpoint:
        return Path(args.checkpoint), None
    directory = tmp / "ckpt"
    written = subprocess.run([args.vllm_python, str(HERE / "hf_peer.py"), "write", str(directory), "moe"],
                             check=True, capture_output=True, text=True, cwd=tmp)
    return directory, int(written.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="a Python with vllm-cpu installed (without it: jaxhybrid only)")
    parser.add_argument("--checkpoint", help="an `hf_peer.py write DIR moe` checkpoint (default: written anew)")
    parser.add_argument("--api-key", default="abuse-key", help="both servers' Bearer key")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a probe, a canary or a /health may take")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a (re)start may take")
    parser.add_argument("--vllm-binding", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto: vLLM's default)")
    parser.add_argument("--ours-args", default="", help="more flags for python -m jaxhybrid.serve")
    parser.add_argument("--vllm-args", default="", help="more flags for vLLM's api_server")
    args = parser.parse_args()
    if not (args.vllm_python or args.checkpoint):
        parser.error("pass --vllm-python (it writes the checkpoint) or --checkpoint DIR")
    logs, start = Path(tempfile.mkdtemp(prefix="abuse_logs_")), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="abuse_") as tmp:
        directory, params = checkpoint(args, Path(tmp))
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        key = ["--api-key", args.api_key]
        servers = [Server("jaxhybrid", [sys.executable, "-m", "jaxhybrid.serve", "--model", str(directory),
                                        *OURS_FLAGS, *key, *shlex.split(args.ours_args)], None, logs, HERE.parent,
                          args.start_timeout)]
        if args.vllm_python:
            servers.append(Server("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                           str(directory), *VLLM_FLAGS, *key, *shlex.split(args.vllm_args)],
                                  vllm_env(args.vllm_python, args.vllm_binding), logs, Path(tmp), args.start_timeout))
        todo = probes(vocab)
        results, sides = {}, {}
        with tqdm(total=len(todo) * len(servers), desc="probes") as progress:
            for server in servers:
                results[server.name], sides[server.name] = run_side(server, todo, args.api_key, args.timeout, progress)
    cores = sorted(os.sched_getaffinity(0))
    sides["jaxhybrid"] |= {"cores": cores, "ld_preload": os.environ.get("LD_PRELOAD", "")}
    if args.vllm_python:
        env = vllm_env(args.vllm_python, args.vllm_binding)
        sides["vllm"] |= {"cores": cores, "omp_threads_bind": args.vllm_binding, "ld_preload": env.get("LD_PRELOAD"),
                          "kvcache_space_gib": env["VLLM_CPU_KVCACHE_SPACE"], "version": subprocess.run(
                              [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True).stdout.strip()}
    rows = [{"probe": p.name, "method": p.method, "path": p.path, "key": p.key,
             **{side: results[side][i] for side in results}} for i, p in enumerate(todo)]
    meta = {"parameters": params, "vocab_size": vocab, "timeout_s": args.timeout, "canary": CANARY,
            "run_s": time.perf_counter() - start, "servers": sides, "logs": str(logs)}
    report(rows, meta)
    plot(rows, list(results), args.timeout, write_results("abuse", rows, meta).with_suffix(".png"))


def cell(r: dict) -> str:
    if r.get("seconds") is None:  # not run: the server did not (re)start
        return f"{r['status']:>8}"
    canary = f"{r['canary_s']:.2f}" if r["canary_status"] == 200 else str(r["canary_status"])
    flags = ("" if r["openai"] or r["status"] == 200 else "*") + ("L" if r.get("leak") else "") + (
        "R" if r["after"] != "ok" else "")
    return f"{r['status']!s:>8}{r['seconds']:>7.2f}{r['health_max_s']:>7.2f}{canary:>8} {flags:<3}"


def report(rows: list[dict], meta: dict) -> None:
    sides = list(meta["servers"])
    for side, info in meta["servers"].items():
        start = info.get("start", {})
        print(f"{side}: cores {info['cores']}, healthy after {start.get('ready_s', float('nan')):.0f} s, warm-up "
              f"canary {start.get('warmup_s', float('nan')):.1f} s, {len(info['restarts'])} restarts, /health after "
              f"all probes: {info['final_health']}; {info['command']}")
    width = len(cell({"status": 0, "seconds": 0, "health_max_s": 0, "canary_status": 200, "canary_s": 0,
                      "openai": True, "after": "ok"}))
    print(f"{'':<27}" + "".join(f"| {side:<{width}}" for side in sides))
    print(f"{'probe':<27}" + f"| {'status':>8}{'s':>7}{'health':>7}{'canary':>8}    " * len(sides))
    for row in rows:
        print(f"{row['probe']:<27}" + "".join(f"| {cell(row[s]):<{width}}" for s in sides))
    print(f"s: seconds to answer; health: slowest /health meanwhile (s); canary: seconds, or its status. * error body "
          f"not OpenAI-shaped, L X-Request-Id leaked into the body, R server died or hung afterwards (restarted). "
          f"Timeout {meta['timeout_s']:.0f} s; run {meta['run_s']:.0f} s")


def plot(rows: list[dict], sides: list[str], timeout: float, path: Path) -> None:
    with figure(path, 2, 1, figsize=(11, 7), sharex=True) as (fig, axes):
        x = range(len(rows))
        for ax, key, status, label in ((axes[0], "canary_s", "canary_status", "canary latency (s)"),
                                       (axes[1], "health_max_s", None, "slowest /health (s)")):
            for i, side in enumerate(sides):
                results = [row[side] for row in rows]
                ok = [r.get(key) is not None and (status is None or r[status] == 200) for r in results]
                ax.scatter([j for j, good in zip(x, ok, strict=True) if good],
                           [max(r[key], 1e-3) for r, good in zip(results, ok, strict=True) if good], color=f"C{i}",
                           label=side, s=24)
                failed = [j for j, good in zip(x, ok, strict=True) if not good]
                if failed:  # drawn at the timeout
                    ax.scatter(failed, [timeout] * len(failed), color=f"C{i}", marker="x", s=40,
                               label=f"{side}: failed / not run")
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.axhline(timeout, color="gray", linewidth=0.8, linestyle=":")
            ax.legend(fontsize=7)
        axes[1].set_xticks(list(x), [row["probe"] for row in rows], rotation=60, ha="right", fontsize=7)
        fig.suptitle("adversarial probes: a canary completion and /health while each runs (log scale)")


if __name__ == "__main__":
    preload_tcmalloc()  # as vs_vllm.py: ours runs on tcmalloc, vLLM gets it from vllm_env
    main()
