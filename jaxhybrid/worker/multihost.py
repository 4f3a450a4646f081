"""Multi-host: one process per host, one engine over every host's devices.

Every process runs the same program: `initialize(...)` first, then the same
`LLM(..., tensor_parallel_size=jax.device_count(), backend="reference")`, whose weights and pools are
sharded over all hosts' devices (`tensor_parallel`); each step is one SPMD program that every process
must run, in the same order. Process 0, the leader, runs the engine: it schedules, and right before it
dispatches a step it broadcasts the step's bucket and packed plan (`PlanChannel`); every other process
calls `follow(llm)`, which receives each plan and runs the same jitted step on its own shards until the
leader calls `shutdown(llm)`. The step's outputs are replicated, so the leader reads them from its own
devices; a follower never reads a result.

Every process compiles the same program per bucket. `precompile()` on the leader runs an all-padding step of
each bucket, which every follower follows (and so compiles); `Engine.start_background_compile()` must be called
by every process, each compiling on its own thread; and a bucket a process has not compiled when a step of it
arrives compiles then, on each process (the leader's step waits in its first collective meanwhile).

    from jaxhybrid.worker import multihost
    multihost.initialize("10.0.0.1:9876", num_processes=2, process_id=RANK)  # before any device work
    llm = LLM(MODEL, tensor_parallel_size=jax.device_count(), backend="reference")
    if jax.process_index() == 0:
        outputs = llm.generate(prompts, params)
        multihost.shutdown(llm)
    else:
        multihost.follow(llm)

Under SLURM or Open MPI `initialize()` needs no arguments (JAX reads them from the environment).
"""

from __future__ import annotations

import enum

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxhybrid.models.plan_transfer import PlanLayout


class Message(enum.IntEnum):
    STEP = 0   # a plan follows
    RESET = 1  # fresh pools: the leader started over after a failed step
    STOP = 2
    FORWARD = 3  # a plan follows, whose step runs in two halves: its layers now ...
    SAMPLE = 4  # ... and its sampling, under the token masks that follow


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the job; call it before anything touches a device. CPU devices talk through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def is_leader() -> bool:
    return jax.process_index() == 0


class PlanChannel:
    """The leader's messages to every other process: a fixed header (message, bucket, constraint width),
    then for a step the packed plan, whose length the bucket's layout gives (every process derives the same
    layout), and the rows' constraint entries [R, E, 4] when E > 0; for SAMPLE, the token masks [L, words]
    (L in the header's first bucket entry)."""

    HEADER = 6  # message, T, R, B, L, E

    def send(self, message: Message, bucket: tuple[int, int, int, int] = (0, 0, 0, 0),
             buffer: np.ndarray | None = None, constraints: np.ndarray | None = None,
             token_mask: np.ndarray | None = None) -> None:
        width = 0 if constraints is None else constraints.shape[1]
        if token_mask is not None:
            bucket = (token_mask.shape[0], 0, 0, 0)
        multihost_utils.broadcast_one_to_all(np.array([message, *bucket, width], np.int32))
        for part in (buffer, constraints if width else None, token_mask):
            if part is not None:
                multihost_utils.broadcast_one_to_all(part)

    def receive(self, layout_of, mask_words: int) -> tuple[Message, PlanLayout | None, np.ndarray | None,
                                                           np.ndarray | None, np.ndarray | None]:
        """(message, layout, packed plan, constraints or None, token masks or None); `layout_of(bucket)` gives
        a bucket's layout."""
        header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(self.HEADER, np.int32)))
        message = Message(int(header[0]))
        if message is Message.SAMPLE:
            token_mask = np.zeros((int(header[1]), mask_words), np.int32)
            return message, None, None, None, np.asarray(multihost_utils.broadcast_one_to_all(token_mask))
        if message not in (Message.STEP, Message.FORWARD):
            return message, None, None, None, None
        layout = layout_of(tuple(int(x) for x in header[1:5]))
        buffer = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(layout.size, np.int32)))
        constraints = None  # width 0: no row has any
        if header[5]:
            constraints = np.zeros((int(header[2]), int(header[5]), 4), np.int32)
            constraints = np.asarray(multihost_utils.broadcast_one_to_all(constraints))
        return message, layout, buffer, constraints, None


def follow(llm) -> int:
    """Run the leader's steps until it shuts down (every process but the leader); returns the steps run."""
    return llm.engine.runner.follow()


def shutdown(llm) -> None:
    """The leader's last word: every follower returns from `follow`."""
    llm.engine.runner.channel.send(Message.STOP)
