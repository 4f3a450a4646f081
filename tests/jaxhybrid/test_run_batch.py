"""Offline batch jobs: scores equal the full forward's log-probabilities in both line formats, with and
without checkpoint reuse; bad lines become error lines while the job goes on; a killed job resumes to a
byte-identical output file."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import numpy as np
import pytest

from jaxhybrid.batch_job import BatchJob
from jaxhybrid.llm import LLM
from jaxhybrid.run_batch import _input_lines, count_lines, main
from tests.tolerances import assert_close

PROMPT = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n"
CANDIDATES = ["        return f.read()\n", "        pass\n", "        return json.load(f)\n"]
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=192, num_blocks=96, num_state_slots=24,
             token_buckets=(16, 64), row_buckets=(4,), mamba_block_size=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


def reference_logprobs(llm: LLM, tokens: list[int]) -> np.ndarray:
    """log P(tokens[p] | tokens[:p]) for p >= 1, from `load_model`'s full forward."""
    logits = np.asarray(llm.model(np.array([tokens])), np.float64)[0]
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return logprobs[np.arange(len(tokens) - 1), tokens[1:]]


SCORE_ATOL = 1e-4  # the job's contract with its users, tighter than the worst-case float32 bound


def assert_logprobs_close(llm: LLM, actual, tokens: list[int], start: int) -> None:
    """Scores against the full forward from position `start`: the same maths in two blockings."""
    assert_close(actual, reference_logprobs(llm, tokens)[start:], SCORE_ATOL, "token logprobs")


def run_lines(llm: LLM, lines: list, reuse: bool = True) -> list[dict]:
    job = BatchJob(llm.built, model_name="m", reuse=reuse)
    raw = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    return [json.loads(text) for texts, _ in job.run(iter(enumerate(raw)), window=3) for text in texts]


@pytest.mark.parametrize("reuse", [True, False])
def test_scoring_lines_equal_the_full_forward(llm, reuse):
    tokenizer = llm.tokenizer
    context = tokenizer.encode(PROMPT)
    (out,) = run_lines(llm, [{"id": "q", "prompt": PROMPT, "candidates": CANDIDATES, "top_logprobs": 3}], reuse)
    assert out["id"] == "q" and out["error"] is None
    for candidate, score in zip(CANDIDATES, out["scores"], strict=True):
        assert_logprobs_close(llm, score["token_logprobs"], context + tokenizer.encode(candidate), len(context) - 1)
        assert score["logprob"] == pytest.approx(sum(score["token_logprobs"]))
    logits = np.asarray(llm.model(np.array([context])), np.float64)[0, -1]  # the distribution after the prompt
    assert [t["token_id"] for t in out["top_logprobs"]] == np.argsort(-logits)[:3].tolist()
    if reuse:  # the prompt was computed once: later candidates started from the checkpoint
        assert llm.engine.stats.checkpoint_hits >= 2


def test_score_candidates_with_token_ids(llm):
    context = list(range(5, 60))
    candidates = [[7, 8, 9], [100, 3]]
    scores = llm.score_candidates(context, candidates, top_logprobs=2)
    for candidate, score in zip(candidates, scores.candidates, strict=True):
        assert_logprobs_close(llm, score.token_logprobs, context + candidate, len(context) - 1)
    assert len(scores.top_logprobs) == 2


def test_openai_batch_lines(llm):
    lines = [
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}},
        {"custom_id": "gen", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
    ]
    echo, gen, chat = run_lines(llm, lines)
    assert [o["custom_id"] for o in (echo, gen, chat)] == ["echo", "gen", "chat"]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in (echo, gen, chat))
    logprobs = echo["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    assert logprobs[0] is None
    assert_logprobs_close(llm, logprobs[1:], llm.tokenizer.encode(PROMPT), 0)
    # the request leaves repetition_penalty unset: the checkpoint's generation config sets it, as for LLM
    defaults = dataclasses.replace(llm.get_default_sampling_params(), temperature=0, max_tokens=5)
    greedy = llm.generate(PROMPT, defaults, use_tqdm=False)[0].outputs[0].text
    assert gen["response"]["body"]["choices"][0]["text"] == greedy
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 3


def test_openai_batch_lines_with_structured_outputs(llm):
    """Structured outputs in the batch job: a regex on a completion, a choice on a chat line, and a grammar that
    does not compile, which becomes that line's 400 while the others run."""
    lines = [
        {"custom_id": "regex", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 12, "seed": 0, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}},
        {"custom_id": "choice", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 8, "seed": 0,
                  "structured_outputs": {"choice": ["left", "right"]}}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "structured_outputs": {"regex": "(a"}}},
    ]
    regex, choice, bad = run_lines(llm, lines)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex["response"]["body"]["choices"][0]["text"])
    assert choice["response"]["body"]["choices"][0]["message"]["content"] in ("left", "right")
    assert bad["response"] is None and bad["error"]["code"] == 400
    assert bad["error"]["message"].startswith("structured_outputs.regex does not compile")


