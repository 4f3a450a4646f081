"""Incremental detokenization, stop strings, the checkpoint marker and the chat template on the embedded model's
tokenizer."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.engine.detokenize import IncrementalDetokenizer
from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER, Tokenizer
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
from scheduler import CheckpointMarkerError

TEXTS = ["def read_config(path):\n    return json.load(open(path))", "  # héllo → 日本語 ✓\n\tx = 1",
         "a<|im_end|>b", "print('naïve café')  "]


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def _stream(detok: IncrementalDetokenizer, ids: list[int], steps: list[int]) -> tuple[str, str | None]:
    """Push `ids` in steps of the given sizes (cycled); returns all text a client saw and the stop."""
    seen, i, k = "", 0, 0
    while i < len(ids) and detok.stopped is None:
        n = steps[k % len(steps)]
        delta = detok.push(ids[i : i + n])
        seen, i, k = seen + delta.text, i + n, k + 1
        if delta.stop is not None:
            return seen, delta.stop
    return seen + detok.flush(), None


@settings(max_examples=30, deadline=None)
@given(text=st.sampled_from(TEXTS), prompt=st.sampled_from(["", "x = ", "日"]),
       steps=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_streamed_text_equals_decoding_everything(text, prompt, steps):
    tok = _tokenizer()
    prompt_ids = tok.encode(prompt)
    out_ids = tok.encode(prompt + text)[len(prompt_ids) :]
    seen, stop = _stream(IncrementalDetokenizer(tok, prompt_ids), out_ids, steps)
    assert stop is None
    assert seen == tok.decode(prompt_ids + out_ids)[len(tok.decode(prompt_ids)) :]


@pytest.mark.parametrize("keep", [False, True])
@given(steps=st.lists(st.integers(1, 3), min_size=1, max_size=3))
@settings(max_examples=15, deadline=None)
def test_stop_strings_cut_the_text_and_are_never_shown_in_part(keep, steps):
    tok = _tokenizer()
    text = "x = load(path)\nreturn x  # done\nmore"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], stop=("# do", "retur"), include_stop_str_in_output=keep)
    shown = []
    seen, stop, i = "", None, 0
    while i < len(ids) and stop is None:
        delta = detok.push(ids[i : i + steps[0]])
        shown.append(seen := seen + delta.text)
        stop, i = delta.stop, i + steps[0]
    assert stop == "retur"
    assert seen == ("x = load(path)\nretur" if keep else "x = load(path)\n")
    assert all("ret" not in s or keep for s in shown)  # no prefix of a cut stop string ever went out
    assert detok.push(tok.encode(" more")) == ("", None)


def test_the_checkpoint_marker_is_one_special_token_and_bad_stops_are_refused():
    tok = _tokenizer()
    marker = tok.token_id(CHECKPOINT_MARKER)
    ids = tok.encode(f"def f():{CHECKPOINT_MARKER}    pass")
    assert ids.count(marker) == 1 and CHECKPOINT_MARKER not in tok.decode(ids)
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [], stop=("",))


def test_a_marked_prompt_loses_its_marker_and_records_the_checkpoint():
    tok = _tokenizer()
    anchor = tok.encode("def read_config(path):\n    with open(path) as f:\n        return f.read()\n")
    parsed = tok.encode_prompt(tok.decode(anchor) + CHECKPOINT_MARKER + "print(1)", hash_unit=4)
    assert parsed.token_ids[: len(anchor)] == tuple(anchor) and tok.token_id(CHECKPOINT_MARKER) not in parsed.token_ids
    assert parsed.checkpoint_position == len(anchor) // 4 * 4
    assert tok.encode_prompt("no marker here", hash_unit=4).checkpoint_position is None
    for bad in (CHECKPOINT_MARKER + "x = 1", f"a{CHECKPOINT_MARKER}b{CHECKPOINT_MARKER}c"):
        with pytest.raises(CheckpointMarkerError):
            tok.encode_prompt(bad, hash_unit=1)


def test_chat_messages_render_with_the_checkpoints_template():
    tok = _tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.apply_chat_template([messages[0], {"role": "user"}])
