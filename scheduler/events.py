"""Event logs: record what drives a scheduler (requests added, aborts, preemptions, step results) and
replay them.

The transitions are functions of their inputs (no clocks, no hidden globals), so replaying a log on a
fresh `init_state(config)` reproduces every plan and every output bit for bit. A log keeps a digest
of each plan and each step's outputs, and `replay` checks them: a recorded run (`python -m
scheduler.simulate --record F`, then `--replay F`) is also a regression test of the scheduler.
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
from scheduler.request import Request, SamplingParams, StepOutputs
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

    def add_request(self, state: SchedulerState, request: Request) -> SchedulerState:
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
        arrays = {name: getattr(result, name).tolist() for name in ("sampled_token_ids", "num_accepted",
                                                                     "draft_token_ids")}
        self.events.append({"update": arrays, "outputs": outputs_digest(outputs)})
        return state, outputs

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
    state, plan, problems = init_state(log.config), None, []
    for index, event in enumerate(log.events):
        try:
            state, plan = _apply(log, state, plan, event, index, problems)
        except (ValueError, KeyError, RuntimeError) as error:  # the log no longer fits what the run does
            return problems + [f"event {index}: {type(error).__name__}: {error}"]
    return problems


def _apply(log: EventLog, state: SchedulerState, plan: BatchPlan | None, event: dict, index: int,
           problems: list[str]) -> tuple[SchedulerState, BatchPlan | None]:
    if "add" in event:
        state = add_request(state, _request_from_json(event["add"]))
    elif "abort" in event:
        state = abort_request(state, event["abort"])
    elif "preempt" in event:
        state = preempt_request(state, event["preempt"])
    elif "schedule" in event:
        state, plan = schedule(state)
        if plan_digest(plan) != event["schedule"]:
            problems.append(f"event {index}: plan {plan.step_id} differs")
    else:
        result = StepResult(*(np.array(event["update"][name], np.int32).reshape(shape) for name, shape in (
            ("sampled_token_ids", (plan.row_bucket, -1)), ("num_accepted", (-1,)),
            ("draft_token_ids", (plan.row_bucket, log.config.num_spec_tokens)))))
        state, outputs = update(state, plan, result)
        if outputs_digest(outputs) != event["outputs"]:
            problems.append(f"event {index}: outputs of step {plan.step_id} differ")
    return state, plan


def _request_to_json(request: Request) -> dict:
    params = dataclasses.asdict(request.sampling_params)
    return {"request_id": request.request_id, "prompt_token_ids": [int(t) for t in request.prompt_token_ids],
            "sampling_params": params, "checkpoint_position": request.checkpoint_position,
            "cache_salt": request.cache_salt, "logits_from": request.logits_from, "row_data": request.row_data.hex()}


def _request_from_json(data: dict) -> Request:
    params = dict(data["sampling_params"], stop_token_ids=tuple(data["sampling_params"]["stop_token_ids"]))
    return Request(data["request_id"], tuple(data["prompt_token_ids"]), SamplingParams(**params),
                   data["checkpoint_position"], data["cache_salt"], data["logits_from"],
                   bytes.fromhex(data["row_data"]))
