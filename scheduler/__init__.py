"""jaxhybrid's control plane: a pure, replayable scheduler (stdlib + numpy; never imports jax).

One engine step: `schedule(state) -> (state, BatchPlan)`, the device runs the plan and returns a
`StepResult`, then `update(state, plan, result) -> (state, StepOutputs)`; StepOutputs holds the new
tokens of every row as arrays and yields per-request `SequenceOutput` views when iterated. Run one step
ahead, `update` takes `placeholder_result(plan)` right after dispatch and `resolve` the real tokens later.
"""

from scheduler.checkpoints import CheckpointMarkerError, parse_checkpoint_marker
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import abort_request, add_request, preempt_request
from scheduler.plan import BatchPlan, RowKind, StepResult
from scheduler.request import FinishReason, SequenceOutput, SequenceSpec, StepOutputs, StopParams
from scheduler.resolve import placeholder_result, resolve
from scheduler.schedule import schedule
from scheduler.state import SchedulerState, init_state
from scheduler.update import update

__all__ = [
    "BatchPlan", "CheckpointMarkerError", "FinishReason", "SequenceSpec", "SequenceOutput", "RowKind",
    "StopParams", "SchedulerConfig", "SchedulerState", "StepOutputs", "StepResult", "abort_request", "add_request",
    "init_state", "parse_checkpoint_marker", "placeholder_result", "preempt_request", "resolve", "schedule", "update",
]
