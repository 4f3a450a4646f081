"""Reference outputs of the trained params, recorded beside the checkpoint so CI can check the shipped files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.tiny.train import forward

REFERENCE_FILE = "reference_logits.npz"
NUM_REFERENCE_TOKENS = 16  # a multiple of the KV block size; keeps the file at ~0.5 MB


def model_outputs(cfg: ModelConfig, params: Any, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """tokens [1, N] -> {"logits", "mtp_logits"}: [1, N, V] f32 each, through the inference ops."""
    logits, mtp_logits = jax.jit(lambda p, t: forward(HybridLM(cfg), p, t))(params, tokens)
    return {"logits": np.asarray(logits), "mtp_logits": np.asarray(mtp_logits)}


def save_reference(cfg: ModelConfig, params: Any, stream: np.ndarray, directory: Path) -> None:
    """Record the outputs of the in-memory params on the first tokens of `stream` (held-out text)."""
    tokens = stream[None, :NUM_REFERENCE_TOKENS].astype(np.int32)
    np.savez(directory / REFERENCE_FILE, tokens=tokens, **model_outputs(cfg, params, tokens))
