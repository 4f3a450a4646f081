"""Event logs: record what drives a scheduler (requests added, aborts, preemptions, step results, and one
step ahead the placeholder results and the real ones `resolve` puts in) and replay them.

The transitions are functions of their inputs (no clocks, no hidden globals), so replaying a log on a
fresh `init_state(config)` reproduces every plan and every output bit for bit. A log keeps a digest
of each plan and each step's outputs, and `replay` checks them: a recorded run (`python -m
scheduler.sim.simulate --record F`, then `--replay F`) is also a regression test of the scheduler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.lifecycle import abort_request, add_request, preempt_request
from scheduler.plan import BatchPlan, StepResult
from scheduler.request import SequenceSpec, StepOutputs, StopParams
from scheduler.resolve import resolve
from scheduler.schedule import schedule
from scheduler.state import SchedulerState, init_state
from scheduler.update import update


def plan_digest(plan: BatchPlan) -> str:
    """SHA-256 over every field of a plan, arrays by dtype, shape and bytes."""
    return _digest(plan._asdict().items())


def outputs_digest(outputs: StepOutputs) -> str:
    return _digest((name, getattr(outputs, name)) for name in ("request_ids", "token_ids", "num_new_tokens",
                                                                  "finish_codes"))


def _digest(fields) -> str:
    h = hashlib.sha256()
    for name, value in fields:
        h.update(name.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


class EventLog:
    """Records the transitions it performs: use its methods in place of the scheduler's functions."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.events: list[dict] = []

    def add_request(self, state: SchedulerState, request: SequenceSpec) -> SchedulerState:
        state = add_request(state, request)  # a refused request changes nothing and is not logged
        self.events.append({"add": _request_to_json(request)})
        return state

    def abort_request(self, state: SchedulerState, request_id: str) -> SchedulerState:
        state = abort_request(state, request_id)
        self.events.append({"abort": request_id})
        return state

    def preempt_request(self, state: SchedulerState, request_id: str) -> SchedulerState:
        state = preempt_request(state, request_id)
        self.events.append({"preempt": request_id})
        return state

    def schedule(self, state: SchedulerState) -> tuple[SchedulerState, BatchPlan]:
        state, plan = schedule(state)
        self.events.append({"schedule": plan_digest(plan)})
        return state, plan

    def update(self, state: SchedulerState, plan: BatchPlan, result: StepResult) -> tuple[SchedulerState, StepOutputs]:
        state, outputs = update(state, plan, result)
        self.events.append({"update": _result_to_json(result), "outputs": outputs_digest(outputs)})
        return state, outputs

    def resolve(self, state: SchedulerState, outputs: StepOutputs, result: StepResult
                ) -> tuple[SchedulerState, StepOutputs]:
        """`resolve` the outputs of the last `update` (the order one step ahead: schedule N+1, resolve N)."""
        state, resolved = resolve(state, outputs, result)
        self.events.append({"resolve": _result_to_json(result), "outputs": outputs_digest(resolved)})
        return state, resolved

    def to_json(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "events": self.events}

    @staticmethod
    def from_json(data: dict) -> EventLog:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data["config"].items()}
        log = EventLog(SchedulerConfig(**fields))
        log.events = data["events"]
        return log


def save_logs(logs: list[EventLog], path: Path | str) -> None:
    """One JSON line per log."""
    Path(path).write_text("".join(json.dumps(log.to_json()) + "\n" for log in logs))


def load_logs(path: Path | str) -> list[EventLog]:
    return [EventLog.from_json(json.loads(line)) for line in Path(path).read_text().splitlines() if line]


def replay(log: EventLog) -> list[str]:
    """Re-run the log on a fresh state; the places where a plan or an output differs (empty: bit-identical)."""
    run = _Replay(init_state(log.config))
    for index, event in enumerate(log.events):
        try:
            run.apply(event, index)
        except (ValueError, KeyError, RuntimeError) as error:  # the log no longer fits what the run does
            return run.problems + [f"event {index}: {type(error).__name__}: {error}"]
    return run.problems


class _Replay:
    """A replay's state, its last plan and the outputs of its last `update` (what a `resolve` event resolves)."""

    def __init__(self, state: SchedulerState) -> None:
        self.state, self.plan, self.outputs, self.problems = state, None, None, []

    def apply(self, event: dict, index: int) -> None:
        if "add" in event:
            self.state = add_request(self.state, _request_from_json(event["add"]))
        elif "abort" in event:
            self.state = abort_request(self.state, event["abort"])
        elif "preempt" in event:
            self.state = preempt_request(self.state, event["preempt"])
        elif "schedule" in event:
            self.state, self.plan = schedule(self.state)
            self._compare(plan_digest(self.plan), event["schedule"], f"event {index}: plan {self.plan.step_id} differs")
        elif "update" in event:
            self.state, self.outputs = update(self.state, self.plan, _result_from_json(event["update"]))
            self._compare(outputs_digest(self.outputs), event["outputs"],
                          f"event {index}: outputs of step {self.plan.step_id} differ")
        else:
            self.state, resolved = resolve(self.state, self.outputs, _result_from_json(event["resolve"]))
            self._compare(outputs_digest(resolved), event["outputs"], f"event {index}: resolved outputs differ")

    def _compare(self, digest: str, recorded: str, problem: str) -> None:
        if digest != recorded:
            self.problems.append(problem)


def _result_to_json(result: StepResult) -> dict:
    return {name: getattr(result, name).tolist() for name in ("sampled_token_ids", "num_accepted", "draft_token_ids")}


def _result_from_json(data: dict) -> StepResult:
    # nested lists keep their shape, [R, 0] drafts included
    return StepResult(*(np.array(data[name], np.int32) for name in ("sampled_token_ids", "num_accepted",
                                                                     "draft_token_ids")))


def _request_to_json(request: SequenceSpec) -> dict:
    params = dataclasses.asdict(request.stop_params)
    return {"request_id": request.request_id, "prompt_token_ids": [int(t) for t in request.prompt_token_ids],
            "stop_params": params, "checkpoint_position": request.checkpoint_position,
            "cache_salt": request.cache_salt, "logits_from": request.logits_from, "row_data": request.row_data.hex(),
            "group": request.group}


def _request_from_json(data: dict) -> SequenceSpec:
    params = dict(data["stop_params"], stop_token_ids=tuple(data["stop_params"]["stop_token_ids"]))
    return SequenceSpec(data["request_id"], tuple(data["prompt_token_ids"]), StopParams(**params),
                   data["checkpoint_position"], data["cache_salt"], data["logits_from"],
                   bytes.fromhex(data["row_data"]), data.get("group"))
