"""Single-sequence generation with a `Model`: one prefill call, then one-token decode steps.

`python -m jaxhybrid.generate --prompt "def read_config(path):"` runs the embedded default model.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.model import Model, contiguous_batch, length_bucket


def _pick(logits: jax.Array, temperature: float, rng: np.random.Generator) -> int:
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    probs = np.exp((logits - logits.max()) / temperature)
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def generate(model: Model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             stop_ids: tuple[int, ...] = (), seed: int = 0) -> list[int]:
    """Sample up to `max_new_tokens` after `prompt_ids`; greedy when temperature is 0."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    rng, bs = np.random.default_rng(seed), model.block_size
    max_blocks = -(-(len(prompt_ids) + max_new_tokens) // bs)
    cache = model.init_cache(1, max_blocks * bs)
    tokens = np.zeros(length_bucket(len(prompt_ids)), np.int32)
    tokens[: len(prompt_ids)] = prompt_ids
    batch = contiguous_batch([len(prompt_ids)], [0], bs, max_blocks, num_tokens=len(tokens))
    logits, _, cache = model.step(jnp.asarray(tokens), batch, cache)
    out = [_pick(logits[len(prompt_ids) - 1], temperature, rng)]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        batch = contiguous_batch([1], [len(prompt_ids) + len(out) - 1], bs, max_blocks)
        logits, _, cache = model.step(jnp.asarray([out[-1]], jnp.int32), batch, cache)
        out.append(_pick(logits[0], temperature, rng))
    return out


def main(argv: list[str] | None = None) -> int:
    from jaxhybrid.tokenizer import Tokenizer
    from jaxhybrid.weights import DEFAULT_MODEL_DIR, load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint directory")
    parser.add_argument("--prompt", default="def read_config(path):")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    tokenizer = Tokenizer.from_pretrained(args.model)
    eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    ids = generate(model, tokenizer.encode(args.prompt), args.max_tokens, temperature=args.temperature,
                   stop_ids=eos, seed=args.seed)
    sys.stdout.write(args.prompt + tokenizer.decode(ids) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
