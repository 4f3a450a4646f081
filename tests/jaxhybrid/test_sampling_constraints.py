"""vLLM's logits constraints: min_tokens, logit_bias, allowed_token_ids, bad_words, and logprobs of -1.
The device scatter is checked against a numpy reference of the semantics (hypothesis); the engine's
greedy tokens against numpy continuations of the full forward, in every sampling path: prefill's first
token, plain decode, one step ahead and MTP verification."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.engine.detokenize import IncrementalDetokenizer
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import apply_constraints, batch_constraints, constraint_entries
from tests.jaxhybrid.engine_helpers import default_model, default_tokenizer, engine_for, run_to_completion

PROMPT = "import os\n\n\ndef read_config(path):\n    with open("


def constrained_reference(logits: np.ndarray, output: list[int], logit_bias: dict[int, float],
                          allowed: tuple[int, ...], bad_words: list[tuple[int, ...]], bans: tuple[int, ...],
                          min_tokens: int) -> np.ndarray:
    """vLLM's semantics, one row: only allowed ids; a bad word's last token where its other tokens end the
    output; eos and stop ids before min_tokens outputs; then the biases."""
    x = np.asarray(logits, np.float32).copy()
    if allowed:
        x[np.setdiff1d(np.arange(x.size), allowed)] = -np.inf
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = -np.inf
    if len(output) < min_tokens:
        x[list(bans)] = -np.inf
    for token, bias in logit_bias.items():
        x[token] += np.float32(bias)
    return x


VOCAB = 12


@st.composite
def constrained_rows(draw):
    token = st.integers(0, VOCAB - 1)
    output = draw(st.lists(token, max_size=6))
    return dict(
        logits=np.array(draw(st.lists(st.floats(-5, 5, width=32), min_size=VOCAB, max_size=VOCAB)), np.float32),
        output=output,
        logit_bias=draw(st.dictionaries(token, st.floats(-100, 100, width=32), max_size=4)),
        allowed=tuple(draw(st.lists(token, max_size=4, unique=True))),
        # words drawn from the output's tail match; the others mostly do not
        bad_words=[tuple(output[len(output) - n:]) + (last,) if draw(st.booleans()) and n <= len(output)
                   else tuple(draw(st.lists(token, max_size=2))) + (last,)
                   for n, last in draw(st.lists(st.tuples(st.integers(0, 3), token), max_size=3))],
        bans=tuple(draw(st.lists(token, max_size=3))),
        min_tokens=draw(st.integers(0, 8)))


@settings(max_examples=60, deadline=None)
@given(st.lists(constrained_rows(), min_size=1, max_size=4))
def test_device_constraints_match_the_numpy_reference(rows):
    entries = [constraint_entries(r["logit_bias"], r["allowed"], r["bad_words"], r["bans"]) for r in rows]
    batch = batch_constraints(entries, len(rows))
    # the output token `back` positions before the drawn one, -1 before the output starts
    earlier = np.array([[r["output"][len(r["output"]) - back] if 0 < back <= len(r["output"]) else -1
                         for back in batch[i, :, 3]] for i, r in enumerate(rows)], np.int32).reshape(batch.shape[:2])
    got = jax.jit(apply_constraints)(np.stack([r["logits"] for r in rows]), batch, earlier,
                            np.array([len(r["output"]) for r in rows]), np.array([r["min_tokens"] for r in rows]))
    for i, r in enumerate(rows):
        want = constrained_reference(r["logits"], r["output"], r["logit_bias"], r["allowed"], r["bad_words"],
                                     r["bans"], r["min_tokens"])
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-6, atol=1e-5)


def test_the_constraint_transfer_has_one_width():
    """Every step carries the engine's one width (all padding without entries), so no request's constraints
    compile a new step; duplicate ids take one entry, and a row over the width is refused, never widened."""
    empty = batch_constraints([None, None], 4, width=16)
    assert empty.shape == (4, 16, 4) and not empty.any()
    nine = constraint_entries({1: 2.0}, tuple(range(8)) * 3, [], (5, 5, 5))
    assert len(nine) == 10  # 1 bias + 8 distinct allowed ids + 1 distinct ban
    batch = batch_constraints([None, nine], 4, width=16)
    assert batch.shape == (4, 16, 4) and not batch[0].any() and batch[1, :10].any() and not batch[1, 10:].any()
    with pytest.raises(ValueError, match="more than the step's width 8"):
        batch_constraints([nine], 4, width=8)


def _bad_word_ids(words: list[str]) -> list[tuple[int, ...]]:
    """vLLM's tokenization of bad words: alone, and after a space when that is another token of the same
    length."""
    tokenizer, ids = default_tokenizer(), []
    for word in words:
        alone, spaced = tokenizer.encode(word.lstrip()), tokenizer.encode(" " + word.lstrip())
        ids.append(tuple(alone))
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            ids.append(tuple(spaced))
    return ids


def _greedy_reference(prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy tokens under the constraints from full forwards, with the raw model's logprob of each."""
    model = default_model()
    eos = () if params.ignore_eos else model.config.eos_token_id
    bans = tuple(params.stop_token_ids) + tuple(eos)
    sequence, output, logprobs = list(prompt), [], []
    for _ in range(params.max_tokens):
        logits = np.asarray(model(np.array([sequence])), np.float32)[0, -1]
        x = constrained_reference(logits, output, params.logit_bias or {}, params.allowed_token_ids or (),
                                  _bad_word_ids(list(params.bad_words or ())), bans, params.min_tokens)
        token = int(np.argmax(x))
        shifted = logits.astype(np.float64) - logits.max()
        logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
        output.append(token)
        sequence.append(token)
        if token in bans:
            break
    return output, logprobs


