"""Generate from the command line with `LLM`: `python -m jaxhybrid.generate --prompt "def read_config(path):"`
runs the embedded default model (greedy unless --temperature; MTP drafts with --speculative-tokens)."""

from __future__ import annotations

import argparse
import sys
import time

from jaxhybrid.llm import LLM
from jaxhybrid.malloc import preload_tcmalloc
from jaxhybrid.sample.params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--speculative-tokens", type=int, default=3, help="MTP drafts per step (0: off)")
    args = parser.parse_args(argv)
    k = args.speculative_tokens
    speculative = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(args.model, speculative_config=speculative, num_blocks=1024, num_state_slots=64, max_num_seqs=16)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                       seed=args.seed), use_tqdm=False)
    seconds = time.perf_counter() - start
    for output in outputs:
        sys.stdout.write(output.prompt + output.outputs[0].text + "\n\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{tokens} tokens in {seconds:.2f} s, compilation included]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    preload_tcmalloc()
    sys.exit(main())
