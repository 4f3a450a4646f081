"""The committed HuggingFace reference checkpoints (made by tests/fixtures/make_hf_reference.py)."""

from __future__ import annotations

import functools
from pathlib import Path

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "nemotron_h")


@functools.cache
def fixture_model(family: str):
    """The fixture checkpoint loaded once per test session (float32)."""
    import jaxhybrid

    return jaxhybrid.load_model(HF_FIXTURES / family)
