"""Logits of `load_model` match HuggingFace transformers on the committed fixtures (float32)."""

import numpy as np
import pytest

from tests.hf_fixtures import FAMILIES, HF_FIXTURES, fixture_model

TOLERANCE = 2e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    model = fixture_model(family)
    reference = np.load(HF_FIXTURES / family / "reference.npz")
    cases = [key.removeprefix("tokens_") for key in reference if key.startswith("tokens_")]
    assert len(cases) >= 3
    for case in cases:
        logits = np.asarray(model(reference[f"tokens_{case}"]))
        expected = reference[f"logits_{case}"]
        error = np.abs(logits - expected).max()
        assert error <= TOLERANCE, f"{family} {case}: max abs error {error:.2e}"
