"""SequenceSpec and StopParams (frozen, cold per-sequence data) and the StepOutputs that update emits."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool or a float that happens to be whole."""
    return is_int_type(type(value))


def is_int_type(kind: type) -> bool:
    return issubclass(kind, int | np.integer) and not issubclass(kind, bool | np.bool_)


@dataclass(frozen=True, slots=True)
class StopParams:
    """Stop conditions the scheduler enforces (the runner does the sampling itself, from the settings
    the engine packs into `SequenceSpec.row_data`).

    max_tokens: most output tokens; 0 scores the prompt only (the request ends with its prefill).
    eos_token_id: stops generation unless ignore_eos.
    stop_token_ids: further token ids that stop generation (the stop token is emitted).
    """

    max_tokens: int = 16
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"StopParams.max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.eos_token_id is not None and (not is_int(self.eos_token_id) or self.eos_token_id < 0):
            raise ValueError(f"StopParams.eos_token_id must be an integer >= 0 or None, got {self.eos_token_id!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"StopParams.stop_token_ids must be a tuple of integers >= 0, "
                             f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"StopParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def stopping_eos(self) -> int | None:
        """The eos token id that stops generation: None if there is none or it is ignored."""
        return None if self.ignore_eos else self.eos_token_id

    @property
    def stop_ids(self) -> frozenset[int]:
        eos = () if self.stopping_eos is None else (self.stopping_eos,)
        return frozenset(self.stop_token_ids + eos)


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One sequence as the scheduler sees it (the engine makes one per sample of a client request).

    prompt_token_ids: the prompt with any checkpoint marker already stripped.
    checkpoint_position: the declared checkpoint `c` (a multiple of the hash unit, 0 < c < len), from
        `checkpoints.parse_checkpoint_marker`; None when the prompt had no marker.
    cache_salt: requests share cached prefixes only with requests of the same salt (a tenant's key).
    logits_from: None, or the first prompt position whose logits the step hands out (prompt logprobs:
        token i's needs position i - 1); prefix hits stop there, so a checkpoint must not lie past it.
    row_data: the opaque per-row record (`SchedulerConfig.row_data_bytes` bytes) carried to the device.
    group: the requests one client asked for together (its n samples and prompts) share a group; while
        another group waits, admission gives a group no more than its fair share of the rows (`admit.py`).
        None: a group of its own.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    stop_params: StopParams = StopParams()
    checkpoint_position: int | None = None
    cache_salt: str | None = None
    logits_from: int | None = None
    row_data: bytes = b""
    group: str | None = None

    def __post_init__(self) -> None:
        # the request owns its prompt: a caller's list may change after the request is made
        try:
            prompt = tuple(self.prompt_token_ids)
        except TypeError:
            raise TypeError(f"SequenceSpec.prompt_token_ids must be a sequence of token ids, "
                            f"got {self.prompt_token_ids!r:.60}") from None
        object.__setattr__(self, "prompt_token_ids", prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def group_id(self) -> str:
        return self.request_id if self.group is None else self.group


class FinishReason(enum.Enum):
    STOP = "stop"      # eos or a stop token id was emitted
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"    # abort_request


class SequenceOutput(NamedTuple):
    """Tokens one request gained in one step; `finish_reason` is None while it keeps running."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


FINISH_REASONS = (None, FinishReason.STOP, FinishReason.LENGTH)  # StepOutputs.finish_codes -> reason
STOP_CODE, LENGTH_CODE = 1, 2  # their indices: the finish codes `update` and `resolve` write


@dataclass(frozen=True, slots=True, eq=False)
class StepOutputs:
    """What one `update` emitted, as arrays: entry i belongs to request_ids[i] (plan row order).

    request_ids: tuple[str, ...] [n] requests that gained tokens (rows aborted in flight are absent).
    token_ids: [n, 1+K] int32 read-only; entry i's new tokens are token_ids[i, :num_new_tokens[i]].
    num_new_tokens: [n] int32 read-only, >= 1 (0 for a request with max_tokens = 0, ending with its prefill).
    finish_codes: [n] int8 read-only index into FINISH_REASONS; 0 while the request keeps running.
    Indexing or iterating builds the per-request `SequenceOutput` views on demand: a step with 256
    decode rows costs a few array operations, not 256 Python objects, unless a caller asks for them.
    """

    request_ids: tuple[str, ...]
    token_ids: np.ndarray
    num_new_tokens: np.ndarray
    finish_codes: np.ndarray

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, i: int) -> SequenceOutput:
        tokens = tuple(self.token_ids[i, :self.num_new_tokens[i]].tolist())
        return SequenceOutput(self.request_ids[i], tokens, FINISH_REASONS[self.finish_codes[i]])

    def __iter__(self) -> Iterator[SequenceOutput]:
        return map(self.__getitem__, range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepOutputs) and list(self) == list(other)

    def without(self, request_ids: set[str]) -> StepOutputs:
        """These outputs less the entries of `request_ids`."""
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in request_ids]
        if len(keep) == len(self.request_ids):
            return self
        arrays = (self.token_ids[keep], self.num_new_tokens[keep], self.finish_codes[keep])
        for array in arrays:
            array.setflags(write=False)
        return StepOutputs(tuple(self.request_ids[i] for i in keep), *arrays)

    @property
    def finished_ids(self) -> list[str]:
        """Requests that ended in this step (their rows and memory are already released)."""
        return [self.request_ids[i] for i in self.finish_codes.nonzero()[0].tolist()]
