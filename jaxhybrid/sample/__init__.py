"""Sampling: `SamplingParams` and the on-device sampler (penalties, top-k/p, logprobs, MTP verification)."""
