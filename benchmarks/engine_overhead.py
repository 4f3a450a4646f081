"""The host's cost per engine step, serial vs one step ahead of the device (scheduler/resolve.py).

Loads, each run twice on the same engine (serial, then one step ahead), greedy with eos ignored so that
both runs schedule the same plans step for step:
  decode_b{16,64,256}  that many requests of 48-token prompts decoding 32 tokens each (MTP K = 0, and
                       K = 3 on the embedded model, which has an MTP head);
  mixed                96 requests of 16..240-token prompts and 8..48 new tokens through 32 rows:
                       prefill chunks join decode rows as requests finish and others are admitted.
Models: the embedded default model and a random 40M-parameter Qwen3-Next checkpoint (`--checkpoint`, or
written by `benchmarks/hf_peer.py write` through `--hf-python`).

Per step: the device time, from a replay of the serial run's plans with nothing else on the host (plan
i+1 is queued while i runs, so the device never waits, and the engine's thread itself sees i complete:
a thread that only watches for completions sees them late whenever another holds the GIL, and a step
run alone pays for waking the CPU "device"'s idle threads, which a busy device does not; the replay runs
before and after the run one step ahead, a step's time is the mean of the two, and their totals' spread,
reported, is how much the device itself drifted meanwhile: on a shared VM, tens of percent), the
host's time on the critical path (everything `Engine.step` does but wait for the device: schedule, the
placeholder update and resolve, packing and dispatch; in the serial run output processing too, which one
step ahead runs on the output thread during the wait, and counts only where the engine's thread waits
for it to finish), split by phase ("outputs" is the output thread's time), and the wall time. The host
time is given as wall time and as the host thread's CPU time: on a CPU "device" the step's computation
runs on the same cores as the host thread, so one step ahead the host's wall time grows by the
contention (a GPU's host keeps its cores); its CPU time is the work itself. A step's host
work is hidden when, as its dispatch returns, the step before is still running (`is_ready()` read on
the host thread). Reported: p50/p99/max of each, host/device at p99, the hidden
fraction, tokens/s of both runs, the ratio ahead/serial, and ahead against the device-only bound (the
tokens over the replay's time). Target: p99 host/device <= 0.5 where the device step is
at least 5 ms (over the steps whose device time is), and one step ahead within 5% of the device-only bound
there (loads whose median device step is).

Core layouts (`--cores`): `split` starts XLA's threads on every core but the lowest and then moves the
engine's thread alone to that one, so the device computes on its own cores as an accelerator does;
`shared` leaves every thread on every core (the CPU "device" then competes with the host). The engines'
processes run with MALLOC_TUNABLES below (`--glibc-tunables ''` for glibc's defaults).

Prints a table, writes benchmarks/results/engine_overhead.json and engine_overhead.png (another stem with
`--name`; the plot: a timeline of a few hundred steps of each mode, and host/device per load).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]
from tqdm import tqdm

import scheduler
from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.requests import Prompt

PEER = Path(__file__).parent / "hf_peer.py"
PHASES = ("schedule", "update", "resolve", "dispatch", "outputs")
# XLA:CPU's worker thread frees ~1.5k small blocks the engine's thread allocated at each dispatch; with glibc's
# defaults they land in the main arena's fast bins, and the engine thread's next large malloc consolidates them
# all (0.3-0.5 ms a step on the embedded model). Larger per-thread caches keep them off the engine's thread.
MALLOC_TUNABLES = "glibc.malloc.tcache_count=2000:glibc.malloc.mxfast=0"


class StepClock:
    """Wraps an engine's step, its scheduler transitions, dispatch and fetch to time every step."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps, self._current, self._originals = engine, [], None, []
        self._wrap_engine(engine)

    def close(self) -> None:
        """Put the wrapped functions back (the scheduler module's are shared by every engine)."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)

    def _timed(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def _wrap_engine(self, engine: Engine) -> None:
        for name, phase in (("schedule", "schedule"), ("update", "update"), ("resolve", "resolve")):
            self._timed(scheduler, name, phase)
        self._timed(engine.output_processor, "process", "outputs")
        runner, dispatch, fetch = engine.runner, engine.runner.dispatch, engine.runner.fetch
        self.outs, self.plans, self.pending = [], [], queue.Queue()
        self.dispatch = dispatch  # unwrapped, for the replay
        threading.Thread(target=self._completions, daemon=True).start()  # one waiter: no thread start per step

        def timed_dispatch(plan):
            start = time.perf_counter()
            out = dispatch(plan)
            now = time.perf_counter()
            self._current["dispatch"] += now - start
            previous = self.outs[-1] if self.outs else None
            # hidden: the step before still runs as this one is queued behind it
            self._current["hidden"] = previous is not None and not previous.tokens.is_ready()
            self._current["dispatched"] = now
            self.outs.append(out)
            self.plans.append(plan)
            self.pending.put((out, self._current))
            return out

        def timed_fetch(out):
            start = time.perf_counter()
            try:
                return fetch(out)
            finally:
                self._current["wait"] += time.perf_counter() - start

        self._originals += [(runner, "dispatch", dispatch), (runner, "fetch", fetch)]
        runner.dispatch, runner.fetch = timed_dispatch, timed_fetch

    def _completions(self) -> None:
        """Each dispatched step's completion time, in dispatch order (the device runs them in that order)."""
        while True:
            out, record = self.pending.get()
            out.tokens.block_until_ready()
            record["done"] = time.perf_counter()
            self.pending.task_done()

    def step(self) -> list:
        record = defaultdict(float, start=time.perf_counter())
        self._current = record
        cpu = time.thread_time()
        outputs = self.engine.step()
        record["end"] = time.perf_counter()
        record["host"] = record["end"] - record["start"] - record["wait"]
        record["host_cpu"] = time.thread_time() - cpu  # ~0 while blocked in fetch
        self.steps.append(record)
        return outputs


