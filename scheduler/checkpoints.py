"""Application-directed checkpoints: marker parsing and the producer/consumer machine as a table.

Theory of operation. A prompt may carry one marker token; the tokenizer layer calls
`parse_checkpoint_marker`, which strips it and records the position `c` rounded down to the hash
unit. The checkpoint is keyed by the chained hash of tokens [0, c). The first request that needs an
ABSENT key claims it (PRODUCING) together with a reserved cache slot; its chunks are cut at c.
When the chunk ending at c is scheduled the key becomes UNREADY (the step that writes the state is
in flight) and READY in `update` once that step has run. Other requests with the key wait while it
is PRODUCING, without blocking anyone else; if they are admitted in the same pass as the producer's
chunk to c (UNREADY), they pair with it: they share the producer's KV blocks for [0, c) and copy its
state between phase 1 (producers) and phase 2 (everyone else) of the same step. A producer lost
(aborted or preempted) while PRODUCING releases the key, and the next waiting consumer claims it.
Rule: every change of a key's status goes through `advance`, which consults `TRANSITIONS`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class CheckpointMarkerError(ValueError):
    """A prompt's checkpoint marker breaks a rule (the API layer turns it into a 400)."""


class ParsedPrompt(NamedTuple):
    token_ids: tuple[int, ...]
    checkpoint_position: int | None
    placeholders: tuple[tuple[int, int], ...]


def parse_checkpoint_marker(token_ids, marker_id: int, hash_unit: int,
                            placeholders=()) -> ParsedPrompt:
    """Strip the marker and return the prompt, the checkpoint position and shifted placeholders.

    Rules (docs/scheduler.md#application-directed-checkpoints): no marker -> prompt unchanged, position
    None; the marker must occur exactly once, with tokens on both sides, and not inside a multimodal placeholder range
    `(offset, length)`; the position is the marker's index rounded down to `hash_unit` and must not
    round to 0; placeholders after the marker shift left by one. The input is never mutated.
    """
    tokens = tuple(token_ids)
    spans = tuple((int(o), int(n)) for o, n in placeholders)
    hits = [i for i, t in enumerate(tokens) if t == marker_id]
    if not hits:
        return ParsedPrompt(tokens, None, spans)
    index = _check_marker(tokens, hits, spans)
    position = index - index % hash_unit
    if position == 0:
        raise CheckpointMarkerError(
            f"checkpoint marker at index {index} is too small: it rounds down to 0 with hash unit {hash_unit}")
    shifted = tuple((o - 1 if o > index else o, n) for o, n in spans)
    return ParsedPrompt(tokens[:index] + tokens[index + 1:], position, shifted)


def _check_marker(tokens: tuple[int, ...], hits: list[int], spans) -> int:
    if len(hits) != 1:
        raise CheckpointMarkerError(f"checkpoint marker must occur exactly once, found {len(hits)}")
    index = hits[0]
    if index == 0 or index == len(tokens) - 1:
        raise CheckpointMarkerError("checkpoint marker needs prompt tokens on both sides")
    for offset, length in spans:
        if offset <= index < offset + length:
            raise CheckpointMarkerError(
                f"checkpoint marker at {index} cannot be inside placeholder [{offset}, {offset + length})")
    return index


class CheckpointStatus(enum.Enum):
    ABSENT = "absent"        # nobody computes it: the next request that needs it becomes the producer
    PRODUCING = "producing"  # claimed by a running producer that has not scheduled its chunk to c yet
    UNREADY = "unready"      # the chunk ending at c is in this step; same-pass consumers may pair
    READY = "ready"          # the state is cached: consumers hit at c


class CheckpointEvent(enum.Enum):
    CLAIM = "claim"
    SCHEDULE_END = "schedule_end"
    STEP_DONE = "step_done"
    PRODUCER_LOST = "producer_lost"
    EVICT = "evict"


S, E = CheckpointStatus, CheckpointEvent
TRANSITIONS: dict[tuple[CheckpointStatus, CheckpointEvent], CheckpointStatus] = {
    (S.ABSENT, E.CLAIM): S.PRODUCING,
    (S.PRODUCING, E.SCHEDULE_END): S.UNREADY,
    (S.PRODUCING, E.PRODUCER_LOST): S.ABSENT,
    (S.UNREADY, E.STEP_DONE): S.READY,
    # the writing step is already in flight and update() still runs for it: the state will exist
    (S.UNREADY, E.PRODUCER_LOST): S.UNREADY,
    (S.READY, E.EVICT): S.ABSENT,
}


def advance(status: CheckpointStatus, event: CheckpointEvent, key: bytes) -> CheckpointStatus:
    """The status after `event`; raises (changing nothing) when the table does not allow it."""
    new = TRANSITIONS.get((status, event))
    if new is None:
        raise RuntimeError(f"checkpoint {key.hex()[:16]}: can't handle {event.value} in status {status.value}")
    return new


class Claim(NamedTuple):
    """A key's PRODUCING/UNREADY record. slot: the reserved cache slot; producer_row: the producer's
    row while UNREADY (pairing reads its running slot and KV blocks), else -1."""

    status: CheckpointStatus
    producer_id: str
    slot: int
    producer_row: int = -1


def checkpoint_status(claims: dict[bytes, Claim], ready_slot: int | None, key: bytes) -> CheckpointStatus:
    claim = claims.get(key)
    if claim is not None:
        return claim.status
    return CheckpointStatus.READY if ready_slot is not None else CheckpointStatus.ABSENT
