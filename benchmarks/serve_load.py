"""Load an OpenAI-compatible server the way `vllm bench serve` does, and check what it streams back.

Random prompts (token ids drawn uniformly from the tokenizer's non-special vocabulary, decoded to text,
lengths in [len*(1-ratio), len*(1+ratio)]) go to {base-url}/v1/completions as streams with
include_usage, at --request-rate (Poisson arrivals, seeded) and at most --max-concurrency at once. Per request:
TTFT (send -> first chunk with text), ITL (gaps between text chunks), TPOT ((E2EL - TTFT) / (tokens - 1)) and
E2EL; token counts from the usage chunk (streamed chunks otherwise). Every completed stream must be well-formed:
each `data:` line is JSON with `choices`, the usage chunk has `choices: []`, the last line is `data: [DONE]`.
4xx, 5xx, errors inside a stream and client disconnects (--disconnect-fraction: clients that close their
stream after a few chunks, on purpose, so not failures) are counted apart. --check-drained then polls
GET /metrics until the server's running/waiting requests and KV/state-slot usage are back at 0.

Prints vLLM's report (same labels, same layout) plus a "Stream Checks" section; --save-result writes
benchmarks/results/<result-name>.json (vLLM's fields plus num_4xx, num_5xx, num_disconnected, malformed,
drained) and <result-name>.png.

--compare is the side-by-side with HuggingFace transformers on the random ~40M-parameter Qwen3-Next
checkpoint of `hf_peer.py write` (tokenizer included): `transformers serve` from --hf-python, then
`python -m jaxhybrid.serve` (this Python, plus --ours-args), one after the other on the same prompts (greedy,
eos ignored). Prints both reports and a table (jaxhybrid, transformers, ratio), writes
benchmarks/results/serve_load_vs_transformers.json and .png; the target is >= 3x transformers' output-token
throughput at an equal or better p99 TTFT. transformers 5.23 quirks: `--continuous-batching` fails on the
first request for Qwen3-Next (its paged cache knows no `linear_attention` layers: "Invalid layer type", a
500), so the baseline is its default, one request at a time; it answers 422 to `ignore_eos` (--backend
transformers sends generation_config min_new_tokens instead); its streams end without `data: [DONE]` and
carry usage in the last chunk with choices, which the checks count as malformed (not as failures).

Exit status 1 when a request failed, a stream was malformed or the server did not drain (in --compare, ours).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]
from tokenizers import Tokenizer
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
PEER, REPO = HERE / "hf_peer.py", HERE.parent
HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 3600.0
DRAIN_SERIES = ("jaxhybrid:num_requests_running", "jaxhybrid:num_requests_waiting",
                "jaxhybrid:kv_cache_usage_perc", "jaxhybrid:state_slot_usage_perc")
LINE = "{:<40} {:<10}"  # vLLM's row layout; the labels are what scripts grep for
LINE_F = "{:<40} {:<10.2f}"


@dataclass
class Sample:
    prompt: str
    prompt_len: int  # sampled ids; the server's own count comes back in the usage chunk
    output_len: int
    disconnect_after: int | None  # text chunks to read before closing the stream, for the disconnecting clients


@dataclass
class Outcome:
    kind: str = "error"  # ok | disconnected | 4xx | 5xx | stream_error | error
    status: int | None = None
    error: str = ""
    malformed: list[str] = field(default_factory=list)
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0


class StreamCheck:
    """Reads one SSE stream line by line: the text it carries, its usage, and how it breaks the OpenAI shape."""

    def __init__(self) -> None:
        self.done, self.usage, self.error, self.problems = False, None, None, []

    def problem(self, reason: str) -> str:
        if reason not in self.problems:
            self.problems.append(reason)
        return ""

    def feed(self, line: str) -> str:
        if not line or line.startswith(":"):  # event separator, SSE comment (keep-alive)
            return ""
        if not line.startswith("data:"):
            return self.problem("a line that is not data:")
        payload = line[5:].strip()
        if self.done:
            self.problem("data after [DONE]")
        if payload == "[DONE]":
            self.done = True
            return ""
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            return self.problem("data that is not JSON")
        if isinstance(chunk, dict) and "error" in chunk:
            self.error = str(chunk["error"])[:300]
            return ""
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list):
            return self.problem("a chunk without choices")
        if chunk.get("usage") is not None:
            if self.usage is not None:
                self.problem("two usage chunks")
            self.usage = chunk["usage"]
            if choices:
                self.problem("usage in a chunk with choices")
        elif not choices:
            self.problem("empty choices without usage")
        elif self.usage is not None:
            self.problem("text after the usage chunk")
        return "".join(c.get("text") or "" for c in choices if isinstance(c, dict))

    def finish(self) -> list[str]:
        if not self.done:
            self.problem("no data: [DONE]")
        if self.usage is None:
            self.problem("no usage chunk")
        return self.problems


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"no tokenizer.json in {directory}: pass --tokenizer DIR")
    return Tokenizer.from_file(str(path))


def lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, n)


def sample_requests(args: argparse.Namespace, tokenizer: Tokenizer) -> list[Sample]:
    # separate streams, so --disconnect-fraction never changes the prompts of a seed
    rng, pick = np.random.default_rng([args.seed, 0]), np.random.default_rng([args.seed, 1])
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    vocab = np.array([i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special])
    inputs = lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outputs = lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    leaving = set(pick.choice(args.num_prompts, round(args.disconnect_fraction * args.num_prompts), replace=False)
                  .tolist())
    after = pick.integers(1, 4, args.num_prompts)  # "a few chunks": 1 to 3
    return [Sample(tokenizer.decode(rng.choice(vocab, int(n)).tolist()), int(n), int(m),
                   int(after[i]) if i in leaving else None)
            for i, (n, m) in enumerate(zip(inputs, outputs, strict=True))]


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    times = np.cumsum(np.random.default_rng([seed, 2]).exponential(1 / rate, n))
    return times * (n / rate) / times[-1]  # as vLLM: the run lasts exactly n / rate, so seeds compare


def request_body(sample: Sample, model: str | None, backend: str, args: argparse.Namespace) -> dict:
    body = {"prompt": sample.prompt, "max_tokens": sample.output_len, "stream": True,
            "stream_options": {"include_usage": True}}  # transformers serve ignores it and sends usage anyway
    if model:
        body["model"] = model
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.ignore_eos and backend == "transformers":  # it answers 422 to ignore_eos; min_new_tokens does that
        body["generation_config"] = json.dumps({"min_new_tokens": sample.output_len})
    elif args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, sample: Sample, tokenizer: Tokenizer) -> Outcome:
    out, check, chunks = Outcome(start=time.perf_counter()), StreamCheck(), 0
    last = out.start
    try:
        async with client.stream("POST", url, json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.kind = "5xx" if response.status_code >= 500 else "4xx"
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not check.feed(line):
                    continue
                chunks += 1
                if chunks == 1:
                    out.ttft = now - out.start
                else:
                    out.itl.append(now - last)
                last = now
                if sample.disconnect_after is not None and chunks >= sample.disconnect_after:
                    out.kind, out.e2el = "disconnected", now - out.start
                    return out  # leaving the block closes the connection mid-stream
        out.e2el = time.perf_counter() - out.start
    except (httpx.HTTPError, OSError) as error:
        out.error = f"{type(error).__name__} after {time.perf_counter() - out.start:.1f} s, {chunks} chunks: {error}"
        return out
    if check.error is not None:
        out.kind, out.error = "stream_error", f"error in stream: {check.error}"
        return out
    out.kind, out.malformed = "ok", check.finish()
    out.ttft = out.ttft if chunks else out.e2el
    usage = check.usage or {}
    out.output_tokens = int(usage.get("completion_tokens") or chunks)
    out.prompt_tokens = int(usage.get("prompt_tokens") or len(tokenizer.encode(body["prompt"]).ids))
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (`name{model_name="..."} value [timestamp]`)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # label values may hold spaces and braces: the value follows the last '}'
            name, fields = line[:line.index("{")], line[line.rindex("}") + 1:].split()
        else:
            name, *fields = line.split()
        with contextlib.suppress(IndexError, ValueError):
            values[name] = values.get(name, 0.0) + float(fields[0])
    return values


async def check_drained(client: httpx.AsyncClient, base_url: str, timeout: float) -> dict:
    """Polls /metrics until every DRAIN_SERIES is 0; a series that never shows up counts as not drained."""
    start, seen, error = time.perf_counter(), {}, None
    while True:
        try:
            response = await client.get(f"{base_url}/metrics", timeout=10)
            response.raise_for_status()
            values = parse_prometheus(response.text)
            seen, error = {s: values.get(s) for s in DRAIN_SERIES}, None
            if all(v == 0 for v in seen.values()):
                return {"drained": True, "series": seen, "waited_s": time.perf_counter() - start}
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"
        if time.perf_counter() - start > timeout:
            return {"drained": False, "series": seen, "waited_s": time.perf_counter() - start, "error": error}
        await asyncio.sleep(0.5)


async def benchmark(args: argparse.Namespace, samples: list[Sample], tokenizer: Tokenizer, base_url: str,
                    model: str | None, backend: str, drain: bool) -> dict:
    url = base_url + args.endpoint
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        if model is None:
            model = await first_model(client, base_url)
        warm = Sample(samples[0].prompt, samples[0].prompt_len, samples[0].output_len, None)
        for _ in range(args.num_warmups):
            await send(client, url, request_body(warm, model, backend, args), warm, tokenizer)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        progress = tqdm(total=len(samples), disable=args.disable_tqdm)

        async def one(sample: Sample) -> Outcome:
            async with limit:
                outcome = await send(client, url, request_body(sample, model, backend, args), sample, tokenizer)
            progress.update()
            return outcome

        start, tasks = time.perf_counter(), []
        for sample, at in zip(samples, arrival_times(len(samples), args.request_rate, args.seed), strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(sample)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        drain = await check_drained(client, base_url, args.drain_timeout) if drain else None
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend, "base_url": base_url,
              "model_id": model, "num_prompts": len(samples),
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "max_concurrency": args.max_concurrency, **summarize(outcomes, duration)}
    result["drained"] = None if drain is None else drain["drained"]
    result["drain"] = drain
    return result


async def first_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """As vLLM: the first of /v1/models; None (no model field) where the server cannot list them."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        response = await client.get(f"{base_url}/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    return None


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    ok = [o for o in outcomes if o.kind == "ok"]
    failed = [o for o in outcomes if o.kind not in ("ok", "disconnected")]
    tpots = [(o.e2el - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    series = {"ttft": [o.ttft for o in ok], "tpot": tpots, "itl": [x for o in ok for x in o.itl],
              "e2el": [o.e2el for o in ok]}
    total_in, total_out = sum(o.prompt_tokens for o in ok), sum(o.output_tokens for o in ok)
    reasons: dict[str, int] = {}
    for o in ok:
        for reason in o.malformed:
            reasons[reason] = reasons.get(reason, 0) + 1
    result = {"duration": duration, "completed": len(ok), "failed": len(failed), "total_input_tokens": total_in,
              "total_output_tokens": total_out, "request_throughput": len(ok) / duration,
              "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
              **peaks(ok)}
    for name, values in series.items():
        ms = np.array(values or [0.0]) * 1000
        result |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                   f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}
    kinds = [o.kind for o in outcomes]
    result |= {"num_4xx": kinds.count("4xx"), "num_5xx": kinds.count("5xx"),
               "num_stream_errors": kinds.count("stream_error"), "num_other_errors": kinds.count("error"),
               "num_disconnected": kinds.count("disconnected"), "malformed": sum(1 for o in ok if o.malformed),
               "malformed_reasons": reasons, "errors": sorted({o.error for o in failed})[:10],
               "ttfts": series["ttft"], "e2els": series["e2el"]}  # for the plot; not saved
    return result


def peaks(ok: list[Outcome]) -> dict:
    """vLLM's peaks: the most text chunks in one wall-clock second, and the most requests in flight at once."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    origin = min(o.start for o in ok)
    times = np.concatenate([o.start + o.ttft + np.cumsum([0.0, *o.itl]) for o in ok]) - origin
    events = sorted([(o.start, 1) for o in ok] + [(o.start + o.e2el, -1) for o in ok])
    return {"max_output_tokens_per_s": float(np.bincount(times.astype(int)).max()),
            "max_concurrent_requests": int(np.cumsum([d for _, d in events]).max())}


def print_report(r: dict) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(LINE.format("Successful requests:", r["completed"]))
    print(LINE.format("Failed requests:", r["failed"]))
    if r["max_concurrency"] is not None:
        print(LINE.format("Maximum request concurrency:", r["max_concurrency"]))
    if r["request_rate"] != "inf":
        print(LINE_F.format("Request rate configured (RPS):", r["request_rate"]))
    print(LINE_F.format("Benchmark duration (s):", r["duration"]))
    print(LINE.format("Total input tokens:", r["total_input_tokens"]))
    print(LINE.format("Total generated tokens:", r["total_output_tokens"]))
    print(LINE_F.format("Request throughput (req/s):", r["request_throughput"]))
    print(LINE_F.format("Output token throughput (tok/s):", r["output_throughput"]))
    print(LINE_F.format("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]))
    print(LINE_F.format("Peak concurrent requests:", r["max_concurrent_requests"]))
    print(LINE_F.format("Total token throughput (tok/s):", r["total_token_throughput"]))
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print(LINE_F.format(f"Mean {name} (ms):", r[f"mean_{key}_ms"]))
        print(LINE_F.format(f"Median {name} (ms):", r[f"median_{key}_ms"]))
        print(LINE_F.format(f"P99 {name} (ms):", r[f"p99_{key}_ms"]))
    print("{s:{c}^{n}}".format(s="Stream Checks", n=50, c="-"))
    print(LINE.format("Client disconnects (intended):", r["num_disconnected"]))
    print(LINE.format("HTTP 4xx responses:", r["num_4xx"]))
    print(LINE.format("HTTP 5xx responses:", r["num_5xx"]))
    print(LINE.format("Errors inside streams:", r["num_stream_errors"]))
    print(LINE.format("Other client errors:", r["num_other_errors"]))
    print(LINE.format("Malformed streams:", r["malformed"]))
    if r["drained"] is not None:
        print(LINE.format("Drained after the run:", "yes" if r["drained"] else "NO"))
    print("=" * 50)
    for reason, count in r["malformed_reasons"].items():
        print(f"malformed: {count} x {reason}")
    for error in r["errors"]:
        print(f"error: {error}")
    if r["drain"] is not None and not r["drained"]:
        print(f"not drained after {r['drain']['waited_s']:.0f} s: {r['drain']['series']} {r['drain'].get('error')}")


def healthy(r: dict) -> bool:
    return r["failed"] == 0 and r["malformed"] == 0 and r["drained"] is not False


def save(result: dict, name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(without_raw(result), indent=1))
    return path


def without_raw(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("ttfts", "e2els")}


def plot(runs: dict[str, dict], path: Path) -> None:
    with figure(path, 1, 3, figsize=(12, 3.5)) as (fig, axes):
        names = list(runs)
        colors = [f"C{i}" for i in range(len(names))]
        for ax, key, label, fmt in ((axes[0], "output_throughput", "output tokens/s", "%.1f"),
                                    (axes[1], "p99_ttft_ms", "p99 TTFT (ms)", "%.0f")):
            ax.bar_label(ax.bar(names, [runs[n][key] for n in names], color=colors), fmt=fmt)
            ax.set_ylabel(label)
        for n, color in zip(names, colors, strict=True):
            for key, style in (("ttfts", "-"), ("e2els", ":")):
                values = np.sort(np.array(runs[n][key]) * 1000)
                axes[2].plot(values, np.arange(1, len(values) + 1) / max(len(values), 1), style, color=color,
                             label=f"{n} {key[:-1].upper()}")
        axes[2].set_xscale("log")
        axes[2].set_xlabel("ms")
        axes[2].set_ylabel("fraction of requests")
        axes[2].legend(fontsize=7)
        first = runs[names[0]]
        fig.suptitle(f"{first['num_prompts']} prompts, concurrency {first['max_concurrency']}, "
                     f"rate {first['request_rate']}")


def single(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer or args.model or ".")
    samples = sample_requests(args, tokenizer)
    result = asyncio.run(benchmark(args, samples, tokenizer, args.base_url.rstrip("/"), args.model, args.backend,
                                   args.check_drained))
    print_report(result)
    if args.save_result:
        path = save(result, args.result_name)
        plot({args.backend: result}, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if healthy(result) else 1


# ---- --compare: transformers serve, then jaxhybrid.serve, on the same prompts ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None):
    """A server in its own process group, logging to log_path; SIGTERM (SIGKILL after 30 s) to the whole
    group on the way out, whatever happened, so nothing it spawned outlives the benchmark."""
    print(f"starting: {shlex.join(cmd)}  (log {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError):  # children that outlived their parent
                os.killpg(proc.pid, signal.SIGKILL)


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, log_path: Path) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{tail(log_path)}")


def wait_compiled(proc: subprocess.Popen, timeout: float, log_path: Path) -> float:
    """Seconds until a jaxhybrid server's log says its background compile ended (every bucket compiled, or the
    walk stopped): its steady state, as vLLM's /health comes after its own warm-up."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail(log_path)}")
        text = log_path.read_text(errors="replace")
        if "every bucket compiled" in text or "background compile stopped" in text:
            return time.perf_counter() - start
        time.sleep(1)
    raise RuntimeError(f"server still compiling after {timeout:.0f} s:\n{tail(log_path)}")


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def serve_and_load(name: str, cmd: list[str], cwd: Path, port: int, logs: Path, args: argparse.Namespace,
                   samples: list[Sample], tokenizer: Tokenizer, model: str, backend: str, drain: bool) -> dict:
    base_url, log_path = f"http://{HOST}:{port}", logs / f"{name}.log"
    with server(cmd, log_path, cwd) as proc:
        ready_s = wait_ready(proc, base_url, args.server_timeout, log_path)
        print(f"{name} healthy after {ready_s:.0f} s; {len(samples)} prompts", flush=True)
        result = asyncio.run(benchmark(args, samples, tokenizer, base_url, model, backend, drain))
    result |= {"label": name, "command": shlex.join(cmd), "ready_s": ready_s}
    print(f"\n{name}:")
    print_report(result)
    return result