def drive(llm: LLM, clock: StepClock, arrivals: list[list[tuple]], ahead: bool) -> dict:
    """Add arrivals[i] before step i, run until everything has ended; returns wall seconds, generated
    tokens and the step records."""
    engine = llm.engine
    engine.async_scheduling = ahead
    clock.steps, clock.outs, clock.plans = [], [], []
    tokens, start, count = 0, time.perf_counter(), 0
    for step in range(100_000):
        for prompt, params in arrivals[step] if step < len(arrivals) else ():
            engine.add_request(f"{'ahead' if ahead else 'serial'}-{count}", Prompt(tuple(prompt)), params)
            count += 1
        if step >= len(arrivals) and not engine.has_unfinished_requests():
            break
        tokens += sum(len(o.outputs[0].token_ids) for o in clock.step() if o.finished)
    seconds = time.perf_counter() - start
    clock.pending.join()  # the completion times of the last steps
    return {"seconds": seconds, "tokens": tokens, "steps": [dict(s) for s in clock.steps], "plans": clock.plans}


def replay(clock: StepClock, plans: list) -> np.ndarray:
    """Each plan's device time, run back to back with no host work between: step i runs from its dispatch
    (or i-1's completion, if later) to its completion, seen by this thread waiting for it. The pools are
    fresh afterwards (the plans wrote into blocks and slots the scheduler has freed)."""
    times, done = [], 0.0
    out, dispatched_at = clock.dispatch(plans[0]), time.perf_counter()
    for plan in [*plans[1:], None]:
        following = clock.dispatch(plan) if plan is not None else None  # queued behind `out`
        following_at = time.perf_counter()
        out.tokens.block_until_ready()
        now = time.perf_counter()
        times.append(now - max(dispatched_at, done))
        out, dispatched_at, done = following, following_at, now
    clock.engine.runner.reset_state()
    return np.array(times)


def stats(values) -> dict:
    values = np.asarray(values, float) * 1e3
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "max_ms": float(values.max())}


