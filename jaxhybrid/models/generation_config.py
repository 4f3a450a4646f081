"""A checkpoint's `generation_config.json` (vLLM's `--generation-config auto`): its eos ids join the
model's, and its sampling settings are the defaults of requests that leave them unset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json name -> SamplingParams name (the fields vLLM takes from it)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """The file's settings; {} where the checkpoint has none."""
    path = Path(directory) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields the checkpoint sets, by our (vLLM's) names."""
    return {ours: generation_config[theirs] for theirs, ours in SAMPLING_FIELDS.items()
            if generation_config.get(theirs) is not None}
