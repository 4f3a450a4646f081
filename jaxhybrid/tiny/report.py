"""The default model's loss-curve plot and MODEL_CARD.md."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxhybrid.tiny.corpus import HELD_OUT_MODULES
from jaxhybrid.tiny.evaluate import HeldOutMetrics
from jaxhybrid.tiny.recipe import TrainSettings


@dataclass(frozen=True)
class TrainingRecord:
    settings: TrainSettings
    history: list[tuple[float, float]]  # per step (next-token loss, MTP loss)
    seconds: float
    num_train_files: int
    num_train_tokens: int
    num_params: int
    checkpoint_bytes: int
    roundtrip_error: float  # max |logits(load_model(dir)) - logits(in-memory params)|


def plot_loss_curve(history: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a build machine
    import matplotlib.pyplot as plt

    losses = np.asarray(history)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(losses[:, 0], label="next token (t+1)")
    ax.plot(losses[:, 1], label="MTP head (t+2)")
    ax.set(xlabel="step", ylabel="training cross-entropy (nats)", title="jaxhybrid default model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _samples_section(samples: list[tuple[str, str]]) -> str:
    blocks = [f"**Prompt** `{prompt}`\n\n```python\n{prompt}{completion}\n```" for prompt, completion in samples]
    return "\n\n".join(blocks)


def model_card(record: TrainingRecord, metrics: HeldOutMetrics, samples: list[tuple[str, str]]) -> str:
    s = record.settings
    tokens_seen = s.num_steps * s.batch_size * s.seq_len
    return f"""# jaxhybrid default model

A tiny Qwen3-Next-style hybrid language model of Python source code, shipped inside the `jaxhybrid` package
so that `jaxhybrid.load_model()`, `LLM()` and `python -m jaxhybrid.serve` work on a fresh machine with no
download. It exists to exercise the engine honestly (MTP drafts that are often accepted, recurrent-state
checkpoints of a real model); it is not useful as an assistant.

## Model

- Architecture: `qwen3_next` (HuggingFace names and layout), hidden 128, 6 layers: two Gated DeltaNet layers
  then one gated full-attention layer, twice; dense SwiGLU MLP (256); tied embeddings; one MTP layer
  (`mtp.*`, a full-attention decoder layer that predicts token t+2).
- Parameters: {record.num_params:,} (float32); `model.safetensors` is {record.checkpoint_bytes / 1e6:.2f} MB.
- Tokenizer: byte-level BPE, vocabulary {s.vocab_size}, special tokens `<|endoftext|>` (EOS),
  `<|im_start|>`, `<|im_end|>`, `<|mamba_checkpoint|>`; ChatML chat template.

## Training data

The `.py` files of the Python {platform.python_version()} standard library (found through `sysconfig`),
excluding test suites and `site-packages`, exact duplicates removed: {record.num_train_files} files,
{record.num_train_tokens:,} tokens, each file followed by `<|endoftext|>`. Held out from both the tokenizer
and the model: {", ".join(f"`{m}`" for m in HELD_OUT_MODULES)}.

## Training

{s.num_steps} steps of {s.batch_size} x {s.seq_len} tokens ({tokens_seen:,} tokens), AdamW (b2 0.95, weight
decay {s.weight_decay} on matrices, gradient clip {s.grad_clip}), linear warm-up over {s.warmup} steps to
{s.peak_lr} then cosine decay to {s.final_lr_fraction:g}x; loss = next-token cross-entropy + {s.mtp_loss_weight}
x MTP cross-entropy on token t+2; weights initialised as HuggingFace does (N(0, 0.02)); seed {s.seed}. The train
step runs the model code with two exact training-only ops swapped in (dense causal attention and a row-batched
chunked delta rule, `jaxhybrid/tiny/fast_ops.py`); every number below comes from the inference ops. XLA runs
single-threaded so the result does not depend on the core count. Wall time {record.seconds / 60:.1f} min on one
core of a shared build machine ({tokens_seen / record.seconds:,.0f} tokens/s). Reproduce with
`python -m jaxhybrid.train_tiny --out DIR`.

![training loss](loss_curve.png)

## Held-out results

Scored with the inference code on {metrics.num_tokens:,} next-token targets of the held-out modules
(independent windows of {s.seq_len} tokens).

| metric | value |
|---|---|
| next-token loss | {metrics.loss:.3f} nats |
| next-token perplexity | {metrics.perplexity:.2f} |
| unigram baseline perplexity (add-one, training counts) | {metrics.unigram_perplexity:.1f} |
| next-token top-1 accuracy | {metrics.accuracy:.1%} |
| MTP head loss (token t+2) | {metrics.mtp_loss:.3f} nats |
| MTP head top-1 accuracy (token t+2) | {metrics.mtp_accuracy:.1%} |
| checkpoint round trip, max logit difference | {record.roundtrip_error:.1e} |

## Greedy samples

{_samples_section(samples)}

## Limitations

Trained for minutes on one small corpus: it writes plausible-looking standard-library Python, often repeats
itself, and knows nothing else. Use it to test and benchmark the engine, not for its output.
"""