def dispatched(steps: list[dict]) -> list[dict]:
    return [s for s in steps if "dispatched" in s]  # a call that only collects the last step dispatches nothing


def summarise(name: str, device: np.ndarray, serial: dict, ahead: dict) -> dict:
    """One load's row: device time from the replays, host time of both runs; the ratios step for step
    (both runs schedule the same plans)."""
    row = {"load": name, "steps": len(device), "device": stats(device),
           "host_serial": stats([s["host"] for s in dispatched(serial["steps"])]),
           "wall_serial": stats(np.diff([s["end"] for s in serial["steps"]])),
           "tokens_per_s_serial": serial["tokens"] / serial["seconds"],
           "device_bound_tokens_per_s": serial["tokens"] / device.sum()}
    steps = dispatched(ahead["steps"])
    host, host_cpu = np.array([s["host"] for s in steps]), np.array([s["host_cpu"] for s in steps])
    n = min(len(device), len(host))
    long = device[:n] >= 5e-3  # the steps the target is about
    row.update(host_ahead=stats(host), host_cpu_ahead=stats(host_cpu),
               wall_ahead=stats(np.diff([s["end"] for s in ahead["steps"]])),
               host_ahead_phases_p50_ms={p: float(np.median([s.get(p, 0.0) for s in steps]) * 1e3) for p in PHASES},
               p99_host_over_device=float(np.percentile(host[:n] / device[:n], 99)),
               p99_host_cpu_over_device=float(np.percentile(host_cpu[:n] / device[:n], 99)),
               long_steps=int(long.sum()),
               p99_host_over_device_long=float(np.percentile(host[:n][long] / device[:n][long], 99)) if long.any()
               else None,
               p99_host_cpu_over_device_long=float(np.percentile(host_cpu[:n][long] / device[:n][long], 99))
               if long.any() else None,
               hidden_fraction=float(np.mean([s["hidden"] for s in steps[1:]])),
               tokens_per_s_ahead=ahead["tokens"] / ahead["seconds"])
    row["ahead_over_serial"] = row["tokens_per_s_ahead"] / row["tokens_per_s_serial"]
    row["ahead_over_bound"] = row["tokens_per_s_ahead"] / row["device_bound_tokens_per_s"]
    row["target_applies"] = bool(row["device"]["p50_ms"] >= 5)
    if long.any():
        row["meets_target"] = bool(row["p99_host_over_device_long"] <= 0.5 and row["ahead_over_bound"] >= 0.95)
        row["meets_target_cpu_time"] = bool(row["p99_host_cpu_over_device_long"] <= 0.5
                                            and row["ahead_over_bound"] >= 0.95)
    return row


def workloads(vocab: int, seed: int = 0) -> dict[str, list[list[tuple]]]:
    """Arrivals per step: the decode loads all at once, the mixed one 3 requests a step for 32 steps."""
    rng = np.random.default_rng(seed)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompt = lambda n: rng.integers(3, vocab, n).tolist()
    out = {f"decode_b{b}": [[(prompt(48), greedy(32)) for _ in range(b)]] for b in (16, 64, 256)}
    out["mixed"] = [[(prompt(int(rng.integers(16, 240))), greedy(int(rng.integers(8, 48)))) for _ in range(3)]
                    for _ in range(32)]
    return out


def split_cores() -> tuple[int, set[int]]:
    """The split layout's cores: the lowest for the host's thread, the rest for the device."""
    host, *device = sorted(os.sched_getaffinity(0))
    if not device:
        raise SystemExit("--cores split needs at least two cores")
    return host, set(device)


def threads_on(cores: set[int]) -> int:
    """This process's threads allowed on `cores` only."""
    return sum(os.sched_getaffinity(int(task.name)) <= cores for task in Path("/proc/self/task").iterdir())


