"""`python -m jaxhybrid.run_batch`: offline batch jobs, JSONL in and JSONL out, in input order (docs/batch.md).

Two line formats, told apart by their keys: the OpenAI batch lines of `vllm run-batch`, and scoring lines
`{"id", "prompt", "candidates", "top_logprobs"?}`, whose prompt is computed once for all its candidates.
A bad line becomes an error line and the job goes on. Lines run a window at a time, each window from an
empty prefix cache; ids and seeds come from line numbers. So a line's output depends only on its window, and a
resumed job (`--resume`) or one spread over Ray Data actors (`--ray`) writes the same bytes as one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from jaxhybrid.batch_job import BatchJob
from jaxhybrid.engine.args import ParserSetupError
from jaxhybrid.engine.builder import build_engine
from jaxhybrid.flags import (
    TOOL_FLAGS,
    FlagParser,
    check_tool_flags,
    from_namespace,
    make_parser,
    non_default,
    parse_args,
)
from jaxhybrid.malloc import preload_tcmalloc
from jaxhybrid.ray_data import score_windows

log = logging.getLogger("jaxhybrid.run_batch")


@dataclass
class JobSummary:
    lines: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the cache or a checkpoint, of all looked up
    checkpoint_hit_rate: float = 0.0    # requests with a checkpoint that started from it, of all with one

    def describe(self, resumed_after: int = 0) -> str:
        """The job's end, in one line an operator reads."""
        seconds = max(self.seconds, 1e-9)
        resumed = f" (resumed after {resumed_after} lines)" if resumed_after else ""
        return (f"done: {self.lines} lines{resumed}, {self.errors} errors, {self.prompt_tokens} prompt tokens in, "
                f"{self.generated_tokens} generated tokens out in {self.seconds:.1f} s: {self.lines / seconds:.2f} "
                f"lines/s, {self.prompt_tokens / seconds:.0f} prompt tok/s, {self.generated_tokens / seconds:.0f} "
                f"generated tok/s; prefix cache hit rate {self.prefix_cache_hit_rate:.1%}, checkpoint hit rate "
                f"{self.checkpoint_hit_rate:.1%}")

    @classmethod
    def of(cls, counters: Counter, seconds: float) -> JobSummary:
        """From `BatchJob.counters`, summed over windows and replicas."""
        return cls(counters["lines"], counters["errors"], counters["prompt_tokens"], counters["generated_tokens"],
                   seconds, counters["cached_tokens"] / max(counters["prefix_cache_queries"], 1),
                   counters["checkpoint_hits"] / max(counters["checkpoint_queries"], 1))


def resume_point(output: Path, window: int) -> int:
    """Lines of an earlier run of the job to keep: its complete lines, down to a whole number of windows (a
    line's floating-point results depend on the lines it ran with). The rest is cut off the file."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    keep = data.count(b"\n") // window * window
    end = 0
    for _ in range(keep):
        end = data.index(b"\n", end) + 1
    with output.open("r+b") as f:
        f.truncate(end)
    return keep


def count_lines(path: Path) -> int:
    """The non-blank lines of `path` (the job's lines, as `_input_lines` numbers them): one pass over the bytes
    before the job starts, without decoding or parsing, so that the bar has a total and an ETA."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _input_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number among non-blank lines, text), read lazily."""
    with path.open() as f:
        yield from enumerate(line for line in f if line.strip())


PROG = "python -m jaxhybrid.run_batch"
_SCORE_FLAGS: dict[str, dict] = {
    "--input-file": dict(required=True, aliases=("-i",), help="JSONL input (OpenAI batch lines or scoring lines): a "
                         "path (vLLM's URLs are not fetched)"),
    "--output-file": dict(required=True, aliases=("-o",), help="JSONL output, one line per input line, in input order"),
    "--resume": dict(action="store_true", help="keep the complete lines of an earlier run and carry on"),
    "--window": dict(type=int, default=256, help="input lines in flight at once"),
    "--top-logprobs": dict(type=int, default=None, help="scoring lines: top-k next tokens after the prompt"),
    "--checkpoint-reuse": dict(action=argparse.BooleanOptionalAction, default=True,
                               help="scoring lines: compute each prompt once (--no-checkpoint-reuse: per candidate)"),
    "--served-model-name": dict(default=None, help="the `model` field of OpenAI batch responses"),
    "--ray": dict(action="store_true", help="data parallel: windows spread over Ray Data actors, one engine each"),
    "--num-replicas": dict(type=int, default=1, help="with --ray: engines (actors; one GPU each where GPUs exist)"),
    "--ray-address": dict(default=None, help="with --ray: the cluster to join (default: RAY_ADDRESS, else local)"),
    **TOOL_FLAGS,
}


def parser(prog: str = PROG) -> FlagParser:
    return make_parser(prog, __doc__.splitlines()[0], _SCORE_FLAGS)


def parse_flags(argv: list[str] | None, prog: str = PROG) -> argparse.Namespace:
    flags = parser(prog)
    args = parse_args(flags, argv)
    check_tool_flags(flags, args)
    return args


def main(argv: list[str] | None = None, prog: str = PROG) -> JobSummary:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_flags(argv, prog)
    flags = parser(prog)
    log.info("non-default arguments: %s", non_default(flags, args))
    source, output = Path(args.input_file), Path(args.output_file)
    if not source.exists():
        flags.error(f"--input-file {source} does not exist")
    if args.window < 1 or args.num_replicas < 1:
        flags.error("--window and --num-replicas must be >= 1")
    done = resume_point(output, args.window) if args.resume else 0
    job_options = dict(model_name=args.served_model_name or str(args.model or "jaxhybrid-default"),
                       created=int(source.stat().st_mtime), seed=args.seed, reuse=args.checkpoint_reuse,
                       default_top_logprobs=args.top_logprobs, tool_call_parser=args.tool_call_parser,
                       enable_auto_tool_choice=args.enable_auto_tool_choice)
    lines = itertools.islice(_input_lines(source), done, None)
    if args.ray:
        windows = score_windows(lines, args.window, num_replicas=args.num_replicas, address=args.ray_address,
                                make_engine=functools.partial(build_engine, from_namespace(args)),
                                job_options=job_options)
    else:
        try:
            job = BatchJob(build_engine(from_namespace(args)), **job_options)
        except ParserSetupError as error:  # a parser flag the model's tokenizer cannot serve: one line
            raise SystemExit(f"python -m jaxhybrid.run_batch: error: {error}") from None
        windows = job.run(lines, args.window)
    start, counters = time.perf_counter(), Counter()
    with (output.open("a" if args.resume else "w") as out,
          tqdm(desc="lines", unit="line", total=count_lines(source), initial=done) as bar):
        for texts, counted in windows:
            for text in texts:
                out.write(text)  # one whole line per write; a kill leaves at most a torn last line
                out.flush()
            counters += counted
            bar.update(len(texts))
            seconds = time.perf_counter() - start
            bar.set_postfix_str(f"{counters['prompt_tokens'] / seconds:.0f} prompt tok/s, "
                                f"{counters['generated_tokens'] / seconds:.0f} generated tok/s, "
                                f"{counters['errors']} errors")
        os.fsync(out.fileno())
    summary = JobSummary.of(counters, time.perf_counter() - start)
    log.info("%s", summary.describe(done))
    print(json.dumps({"summary": dataclasses.asdict(summary), "resumed_after": done}), file=sys.stderr)
    return summary


if __name__ == "__main__":
    preload_tcmalloc()
    main()
