"""The HuggingFace transformers side of `benchmarks/vs_transformers.py`, run by the Python given as
`--hf-python` (torch and transformers there; this project never imports them).

  python hf_peer.py write DIR [moe]      a random ~40M-parameter Qwen3-Next checkpoint (seeded), with the
                                         default model's tokenizer (4096 ids of the 8192) so servers take text;
                                         `moe`: the 40.75M variant vLLM can load (it needs MoE layers): vocab
                                         4096, 8 routed experts (top 2) and a shared one in every layer
  python hf_peer.py run DIR JOBS OUT     time the jobs in JOBS (json) and write OUT (json)

Jobs: "score" (prompt logprobs of each candidate's tokens after a shared anchor, full forwards in
batches) and "generate" (greedy, a fixed number of new tokens, eos ignored), each after one warm-up.
"""

import json
import shutil
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TOKENIZER = Path(__file__).resolve().parent.parent / "jaxhybrid" / "assets" / "default_model"

import torch  # noqa: E402
import transformers  # noqa: E402

CONFIG = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, mlp_only_layers=list(range(8)),
    num_experts=0, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=0,
)
MOE = dict(vocab_size=4096, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
           shared_expert_intermediate_size=256, mlp_only_layers=[], decoder_sparse_step=1)


def write(directory: str, variant: str = "dense") -> None:
    torch.manual_seed(0)
    config = CONFIG | (MOE if variant == "moe" else {})
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config)).eval()
    model.generation_config.pad_token_id = CONFIG["eos_token_id"]  # else generate() warns on every request
    model.save_pretrained(directory)
    shutil.copy(TOKENIZER / "tokenizer.json", Path(directory) / "tokenizer.json")
    tokenizer_config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = CONFIG["max_position_embeddings"]
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    print(sum(p.numel() for p in model.parameters()))


@torch.no_grad()
def score(model, anchor: list[int], candidates: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    """Full forwards of anchor + candidate in batches; candidates of unequal length are right-padded (a causal
    model's logits at a position never see the padding after it)."""
    start, logprobs = time.perf_counter(), []
    for i in range(0, len(candidates), batch):
        group = candidates[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([anchor + c + [0] * (width - len(c)) for c in group])
        out = torch.log_softmax(model(ids).logits.float(), dim=-1)
        targets = ids[:, len(anchor):]
        picked = out[:, len(anchor) - 1:-1].gather(-1, targets[..., None])[..., 0]
        logprobs += [row[:len(c)] for row, c in zip(picked.tolist(), group, strict=True)]
    return time.perf_counter() - start, logprobs


@torch.no_grad()
def generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = model.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long))
    return time.perf_counter() - start, out[:, len(prompts[0]):].tolist()


def run(directory: str, jobs_path: str, out_path: str) -> None:
    torch.set_num_threads(torch.get_num_threads())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    jobs, results = json.loads(open(jobs_path).read()), {}
    for name, job in jobs.items():
        if job["kind"] == "score":
            score(model, job["anchor"], job["candidates"][:job["batch"]], job["batch"])  # warm-up
            results[name] = score(model, job["anchor"], job["candidates"], job["batch"])
        else:
            generate(model, job["prompts"], 4)  # warm-up
            results[name] = generate(model, job["prompts"], job["new_tokens"])
    open(out_path, "w").write(json.dumps({name: {"seconds": s, "values": v} for name, (s, v) in results.items()}))


if __name__ == "__main__":
    {"write": write, "run": run}[sys.argv[1]](*sys.argv[2:])