ROWS = (("Successful requests", "completed", "{:.0f}"), ("Failed requests", "failed", "{:.0f}"),
        ("Benchmark duration (s)", "duration", "{:.2f}"), ("Total input tokens", "total_input_tokens", "{:.0f}"),
        ("Total generated tokens", "total_output_tokens", "{:.0f}"),
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
        ("Peak output token throughput (tok/s)", "max_output_tokens_per_s", "{:.2f}"),
        ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
        *((f"{stat.capitalize()} {name} (ms)", f"{stat}_{key}_ms", "{:.2f}")
          for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
          for stat in ("mean", "median", "p99")),
        ("Malformed streams", "malformed", "{:.0f}"), ("HTTP 5xx responses", "num_5xx", "{:.0f}"),
        ("Client disconnects (intended)", "num_disconnected", "{:.0f}"))


def compare(args: argparse.Namespace) -> int:
    args.ignore_eos = True  # both servers generate exactly the sampled lengths (vLLM does so for random prompts)
    args.temperature = 0.0 if args.temperature is None else args.temperature
    logs = Path(tempfile.mkdtemp(prefix="serve_load_logs_"))
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        directory = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "ckpt"
        params = None
        if not args.checkpoint:
            params = int(subprocess.run([args.hf_python, str(PEER), "write", str(directory)], check=True,
                                        capture_output=True, text=True, cwd=tmp).stdout.split()[-1])
        tokenizer = load_tokenizer(directory)
        samples = sample_requests(args, tokenizer)
        port = free_port()
        # `transformers serve DIR` pins the server to DIR: requests must name exactly DIR (or no model)
        hf_cmd = [args.hf_python, "-m", "transformers.cli.transformers", "serve", str(directory), "--host", HOST,
                  "--port", str(port), *shlex.split(args.hf_serve_args)]
        theirs = serve_and_load("transformers", hf_cmd, Path(tmp), port, logs, args, samples, tokenizer,
                                str(directory), "transformers", drain=False)  # it has no /metrics
        port = free_port()
        ours_cmd = [sys.executable, "-m", "jaxhybrid.serve", "--model", str(directory), "--host", HOST, "--port",
                    str(port), *shlex.split(args.ours_args)]
        ours = serve_and_load("jaxhybrid", ours_cmd, REPO, port, logs, args, samples, tokenizer, str(directory),
                              "openai", drain=args.check_drained)
    ratio = {key: ours[key] / theirs[key] if theirs[key] else float("nan") for _, key, _ in ROWS}
    print(f"\n{'metric':<40}{'jaxhybrid':>12}{'transformers':>14}{'ratio':>8}")
    for label, key, fmt in ROWS:
        shown = "-" if math.isnan(ratio[key]) else f"{ratio[key]:.2f}"
        print(f"{label:<40}{fmt.format(ours[key]):>12}{fmt.format(theirs[key]):>14}{shown:>8}")
    met = ratio["output_throughput"] >= 3 and ours["p99_ttft_ms"] <= theirs["p99_ttft_ms"]
    print(f"target: >= 3x output throughput ({ratio['output_throughput']:.2f}x) at an equal or better p99 TTFT "
          f"({ours['p99_ttft_ms']:.0f} vs {theirs['p99_ttft_ms']:.0f} ms): {'met' if met else 'NOT met'}")
    print(f"server logs: {logs}")
    meta = {k: getattr(args, k) for k in ("num_prompts", "request_rate", "max_concurrency", "random_input_len",
                                          "random_output_len", "random_range_ratio", "seed", "disconnect_fraction",
                                          "temperature", "ours_args", "hf_serve_args")}
    meta["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    meta["parameters"] = params
    results = {"jaxhybrid": without_raw(ours), "transformers": without_raw(theirs)}
    path = write_results("serve_load_vs_transformers", results, meta, ratio=ratio, target_met=met)
    plot({"jaxhybrid": ours, "transformers": theirs}, path.with_suffix(".png"))
    return 0 if healthy(ours) else 1


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=f"http://{HOST}:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--backend", choices=("openai", "transformers"), default="openai",
                        help="transformers: `transformers serve`, which rejects ignore_eos")
    parser.add_argument("--model", help="the model field (default: the first of /v1/models, else none)")
    parser.add_argument("--tokenizer", help="a directory with tokenizer.json (default: --model)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, requests/s")
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, help="default: the server's (0 in --compare)")
    parser.add_argument("--num-warmups", type=int, default=0, help="untimed copies of the first request")
    parser.add_argument("--disconnect-fraction", type=float, default=0.0,
                        help="this fraction of clients closes its stream after 1-3 chunks")
    parser.add_argument("--check-drained", action="store_true", help="then wait for /metrics to show an idle server")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-name", default="serve_load", help="benchmarks/results/<name>.json and .png")
    parser.add_argument("--compare", action="store_true", help="transformers serve vs python -m jaxhybrid.serve")
    parser.add_argument("--hf-python", help="a Python with torch, transformers and its serving extra (--compare)")
    parser.add_argument("--checkpoint", help="reuse this hf_peer.py checkpoint instead of writing one (--compare)")
    parser.add_argument("--ours-args", default="", help="more flags for python -m jaxhybrid.serve (--compare)")
    parser.add_argument("--hf-serve-args", default="--device cpu", help="more flags for transformers serve")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    return parser


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    if args.compare and not args.hf_python:
        cli.error("--compare needs --hf-python")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: no orphaned servers
    sys.exit(compare(args) if args.compare else single(args))


if __name__ == "__main__":
    main()
