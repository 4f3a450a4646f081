"""`python -m scheduler.sim.simulate`: the randomized scheduler simulator (see simulator.py) as a CLI.

Prints one summary line `finished=A/B stalls=N i1_violations=N leaks=N` and exits 1 on any stall,
violation, leak or unfinished request. `--trace --prompt-len N` instead runs one request of N tokens
and prints its chunk ends step by step. `--record F` also writes every seed's event log to F;
`--replay F` re-runs those logs and checks that every plan and output is bit-identical.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.events import load_logs, replay, save_logs
from scheduler.lifecycle import add_request
from scheduler.plan import StepResult
from scheduler.request import SequenceSpec, StopParams
from scheduler.schedule import schedule
from scheduler.sim.simulator import Report, Workload, run_seed
from scheduler.state import init_state
from scheduler.update import update


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m scheduler.sim.simulate", description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mamba-block-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--lookahead", type=int, default=None, help="prefill lookahead L (default: num spec tokens)")
    ap.add_argument("--eagle-block-drop", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--num-blocks", type=int, default=160)
    ap.add_argument("--num-state-slots", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--ring-size", type=int, default=16)
    ap.add_argument("--checkpoint-fraction", type=float, default=0.33)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--ahead", action="store_true", help="one step ahead: update on placeholders, resolve later")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=49)
    ap.add_argument("--record", metavar="FILE", help="write the event log of every seed (JSON lines)")
    ap.add_argument("--replay", metavar="FILE", help="replay a recorded file; exit 1 unless bit-identical")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the first problems found")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> SchedulerConfig:
    max_model_len = max(1024, args.prompt_len + 64)
    return SchedulerConfig(
        block_size=args.block_size, mamba_block_size=args.mamba_block_size,
        max_num_batched_tokens=args.token_budget, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
        num_blocks=max(args.num_blocks, -(-(max_model_len + args.num_spec_tokens) // args.block_size) + 1),
        num_state_slots=args.num_state_slots, num_spec_tokens=args.num_spec_tokens,
        num_lookahead=args.lookahead, eagle_block_drop=args.eagle_block_drop, ring_size=args.ring_size)


def trace(cfg: SchedulerConfig, prompt_len: int) -> int:
    """One request of `prompt_len` tokens; print each step's chunk end. Exit 1 if it never finishes."""
    state = add_request(init_state(cfg), SequenceSpec("trace", tuple(range(3, prompt_len + 3)), StopParams(1)))
    k = cfg.num_spec_tokens
    for step in range(1, 4 * prompt_len + 8):
        state, plan = schedule(state)
        ends = [int(plan.context_lens[r] + plan.query_lens[r]) for r in range(plan.num_rows)]
        print(f"step {step}: " + (f"{plan.context_lens[0]}->{ends[0]}" if ends else "0 tokens"))
        rows = plan.row_bucket
        result = StepResult(np.full((rows, 1 + k), 7, np.int32), np.zeros(rows, np.int32),
                            np.full((rows, k), 7, np.int32))
        state, _ = update(state, plan, result)
        if not state.has_work():
            return 0
    print("trace: the request never finished")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from(args)
    if args.trace:
        return trace(cfg, args.prompt_len)
    if args.replay:
        problems = [f"log {i}: {p}" for i, log in enumerate(load_logs(args.replay)) for p in replay(log)]
        print("\n".join(problems[:20]) or f"replayed {args.replay}: every plan and output bit-identical")
        return 1 if problems else 0
    workload = Workload(steps=args.steps, checkpoint_fraction=args.checkpoint_fraction,
                        abort_fraction=args.abort_fraction)
    total, logs = Report(), [] if args.record else None
    for seed in range(args.seeds):
        total.add(run_seed(cfg, workload, seed, logs, args.ahead))
    if args.record:
        save_logs(logs, args.record)
    if args.verbose:
        print("\n".join(total.messages[:20]), file=sys.stderr)
        print(f"steps={total.steps} hits_checked={total.hits_checked} preemptions={total.preemptions}",
              file=sys.stderr)
    print(total.summary())
    return 0 if total.ok else 1


if __name__ == "__main__":
    sys.exit(main())
