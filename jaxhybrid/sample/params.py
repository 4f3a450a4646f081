"""`SamplingParams` with vLLM's names, checked once, and what each part of the engine takes from it:
the scheduler's stop conditions, the device's per-row record (`sampling.ROW_DTYPE`) and the host's
stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

import scheduler
from jaxhybrid.sample.sampler import pack_row
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams

MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # vLLM takes any int64 (and torch any uint64)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FLOAT32_MAX = 3.4028234663852886e38


def _is_number(value) -> bool:
    """A real number the device's float32 holds (a larger one would arrive as inf)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) <= _FLOAT32_MAX


def _shown(value, limit: int = 80) -> str:
    """A value for an error message: its repr, cut short (a request's lists can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's outputs (vLLM's `SamplingParams` names and defaults).

    temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those filters; seed None draws a seed per
    request; stop strings end the text before them (unless include_stop_str_in_output); logprobs and
    prompt_logprobs ask for that many top log-probabilities per position (-1: the whole vocabulary), of
    the model's raw distribution (vLLM's default logprobs_mode); max_tokens 0 scores the prompt;
    truncate_prompt_tokens keeps only a prompt's last k tokens (-1: max_model_len).

    Before sampling: min_tokens bans eos and stop_token_ids (and stop strings do not stop) until that many
    tokens are out; logit_bias adds to token ids' logits (clamped to [-100, 100]); allowed_token_ids
    restricts sampling to those ids; each of bad_words (tokenized with and without a leading space) has
    its last token banned where its other tokens end the output.

    structured_outputs constrains the output to a grammar (`StructuredOutputsParams`): after the reasoning,
    where the engine has a reasoning parser.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, tuple(value))
        for problem in self._problems():
            raise ValueError(problem)
        for name in ("allowed_token_ids", "stop_token_ids"):  # a set of ids: a repeat changes nothing
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        if self.logit_bias is not None:  # vLLM clamps the biases
            object.__setattr__(self, "logit_bias", {t: min(100.0, max(-100.0, float(b)))
                                                    for t, b in self.logit_bias.items()})

    def _problems(self):
        """Each broken rule as a message naming the field (the server turns the first into a 400)."""
        checks = [
            ("n", _is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
             "an integer >= 0 or None"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a finite float32 >= 0"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "an integer >= -1 (0 or -1: off)"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", _is_number(self.repetition_penalty) and self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "in [-2, 2]"),
            ("seed", self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED),
             f"an integer in [{MIN_SEED}, {MAX_SEED}] or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "integers >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= -1),
             "an integer >= -1 (-1: the whole vocabulary) or None"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                                 and self.prompt_logprobs >= -1),
             "an integer >= -1 (-1: the whole vocabulary) or None"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= (
                self.max_tokens if _is_int(self.max_tokens) else self.min_tokens), "an integer in [0, max_tokens]"),
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(t) and t >= 0 and _is_number(b) for t, b in self.logit_bias.items())),
             "a dict of token ids (integers >= 0) to finite numbers, or None"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                isinstance(self.allowed_token_ids, tuple) and self.allowed_token_ids
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "a non-empty list of token ids (integers >= 0), or None"),
            ("bad_words", self.bad_words is None or (isinstance(self.bad_words, tuple) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words)), "a list of non-blank strings, or None"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "a StructuredOutputsParams or None"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or (
                _is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)),
             "an integer >= 1, -1 (max_model_len) or None"),
        ]
        return [f"SamplingParams.{name} must be {rule}, got {_shown(getattr(self, name))}" for name, ok, rule in checks
                if not ok]

    def scheduler_params(self, max_tokens: int, eos_token_id: int | None) -> scheduler.StopParams:
        """The stop conditions the scheduler enforces; `max_tokens` resolved by the engine (None: what fits)."""
        return scheduler.StopParams(max_tokens=max_tokens, eos_token_id=eos_token_id,
                                        stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)

    def row_data(self, seed: int, prompt_len: int) -> bytes:
        """The device's per-row record; `seed` is this request's own (drawn by the engine when None)."""
        asked = [n for n in (self.logprobs, self.prompt_logprobs) if n is not None]
        top = max((n if n >= 0 else 2**30 for n in asked), default=-1)  # -1 asks for the whole vocabulary
        return pack_row(self.temperature, self.top_p, max(self.top_k, 0), self.min_p, self.repetition_penalty,
                        self.presence_penalty, self.frequency_penalty, seed, 1 + top, prompt_len, self.min_tokens)

    def has_constraints(self) -> bool:
        """Whether the device applies constraint entries for this request (`sampling.Constraint`)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words)