def run_model(model: str | None, k: int, names: list[str], layout: str) -> tuple[list[dict], dict]:
    label = "embedded" if model is None else "random_40m"
    if layout == "split":  # XLA's threads start with the backend, below: they keep the device's cores
        host_core, device = split_cores()
        os.sched_setaffinity(0, device)
    llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
              num_blocks=3072, num_state_slots=2 * 256 + 16, max_num_seqs=256, max_num_batched_tokens=1024,
              max_model_len=320, row_buckets=(16, 64, 256), token_buckets=(64, 256, 1024),
              enable_prefix_caching=False)
    llm.engine.precompile(progress=False)
    if layout == "split":
        os.sched_setaffinity(0, {host_core})  # on Linux, the calling thread's alone: the engine's loop
        print(f"split: host thread on core {host_core}, {threads_on(device)} threads on cores {sorted(device)}")
    clock = StepClock(llm.engine)
    work, rows, timelines = workloads(min(llm.model.config.vocab_size, 4096)), [], {}
    for name in tqdm(names, desc=f"{label} K={k}", unit="load"):
        for ahead in (False, True):  # warm caches, the allocator and the output thread
            drive(llm, clock, [work[name][0][:4]], ahead)
        serial = drive(llm, clock, work[name], False)
        plans = serial.pop("plans")
        before = replay(clock, plans)
        ahead = drive(llm, clock, work[name], True)
        ahead.pop("plans")
        after = replay(clock, plans)
        row = summarise(name, (before + after) / 2, serial, ahead)
        row["replay_spread"] = float(abs(before.sum() - after.sum()) / (before.sum() + after.sum()) * 2)
        row.update(model=label, k=k, cores=layout)
        rows.append(row)
        timelines[f"{label} K={k} {name} {layout}"] = {"serial": serial["steps"], "ahead": ahead["steps"]}
    clock.close()
    return rows, timelines


def checkpoint(args: argparse.Namespace, tmp: str) -> str:
    if args.checkpoint:
        return args.checkpoint
    directory = str(Path(tmp) / "random_40m")
    subprocess.run([args.hf_python, str(PEER), "write", directory], check=True, capture_output=True)
    return directory


def print_table(rows: list[dict]) -> None:
    """p99 h/d over every step, then over the steps of >= 5 ms (wall and CPU time): what the target is about."""
    fmt = lambda value: f"{value:>8.2f}" if value is not None else f"{'-':>8}"
    print(f"{'cores':<7}{'model':<11}{'K':>2} {'load':<12}{'steps':>6}{'device p50':>11}{'host ser p50':>13}"
          f"{'host ahead p50/p99':>20}{'p99 h/d':>8}{'>=5ms':>8}{'cpu':>8}{'hidden':>7}{'serial tok/s':>13}"
          f"{'ahead tok/s':>12}{'ahead/ser':>10}{'ahead/bound':>12}{'drift':>7}{'target':>8}")
    for r in rows:
        ahead = r["host_ahead"]
        print(f"{r['cores']:<7}{r['model']:<11}{r['k']:>2} {r['load']:<12}{r['steps']:>6}"
              f"{r['device']['p50_ms']:>9.1f}ms"
              f"{r['host_serial']['p50_ms']:>11.2f}ms{ahead['p50_ms']:>10.2f}/{ahead['p99_ms']:.2f}ms"
              f"{r['p99_host_over_device']:>8.2f}{fmt(r['p99_host_over_device_long'])}"
              f"{fmt(r['p99_host_cpu_over_device_long'])}{r['hidden_fraction']:>7.0%}{r['tokens_per_s_serial']:>13.0f}"
              f"{r['tokens_per_s_ahead']:>12.0f}{r['ahead_over_serial']:>10.3f}{r['ahead_over_bound']:>12.3f}"
              f"{r['replay_spread']:>7.0%}"
              f"{('met' if r['meets_target'] else 'missed') if 'meets_target' in r else '-':>8}")