def _requests(greedy: list[int]) -> dict[str, SamplingParams]:
    plain = dict(temperature=0, max_tokens=10)
    return {
        # the greedy first token pushed down: prefill's first token must move
        "bias": SamplingParams(**plain, logit_bias={greedy[0]: -100, 1855: 4.0}, logprobs=1, ignore_eos=True),
        "allowed": SamplingParams(**plain, allowed_token_ids=[15, 270, 343, 911, 1968, 3000]),
        "bad_single": SamplingParams(**plain, bad_words=["path"]),  # one token: banned everywhere
        "bad_pair": SamplingParams(**plain, bad_words=[", _"]),  # its second token, only after its first
        # the greedy third token stops the request, except before 6 outputs
        "min_tokens": SamplingParams(**plain, min_tokens=6, stop_token_ids=[greedy[2]]),
    }


@pytest.mark.parametrize("k, async_scheduling", [(0, False), (0, True), (2, True)])
def test_greedy_constraints_match_the_reference_in_every_path(k, async_scheduling):
    """Serial and one step ahead, and with MTP drafts verified (greedy with constraints must equal the
    unspeculated reference); logprobs stay the raw model's, as vLLM reports by default."""
    tokenizer, model = default_tokenizer(), default_model()
    prompt = tokenizer.encode(PROMPT)
    assert len(_bad_word_ids([", _"])[0]) == 2  # a word with a prefix to match
    greedy = _greedy_reference(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    engine = engine_for(model, k=k, ring_size=4, tokenizer=tokenizer, async_scheduling=async_scheduling)
    requests = _requests(greedy)
    engine.add_request("plain", Prompt(tuple(prompt)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for name, params in requests.items():
        engine.add_request(name, Prompt(tuple(prompt)), params)
    outputs = run_to_completion(engine)
    assert outputs["plain"].outputs[0].token_ids == greedy
    for name, params in requests.items():
        want, logprobs = _greedy_reference(prompt, params)
        completion = outputs[name].outputs[0]
        assert completion.token_ids == want, name
        assert want != greedy[:len(want)], name  # the constraint did change the output
        if params.logprobs is not None:
            got = [position[t].logprob for position, t in zip(completion.logprobs, want, strict=True)]
            np.testing.assert_allclose(got, logprobs, atol=2e-3)
    assert len(outputs["min_tokens"].outputs[0].token_ids) > 3


def test_stop_strings_wait_for_min_tokens():
    """vLLM: a stop string ends the text only when it ends past the first min_tokens tokens' text."""
    tokenizer = default_tokenizer()
    ids = tokenizer.encode("path, _path, _path")
    texts = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    first_end = texts.index(next(t for t in texts if t.endswith("_")))  # the token completing the first "_"
    detokenizer = IncrementalDetokenizer(tokenizer, [], ("_",), min_tokens=first_end + 1)
    for token in ids:
        detokenizer.push([token])
        if detokenizer.stopped:
            break
    assert detokenizer.stopped == "_" and detokenizer.text == "path, _path, "


def test_logprobs_minus_one_is_the_whole_vocabulary():
    """vLLM: -1 asks for every token's logprob, allowed where max_logprobs is -1 (no cap)."""
    engine = engine_for(default_model(), tokenizer=default_tokenizer(), max_logprobs=-1)
    vocab = default_model().config.vocab_size
    prompt = tuple(default_tokenizer().encode(PROMPT))
    engine.add_request("all", Prompt(prompt), SamplingParams(temperature=0, max_tokens=2, logprobs=-1,
                                                             prompt_logprobs=-1))
    output = run_to_completion(engine)["all"]
    for position in output.outputs[0].logprobs + output.prompt_logprobs[1:]:
        assert len(position) == vocab
        assert abs(sum(np.exp(lp.logprob) for lp in position.values()) - 1) < 1e-3
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs must be at most max_logprobs"):
        engine_for(default_model()).add_request("capped", Prompt(prompt), SamplingParams(logprobs=-1))


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {4097: 1.0}), ("allowed_token_ids", [3, 4096]), ("bad_words", ["path"])])
def test_ids_outside_the_vocabulary_name_the_field(field, value):
    """Out-of-vocabulary ids are refused naming the field and the vocabulary size (vLLM's check); bad_words
    needs a tokenizer. Nothing is queued."""
    engine = engine_for(default_model(), tokenizer=None if field == "bad_words" else default_tokenizer())
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}") as error:
        engine.add_request("r", Prompt((1, 2, 3)), SamplingParams(**{field: value}))
    if field == "logit_bias":
        assert "4097" in str(error.value) and "4096" in str(error.value)
    assert not engine.has_unfinished_requests()
