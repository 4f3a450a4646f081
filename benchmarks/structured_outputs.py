"""What a JSON schema costs: output tokens/s at batch 16 and 64 under a schema against the same batch unconstrained,
on the embedded model, one engine, alternating A B A B.

Every row generates exactly NEW_TOKENS tokens either way (eos ignored), so the batch stays full and both sides do
the same device work; the schema is an array of car descriptions without bound, so every token is under a real
JSON constraint (strings, enums, separators) to the end. A constrained step runs in two halves with the host
filling the masks while the device runs the layers (docs/engine.md), so the cost is the second dispatch, the
masks' transfer and whatever mask time the layers do not hide. Goal: at most 10% slower.

It also samples 100 replies to vLLM's CarDescription schema at temperature 1.0 (objects closed, whitespace off:
the strings are then the only free part, and the random model's reply ends where its strings do) and counts the
replies that end within 490 tokens and validate (`jsonschema`).

    python benchmarks/structured_outputs.py [--k 3]

Prints a table, writes benchmarks/results/structured_outputs.json and structured_outputs.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jsonschema
import numpy as np
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]
from tqdm import tqdm

from jaxhybrid import LLM
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams

CAR = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                        "model": {"type": "string", "maxLength": 12},
                                        "car_type": {"type": "string", "enum": ["sedan", "SUV", "Truck", "Coupe"]}},
       "required": ["brand", "model", "car_type"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": CAR}
CAR_DESCRIPTION = {  # vLLM's CarDescription, as pydantic writes its schema
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
    "properties": {"brand": {"title": "Brand", "type": "string"}, "model": {"title": "Model", "type": "string"},
                   "car_type": {"$ref": "#/$defs/CarType"}},
    "required": ["brand", "model", "car_type"], "title": "CarDescription", "type": "object"}
CAR_PROMPT = "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's"
BATCHES, NEW_TOKENS, ROUNDS, PROMPT = (16, 64), 96, 2, "A list of cars as JSON:"


def run(llm: LLM, batch: int, constrained: bool, seed: int) -> tuple[float, list[str]]:
    """Seconds for `batch` requests of NEW_TOKENS tokens, and their texts."""
    structured = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=NEW_TOKENS, ignore_eos=True,
                             structured_outputs=structured) for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate([f"{PROMPT} {seed + i}" for i in range(batch)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    return seconds, [o.outputs[0].text for o in outputs]


def car_descriptions(llm: LLM, replies: int = 100, max_tokens: int = 490) -> dict:
    """How many of `replies` sampled CarDescriptions end within `max_tokens` and validate."""
    structured = StructuredOutputsParams(json=CAR_DESCRIPTION, disable_any_whitespace=True,
                                         disable_additional_properties=True)
    outputs = llm.generate([CAR_PROMPT] * replies, SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                                  structured_outputs=structured), use_tqdm=False)
    valid = 0
    for output in outputs:
        try:
            jsonschema.validate(json.loads(output.outputs[0].text), CAR_DESCRIPTION)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {"replies": replies, "valid": valid, "max_tokens": max_tokens, "longest": max(lengths),
            "median_tokens": float(np.median(lengths))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=0, help="MTP draft tokens (0: none)")
    args = parser.parse_args()
    speculative = {"method": "mtp", "num_speculative_tokens": args.k} if args.k else None
    llm = LLM(max_num_seqs=max(BATCHES), speculative_config=speculative)
    rows = []
    work = [(batch, round_, constrained) for batch in BATCHES for round_ in range(ROUNDS)
            for constrained in (False, True)]
    for batch in BATCHES:  # warm-up: compiles both kinds of step at this batch's buckets
        for constrained in (False, True):
            run(llm, batch, constrained, seed=10_000)
    times: dict[tuple[int, bool], list[float]] = {}
    for batch, round_, constrained in tqdm(work, desc="A B A B", total=len(work)):
        seconds, texts = run(llm, batch, constrained, seed=1000 * round_)
        assert not constrained or all(t.startswith("[") for t in texts)  # a JSON array under way
        times.setdefault((batch, constrained), []).append(seconds)
    for batch in BATCHES:
        free, schema = (batch * NEW_TOKENS / min(times[(batch, c)]) for c in (False, True))
        rows.append({"batch": batch, "k": args.k, "free_tok_s": free, "json_tok_s": schema, "ratio": schema / free})
    print(f"{'batch':>5} {'K':>2} {'free tok/s':>11} {'json tok/s':>11} {'json/free':>9}")
    for row in rows:
        print(f"{row['batch']:>5} {row['k']:>2} {row['free_tok_s']:>11.0f} {row['json_tok_s']:>11.0f} "
              f"{row['ratio']:>9.3f}")
    cars = car_descriptions(llm)
    print(f"CarDescription at temperature 1.0: {cars['valid']}/{cars['replies']} end and validate "
          f"(longest {cars['longest']} tokens, median {cars['median_tokens']:.0f})")
    name = "structured_outputs" + (f"_k{args.k}" if args.k else "")
    write_results(name, rows, {"new_tokens": NEW_TOKENS, "rounds": ROUNDS, "schema": json.dumps(SCHEMA),
                               "cores_used": os.cpu_count(), "best_of": ROUNDS},
                  car_descriptions=cars)
    with figure(RESULTS / f"{name}.png", figsize=(5, 3.2)) as (_, ax):
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["free_tok_s"] for r in rows], 0.4, label="unconstrained")
        ax.bar(x + 0.2, [r["json_tok_s"] for r in rows], 0.4, label="JSON schema")
        ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"structured-output cost, embedded model, K={args.k}")
        ax.legend()


if __name__ == "__main__":
    main()