def plot(rows: list[dict], timelines: dict, path: Path) -> None:

    # a decode load whose device step is a few times the host's work shows the gaps serial leaves
    key = "embedded K=0 decode_b64 split" if "embedded K=0 decode_b64 split" in timelines else next(iter(timelines))
    with figure(path, 3, 1, figsize=(12, 11), dpi=110) as (fig, axes):
        for ax, mode in zip(axes[:2], ("serial", "ahead"), strict=True):
            steps = dispatched(timelines[key][mode])[:300]
            t0 = steps[0]["start"]
            previous_done = 0.0
            for s in steps:
                ax.barh(1, (s["end"] - s["start"] - s["wait"]) * 1e3, left=(s["start"] - t0) * 1e3, color="tab:orange")
                begin = max(s["dispatched"], previous_done)
                ax.barh(0, (s["done"] - begin) * 1e3, left=(begin - t0) * 1e3, color="tab:blue")
                previous_done = s["done"]
            ax.set_yticks([0, 1], ["device", "host"])
            ax.set_xlabel("ms")
            ax.set_title(f"{key}: {mode} (first {len(steps)} steps)")
        labels = [f"{r['model']} K={r['k']}\n{r['load']} {r['cores']}" for r in rows]
        x = np.arange(len(rows))
        axes[2].bar(x - 0.25, [r["device"]["p50_ms"] for r in rows], 0.25, label="device p50")
        axes[2].bar(x, [r["host_ahead"]["p99_ms"] for r in rows], 0.25, label="host p99, wall (one step ahead)")
        axes[2].bar(x + 0.25, [r["host_cpu_ahead"]["p99_ms"] for r in rows], 0.25, label="host p99, CPU time")
        axes[2].set_xticks(x, labels, fontsize=6, rotation=60, ha="right")
        axes[2].set_yscale("log")
        axes[2].set_ylabel("ms per step")
        axes[2].legend()


def main() -> None:
    import matplotlib  # before the engines map their memory: a late import can fail to map its libraries
    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a random 40M-parameter checkpoint (else written with --hf-python)")
    parser.add_argument("--hf-python", help="a Python with torch and transformers, to write the checkpoint")
    parser.add_argument("--loads", nargs="+", default=["decode_b16", "decode_b64", "decode_b256", "mixed"])
    parser.add_argument("--skip-40m", action="store_true")
    parser.add_argument("--cores", nargs="+", choices=("split", "shared"), default=["split", "shared"],
                        help="split: the device (XLA's threads) on all cores but one, the host's thread on that one, "
                             "as with an accelerator; shared: every thread on every core")
    parser.add_argument("--glibc-tunables", default=MALLOC_TUNABLES,
                        help="GLIBC_TUNABLES for the engines' processes ('' for glibc's defaults)")
    parser.add_argument("--name", default="engine_overhead", help="results file stem in benchmarks/results/")
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "K", "CORES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one (model, K, cores) in this process; the driver below runs each in its own
        model, k, layout, out = args.one
        rows, timelines = run_model(model or None, int(k), args.loads, layout)
        Path(out).write_text(json.dumps({"rows": rows, "timelines": timelines}))
        return
    if not (args.checkpoint or args.hf_python or args.skip_40m):
        parser.error("give --checkpoint or --hf-python (or --skip-40m)")
    rows, timelines = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("", 0), ("", 3)] + ([] if args.skip_40m else [(checkpoint(args, tmp), 0)])
        env = dict(os.environ, GLIBC_TUNABLES=args.glibc_tunables)
        for layout in args.cores:
            for model, k in runs:  # a process each: one process compiling every engine runs out of memory maps
                loads = args.loads if not k else [n for n in args.loads if n.startswith("decode")]
                out = Path(tmp) / "run.json"
                subprocess.run([sys.executable, __file__, "--one", model, str(k), layout, str(out), "--loads", *loads],
                               check=True, env=env)
                run = json.loads(out.read_text())
                rows += run["rows"]
                timelines.update(run["timelines"])
    print_table(rows)
    write_results(args.name, rows, {"glibc_tunables": args.glibc_tunables})
    plot(rows, timelines, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
