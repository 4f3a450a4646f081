"""The randomized simulator (reduced CI sweep) and its command line; the full sweeps are run by hand."""

from __future__ import annotations

import gc

import pytest

from scheduler.events import load_logs, replay
from scheduler.schedule import schedule
from scheduler.sim import simulate
from scheduler.sim.simulator import Workload, count_stalls, run_seed
from tests.scheduler.helpers import Driver, make_config, request

SETTINGS = [  # (lookahead, block drop, token budget): L in {0..5}, drop on/off, half a block .. many blocks
    (0, True, 256), (2, False, 64), (3, True, 32), (3, False, 1024), (5, False, 256), (1, True, 64),
]


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("lookahead, drop, budget", SETTINGS)
def test_reduced_sweep_has_no_stalls_violations_or_leaks(lookahead, drop, budget, ahead):
    args = simulate.parse_args(["--lookahead", str(lookahead), "--token-budget", str(budget),
                                "--eagle-block-drop" if drop else "--no-eagle-block-drop"])
    report = run_seed(simulate.config_from(args), Workload(steps=120), seed=lookahead * 7 + budget, ahead=ahead)
    assert report.ok, (report.summary(), report.messages[:5])
    assert report.total > 5 and (report.hits_checked > 0 or budget < 256)


def test_a_running_prefill_passed_over_while_nothing_older_runs_is_a_stall():
    """The progress bound's step property (schedule.py), checked by the simulator: P's remainder exceeds the
    budget, so only the property tells a plan without P from a fair one."""
    driver = Driver(make_config(max_num_batched_tokens=16))
    driver.add(request("P", range(1, 65)))
    driver.step()
    state, plan = schedule(driver.state)
    assert driver.chunks(plan) == {"P": (16, 32)} and count_stalls(state, plan) == []
    passed_over = plan._replace(request_ids=(), num_tokens=0)
    assert count_stalls(state, passed_over) == [f"step {plan.step_id}: 'P' stalled at 16"]


def test_memory_pressure_preempts_and_still_drains():
    args = simulate.parse_args(["--num-blocks", "70", "--num-state-slots", "8", "--max-num-seqs", "8"])
    report = run_seed(simulate.config_from(args), Workload(steps=120), seed=3)
    assert report.ok and report.preemptions > 0, report.summary()


def test_cli_prints_one_summary_line_and_exit_code(capsys):
    assert simulate.main(["--seeds", "2", "--steps", "40"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("finished=") and "stalls=0 i1_violations=0 leaks=0" in lines[0]


def test_cli_trace_prints_chunk_ends(capsys):
    argv = ["--trace", "--prompt-len", "49", "--block-size", "16", "--mamba-block-size", "16",
            "--token-budget", "16", "--num-spec-tokens", "3"]
    assert simulate.main(argv) == 0
    out = capsys.readouterr().out
    assert "0->16" in out and "16->32" in out and "32->48" in out and "48->49" in out


def test_transitions_make_no_reference_cycles():
    """Everything a transition drops is freed by reference counting, so an engine may keep the cyclic
    collector out of its step loop (benchmarks/scheduler_overhead.py) without growing memory."""
    pressure = simulate.parse_args(["--num-blocks", "70", "--num-state-slots", "8", "--max-num-seqs", "8"])
    configs = [(3, simulate.config_from(pressure)), (5, simulate.config_from(simulate.parse_args([])))]
    run_seed(configs[0][1], Workload(steps=30), seed=1)  # warm-up: first calls into numpy and
    gc.collect()  # inspect leave one-time cycles, as does argparse
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # a collection keeps what it found in gc.garbage instead of freeing it
    try:
        for seed, cfg in configs:
            report = run_seed(cfg, Workload(steps=120), seed=seed)
            assert report.ok and report.total > 5, report.summary()
        gc.collect()
        cycles = [type(obj).__name__ for obj in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycles == []


@pytest.mark.parametrize("argv", [
    ["--num-spec-tokens", "3", "--abort-fraction", "0.3", "--checkpoint-fraction", "0.5"],
    ["--num-spec-tokens", "2", "--abort-fraction", "0.3", "--ahead"],  # resolves recorded, aborts in flight
    ["--num-spec-tokens", "0", "--token-budget", "64", "--abort-fraction", "0.2"],
    ["--num-blocks", "70", "--num-state-slots", "8", "--max-num-seqs", "8"],  # preemptions
])
def test_recorded_runs_replay_bit_for_bit_and_a_changed_log_is_caught(tmp_path, capsys, argv):
    path = tmp_path / "run.jsonl"
    assert simulate.main(argv + ["--seeds", "2", "--steps", "60", "--record", str(path)]) == 0
    logs = load_logs(path)
    kinds = {kind for log in logs for event in log.events for kind in event}
    assert {"add", "schedule", "update"} <= kinds and ("abort" in kinds or "--num-blocks" in argv)
    assert ("resolve" in kinds) == ("--ahead" in argv)
    assert simulate.main(["--replay", str(path)]) == 0
    assert "bit-identical" in capsys.readouterr().out
    first = next(e["add"] for e in logs[0].events if "add" in e)
    first["prompt_token_ids"][-1] = 3 + (first["prompt_token_ids"][-1] - 2) % 100  # one other prompt token
    assert replay(logs[0]) and not replay(logs[1])