def test_bad_lines_become_error_lines_and_the_job_goes_on(llm):
    good = {"id": "ok", "prompt": PROMPT, "candidates": CANDIDATES[:1]}
    lines = ["{not json", {"id": "x", "prompt": PROMPT, "candidates": ["a"], "colour": "red"},
             {"id": "long", "prompt": PROMPT * 40, "candidates": ["a"]}, {"id": "empty", "prompt": PROMPT,
                                                                        "candidates": []},
             {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}},
             {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}},
             good]
    outputs = run_lines(llm, lines)
    errors = [o["error"] for o in outputs[:-1]]
    assert [e["param"] for e in errors] == ["line", "colour", "prompt", "candidates", "url", "n"]
    assert "not JSON" in errors[0]["message"] and "colour" in errors[1]["message"]
    assert "maximum context length" in errors[2]["message"]
    assert outputs[4]["response"] is None and outputs[4]["custom_id"] == "c"
    assert outputs[-1]["error"] is None and len(outputs[-1]["scores"]) == 1
    assert not llm.engine.has_unfinished_requests()


def job_flags(directory) -> list[str]:
    """A job of scoring lines (prompts sharing prefixes, so windows hit each other's cached states) and sampled
    completions, with windows of 3 lines: the CLI flags that run it."""
    lines = [{"id": f"s{i}", "prompt": PROMPT + "x" * i, "candidates": CANDIDATES[i % 3:]} for i in range(6)]
    lines += [{"custom_id": f"g{i}", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": f"def f{i}(x):", "max_tokens": 4, "temperature": 1.0}} for i in range(4)]
    source = directory / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["-i", str(source), "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len",
            "192", "--num-blocks", "96", "--num-state-slots", "24", "--token-buckets", "16", "64", "--row-buckets",
            "4", "--no-precompile", "--compilation-cache-dir", "", "--window", "3", "--seed", "5"]


@pytest.fixture(scope="module")
def whole_job(tmp_path_factory) -> tuple[list[str], bytes]:
    """The job's flags and the output file of an uninterrupted one-process run."""
    directory = tmp_path_factory.mktemp("job")
    flags, whole = job_flags(directory), directory / "whole.jsonl"
    summary = main([*flags, "--output-file", str(whole)])
    assert summary.lines == 10 and summary.errors == 0 and summary.checkpoint_hit_rate > 0
    return flags, whole.read_bytes()


def test_a_killed_job_resumes_to_the_same_bytes(whole_job, tmp_path, capsys, caplog):
    flags, whole = whole_job
    killed = tmp_path / "killed.jsonl"
    kept = whole.splitlines(keepends=True)
    killed.write_bytes(b"".join(kept[:4]) + kept[4][:17])  # four whole lines (one window and one more), a torn one
    caplog.set_level(logging.INFO, "jaxhybrid.run_batch")
    main([*flags, "--output-file", str(killed), "--resume"])
    assert killed.read_bytes() == whole
    # the bar counts the input's lines before the job starts (total, percentage, ETA), from the resumed line on
    bar = capsys.readouterr().err
    assert re.search(r"lines:\s+30%\|.*\| 3/10 ", bar) and re.search(r"lines: 100%\|.*\| 10/10 ", bar), bar
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done: ")]
    assert summary.startswith("done: 7 lines (resumed after 3 lines), 0 errors, "), summary


def test_the_bar_total_counts_the_lines_the_job_reads(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"a": 1}\n\n  \n{"b": 2}\r\n{"c": 3}')  # blank lines are skipped; the last lacks its newline
    assert count_lines(source) == 3 == len(list(_input_lines(source)))


@pytest.mark.timeout(900)  # two actors each load and compile an engine: minutes on a loaded machine; a hang bound
def test_ray_data_replicas_write_the_same_bytes(whole_job, tmp_path):
    """`--ray --num-replicas 2`: windows spread over two actors, each with its own engine."""
    import ray

    flags, whole = whole_job
    output = tmp_path / "ray.jsonl"
    try:
        summary = main([*flags, "--output-file", str(output), "--ray", "--num-replicas", "2"])
    finally:
        ray.shutdown()
    assert output.read_bytes() == whole
    assert summary.lines == 10 and summary.errors == 0 and summary.checkpoint_hit_rate > 0
