"""Speculative decoding inside the step: MTP drafting (verification is the sampler's)."""
