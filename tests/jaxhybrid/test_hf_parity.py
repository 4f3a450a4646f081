"""Logits of `load_model` match HuggingFace transformers on the committed fixtures (float32).

PyTorch and XLA order their sums differently (and HF runs GDN/SSD token by token or in its own chunks),
so the logits agree to float32 rounding of `model_depth` (tests/tolerances.py) at the case's length.
"""

import numpy as np
import pytest

from tests.hf_fixtures import FAMILIES, HF_FIXTURES, fixture_model
from tests.tolerances import assert_float32_close, model_depth


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    model = fixture_model(family)
    reference = np.load(HF_FIXTURES / family / "reference.npz")
    cases = [key.removeprefix("tokens_") for key in reference if key.startswith("tokens_")]
    assert len(cases) >= 3
    for case in cases:
        logits = np.asarray(model(reference[f"tokens_{case}"]))
        expected = reference[f"logits_{case}"]
        depth = model_depth(model.config, expected.shape[-2])
        assert_float32_close(logits, expected, depth, f"{family} {case}")
