"""Build the embedded default model from scratch: `python -m jaxhybrid.train_tiny --out DIR`.

Gathers the standard-library corpus, trains the tokenizer and the model (next token + MTP), then writes a
HuggingFace checkpoint directory with the tokenizer, reference logits, a loss curve and MODEL_CARD.md.
XLA runs single-threaded so that the result does not depend on the machine's core count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from jaxhybrid.llm import LLM
from jaxhybrid.models.export import export_hf_checkpoint
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.weights import load_model
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.tiny.bpe import EOS_TOKEN, encode_documents, save_tokenizer, train_tokenizer
from jaxhybrid.tiny.corpus import Corpus, gather_corpus
from jaxhybrid.tiny.evaluate import HeldOutMetrics, evaluate
from jaxhybrid.tiny.init import hf_init_params
from jaxhybrid.tiny.recipe import TrainSettings, hf_config
from jaxhybrid.tiny.report import TrainingRecord, model_card, plot_loss_curve
from jaxhybrid.tiny.roundtrip import NUM_REFERENCE_TOKENS, model_outputs, save_reference
from jaxhybrid.tiny.train import train, windows

SAMPLE_PROMPTS = ("def read_config(path):", "class Stack:", "def is_prime(n):")
SAMPLE_TOKENS = 80
_SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


@dataclass(frozen=True)
class TrainedModel:
    config: dict[str, Any]  # HuggingFace config.json
    params: Any
    history: list[tuple[float, float]]
    seconds: float


def train_model(out: Path, corpus: Corpus, settings: TrainSettings) -> tuple[HFTokenizer, TrainedModel]:
    """Train and save the tokenizer, then train the model in memory."""
    tokenizer = train_tokenizer([text for _, text in corpus.train], settings.vocab_size)
    save_tokenizer(tokenizer, out, settings.seq_len)
    config = hf_config(tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN), settings.seq_len)
    cfg = parse_hf_config(config)
    stream = encode_documents(tokenizer, [text for _, text in corpus.train])
    params = hf_init_params(cfg, settings.seed, config["initializer_range"])
    params, history, seconds = train(cfg, params, windows(stream, settings.seq_len), settings)
    return tokenizer, TrainedModel(config, params, history, seconds)


def _roundtrip_error(out: Path, trained: TrainedModel, tokens: np.ndarray) -> float:
    """Max logit difference between the saved checkpoint (through `load_model`) and the in-memory params."""
    expected = model_outputs(parse_hf_config(trained.config), trained.params, tokens)
    model = load_model(out)
    actual = model_outputs(model.config, model.params, tokens)
    actual["logits"] = np.asarray(model(tokens))
    return max(float(np.abs(actual[k] - expected[k]).max()) for k in expected)


def _samples(out: Path) -> list[tuple[str, str]]:
    llm = LLM(out, num_blocks=256, num_state_slots=16)
    outputs = llm.generate(list(SAMPLE_PROMPTS), SamplingParams(temperature=0, max_tokens=SAMPLE_TOKENS),
                           use_tqdm=False)
    return [(prompt, output.outputs[0].text) for prompt, output in zip(SAMPLE_PROMPTS, outputs, strict=True)]


def package(out: Path, tokenizer: HFTokenizer, corpus: Corpus, trained: TrainedModel,
            settings: TrainSettings) -> HeldOutMetrics:
    """Export the checkpoint, record reference logits, evaluate, sample, and write the card and plot."""
    cfg = parse_hf_config(trained.config)
    export_hf_checkpoint(trained.params, trained.config, out)
    train_stream = encode_documents(tokenizer, [text for _, text in corpus.train])
    held_out = encode_documents(tokenizer, [text for _, text in corpus.held_out])
    save_reference(cfg, trained.params, held_out, out)
    error = _roundtrip_error(out, trained, held_out[None, :NUM_REFERENCE_TOKENS])
    metrics = evaluate(cfg, trained.params, windows(held_out, settings.seq_len), train_stream)
    record = TrainingRecord(
        settings=settings, history=trained.history, seconds=trained.seconds, num_train_files=len(corpus.train),
        num_train_tokens=len(train_stream), num_params=sum(p.size for p in jax.tree_util.tree_leaves(trained.params)),
        checkpoint_bytes=(out / "model.safetensors").stat().st_size, roundtrip_error=error,
    )
    plot_loss_curve(trained.history, out / "loss_curve.png")
    (out / "MODEL_CARD.md").write_text(model_card(record, metrics, _samples(out)))
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the checkpoint")
    parser.add_argument("--steps", type=int, default=TrainSettings.num_steps, help="training steps")
    parser.add_argument("--seed", type=int, default=TrainSettings.seed)
    args = parser.parse_args(argv)
    # Read when the CPU backend starts, i.e. at the first computation below.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_SINGLE_THREAD_XLA}".strip()
    settings = dataclasses.replace(TrainSettings(), num_steps=args.steps, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = gather_corpus()
    tokenizer, trained = train_model(args.out, corpus, settings)
    metrics = package(args.out, tokenizer, corpus, trained, settings)
    sys.stdout.write(f"held-out perplexity {metrics.perplexity:.2f} (unigram {metrics.unigram_perplexity:.1f}), "
                     f"MTP top-1 {metrics.mtp_accuracy:.1%}; wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
