"""jaxhybrid against HuggingFace transformers on the same random ~40M-parameter Qwen3-Next checkpoint.

transformers runs in the Python given by `--hf-python` (with torch and transformers; never a dependency of
this project), through `benchmarks/hf_peer.py`, which also writes the checkpoint. Jobs, each timed after a
warm-up on both sides (jaxhybrid compiles every bucket first):
  score      1 anchor of 512 tokens x 64 candidates of 64: the candidates' prompt logprobs. transformers
             runs full forwards in batches of 8; jaxhybrid puts the checkpoint marker before the anchor's
             last token, so the anchor is computed once and each candidate from the checkpoint on.
  gen_b16    greedy generation, 16 prompts of 128 tokens, 64 new tokens each (eos ignored);
  gen_b1     the same for one prompt.
Checks: logprobs agree to 1e-3; greedy tokens are compared position by position (two float32
implementations may part ways at a near tie, and then on). The baseline is transformers, measured in the
same run: the table reports the speed ratio jaxhybrid / transformers (targets on CPU: >= 10x for score,
>= 3x for gen_b16, >= 1.5x for gen_b1).

Prints a table, writes benchmarks/results/vs_transformers.json and vs_transformers.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import peer_work as peer
from common import RESULTS, figure, write_results  # benchmarks/ is sys.path[0]

PEER = Path(__file__).parent / "hf_peer.py"
CANDIDATES = 64


def jobs(vocab: int) -> dict:
    rng = np.random.default_rng(0)
    ids = lambda n: peer.random_ids(rng, vocab, n)
    candidates = [ids(peer.CANDIDATE_LEN) for _ in range(CANDIDATES)]
    generate = lambda rows: {"kind": "generate", "prompts": [ids(peer.PROMPT_LEN) for _ in range(rows)],
                             "new_tokens": peer.NEW_TOKENS}
    return {"score": {"kind": "score", "anchor": ids(peer.ANCHOR), "candidates": candidates, "batch": 8},
            "gen_b16": generate(16), "gen_b1": generate(1)}


def ours(directory: Path, work: dict) -> dict:
    start = time.perf_counter()
    llm = peer.engine(directory)
    compile_s = time.perf_counter() - start
    job = work["score"]
    other_anchor = [t % 8000 + 1 for t in job["anchor"]]  # warm-up, not cached
    peer.score(llm, other_anchor, job["candidates"][:2])
    seconds, logprobs = peer.score(llm, job["anchor"], job["candidates"])
    out = {"score": {"seconds": seconds, "values": logprobs}}
    for name in ("gen_b16", "gen_b1"):
        peer.generate(llm, work[name]["prompts"], 4)
        seconds, tokens = peer.generate(llm, work[name]["prompts"], peer.NEW_TOKENS)
        out[name] = {"seconds": seconds, "values": tokens}
    out["compile_s"] = compile_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-python", required=True, help="a Python with torch and transformers installed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory, work_path, peer_out = Path(tmp) / "ckpt", Path(tmp) / "jobs.json", Path(tmp) / "hf.json"
        params = int(subprocess.run([args.hf_python, str(PEER), "write", str(directory)], check=True,
                                    capture_output=True, text=True).stdout.split()[-1])
        work = jobs(json.loads((directory / "config.json").read_text())["vocab_size"])
        work_path.write_text(json.dumps(work))
        subprocess.run([args.hf_python, str(PEER), "run", str(directory), str(work_path), str(peer_out)], check=True)
        hf = json.loads(peer_out.read_text())
        mine = ours(directory, work)
    units = {"score": (CANDIDATES, "candidates/s"), "gen_b16": (16 * peer.NEW_TOKENS, "tokens/s"),
             "gen_b1": (peer.NEW_TOKENS, "tokens/s")}
    rows = []
    for name, (count, unit) in units.items():
        row = {"job": name, "unit": unit, "jaxhybrid": count / mine[name]["seconds"],
               "transformers": count / hf[name]["seconds"]}
        row["ratio"] = row["jaxhybrid"] / row["transformers"]
        if name == "score":
            row["max_logprob_diff"] = float(np.abs(np.array(mine[name]["values"]) - np.array(hf[name]["values"])).max())
        else:
            row["same_tokens"] = peer.agreeing_prefix(mine[name]["values"], hf[name]["values"])
        rows.append(row)
    print(f"checkpoint: random Qwen3-Next, {params / 1e6:.1f}M parameters; jaxhybrid compile {mine['compile_s']:.0f} s")
    print(f"{'job':<9}{'unit':>14}{'jaxhybrid':>11}{'transformers':>14}{'ratio':>8}  check")
    for r in rows:
        check = (f"max |dlogprob| {r['max_logprob_diff']:.1e}" if "max_logprob_diff" in r
                 else f"agreeing prefix {r['same_tokens']:.2f}")
        print(f"{r['job']:<9}{r['unit']:>14}{r['jaxhybrid']:>11.1f}{r['transformers']:>14.1f}{r['ratio']:>8.2f}"
              f"  {check}")
    write_results("vs_transformers", rows, {"parameters": params, "compile_s": mine["compile_s"]})
    plot(rows, RESULTS / "vs_transformers.png")
    assert all(r.get("max_logprob_diff", 0) <= 1e-3 for r in rows), "logprobs disagree with transformers"


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, figsize=(6, 3.5)) as (fig, ax):
        ax.bar([r["job"] for r in rows], [r["ratio"] for r in rows])
        ax.axhline(1, color="gray", linewidth=0.8)
        ax.set_ylabel("jaxhybrid / transformers")
        ax.set_title("speed ratio, same checkpoint, CPU")


if __name__ == "__main__":
    main()
