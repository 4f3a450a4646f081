"""Data parallel batch jobs on Ray Data: one engine per actor of a `map_batches` actor pool.

In a pipeline of your own, turn each input line into a row `{"index": line number, "line": JSON text}` (the
formats of `jaxhybrid.batch_job`; the index names ids and seeds, so a line's output does not depend on the
replica that runs it) and map batches of rows through `ScoreReplica`:

    import functools, ray
    from jaxhybrid.engine.args import EngineArgs
    from jaxhybrid.engine.builder import build_engine
    from jaxhybrid.ray_data import ScoreReplica, replica_resources

    ray.data.DataContext.get_current().execution_options.preserve_order = True   # outputs in input order
    scored = dataset.map_batches(ScoreReplica, batch_size=256, compute=ray.data.ActorPoolStrategy(size=4),
                                 **replica_resources(),
                                 fn_constructor_kwargs={"make_engine": functools.partial(
                                     build_engine, EngineArgs(model="path/to/model"))})
    for row in scored.iter_rows(): ...   # {"index", "output": the output line's JSON text, "counters"}

Each batch runs as one window of the job (`BatchJob`). `python -m jaxhybrid.run_batch --ray --num-replicas R`
does this for a JSONL file; its rows are whole windows aligned to line numbers, so every line meets the
same neighbours as in a one-process run and the output file is byte-identical to it (and resumable).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np

from jaxhybrid.batch_job import BatchJob
from jaxhybrid.engine.builder import BuiltEngine


class ScoreReplica:
    """A Ray Data actor: one engine from `make_engine()`, a `BatchJob` over it (`job_options` are its keyword
    arguments). A batch of line rows (`index`, `line`) is one window; a batch of window rows (`first`,
    `lines`) is one window per row. Returns line rows: `index`, `output` (the output line, newline
    included) and `counters` (JSON of what the window counted, `BatchJob.counters`, on its last line)."""

    def __init__(self, make_engine: Callable[[], BuiltEngine], **job_options) -> None:
        self.job = BatchJob(make_engine(), **job_options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        index, output, counters = [], [], []
        for window in _windows(batch):
            for texts, counted in self.job.run(iter(window), len(window)):
                output += texts
                counters += [""] * (len(texts) - 1) + [json.dumps(counted)]
            index += [i for i, _ in window]
        return {"index": np.array(index, np.int64), "output": np.array(output, object),
                "counters": np.array(counters, object)}


def _windows(batch: dict[str, np.ndarray]) -> Iterator[list[tuple[int, str]]]:
    if "lines" in batch:
        for first, lines in zip(batch["first"].tolist(), batch["lines"], strict=True):
            yield list(enumerate((str(line) for line in lines), first))
    else:
        yield list(zip(batch["index"].tolist(), (str(line) for line in batch["line"]), strict=True))


def replica_resources() -> dict:
    """`map_batches` resources of one replica: a GPU each where the cluster has GPUs."""
    import ray

    return {"num_gpus": 1} if ray.cluster_resources().get("GPU") else {}


def score_windows(lines: Iterator[tuple[int, str]], window: int, *, num_replicas: int,
                  make_engine: Callable[[], BuiltEngine], job_options: dict,
                  address: str | None = None) -> Iterator[tuple[list[str], Counter]]:
    """`BatchJob.run` over `num_replicas` engines: per window (aligned to line numbers), in input order, its
    output lines and what it counted. The driver holds the input lines' text."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    rows = []
    for index, text in lines:
        if not rows or index % window == 0:
            rows.append({"first": index, "lines": []})
        rows[-1]["lines"].append(text)
    if not rows:
        return
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ScoreReplica, batch_size=1, compute=ray.data.ActorPoolStrategy(size=num_replicas), **replica_resources(),
        fn_constructor_kwargs={"make_engine": make_engine, **job_options})
    texts = []
    for row in dataset.iter_rows():
        texts.append(row["output"])
        if row["counters"]:  # a window's last line
            yield texts, Counter(json.loads(row["counters"]))
            texts = []
