"""Float tolerances derived from rounding, not guessed. Every float comparison in the suite uses these.

Two computations of the same maths in float32 that differ only in evaluation order (a chunked WY form
against a token recurrence, a Pallas kernel against its XLA reference, our model against PyTorch) each
carry rounding error. Higham's bound for a sum or dot product of n terms is |error| <= n u sum|terms|,
u = 2^-24 the float32 unit roundoff, and a contracting recurrence (decays <= 1, as in GDN, Mamba2 and the
conv window) adds at most one such error per step without amplifying the earlier ones. So along the
longest chain of dependent roundings, of length `depth` (the terms of every sum on the way plus the
recurrent steps), each result is within depth * u * scale of the exact value and the two computations
within twice that, `scale` being the magnitude of the values compared (sum|terms| ~ |result| for the
random, sign-mixed test data: the worst-case n of the bound overcounts by about the sqrt(n) that
cancellation gains back).

bf16 inputs against a float32 reference on the unrounded values: each bf16 factor of a product is off by
at most u_bf16 = 2^-8 relative, a product of `degree` such factors by degree * u_bf16, and a bf16 output
adds one more rounding. The float32 accumulation inside is far below that.
"""

from typing import NamedTuple

import numpy as np

U_FLOAT32 = 2.0**-24
U_BFLOAT16 = 2.0**-8


def float32_atol(depth: int, scale: float) -> float:
    """|a - b| bound for two float32 evaluation orders `depth` roundings deep, values of size `scale`."""
    return 2 * depth * U_FLOAT32 * max(float(scale), 1.0)


def bfloat16_atol(degree: int, scale: float) -> float:
    """|a - b| bound for a product of `degree` bf16-rounded factors, stored in bf16, values of size `scale`."""
    return (degree + 1) * U_BFLOAT16 * max(float(scale), 1.0)


def assert_close(actual, expected, atol: float, what: str = "") -> None:
    """max |actual - expected| <= atol, with the error and the bound in the message (NaN fails)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what} shape {actual.shape} != {expected.shape}"
    error = np.abs(actual - expected)
    worst = float(np.nanmax(error)) if error.size else 0.0
    assert not np.isnan(error).any() and worst <= atol, f"{what} max abs error {worst:.3e} > bound {atol:.3e}"


def assert_float32_close(actual, expected, depth: int, what: str = "") -> None:
    """`assert_close` with `float32_atol(depth, max|expected|)`."""
    scale = np.abs(np.asarray(expected, np.float64)).max(initial=0.0)
    assert_close(actual, expected, float32_atol(depth, scale), what)


def assert_bfloat16_close(actual, expected, degree: int, what: str = "") -> None:
    """`assert_close` with `bfloat16_atol(degree, max|expected|)`."""
    scale = np.abs(np.asarray(expected, np.float64)).max(initial=0.0)
    assert_close(actual, expected, bfloat16_atol(degree, scale), what)


def model_depth(config, steps: int) -> int:
    """Rounding depth of a logit after `steps` positions of a hybrid model (a `ModelConfig`).

    Every mixer or MLP on the way sums over at most `steps` positions (a recurrence or a softmax) and over
    its widest projection going in and coming out; the LM head sums over the hidden size.
    """
    widths = [config.hidden_size, config.intermediate_size]
    if config.gdn:
        widths += [config.gdn.num_v_heads * config.gdn.head_v_dim]
    if config.mamba2:
        widths += [config.mamba2.num_heads * config.mamba2.head_dim]
    if config.moe:
        widths += [config.moe.intermediate_size, config.moe.shared_intermediate_size]
    sublayers = sum(len(block) for block in config.layers)
    return sublayers * (steps + 2 * max(widths)) + config.hidden_size


class Float32(NamedTuple):
    """Two float32 evaluation orders `depth` roundings deep (see the module docstring)."""

    depth: int

    def check(self, actual, expected, what: str = "") -> None:
        assert_float32_close(actual, expected, self.depth, what)


class BFloat16(NamedTuple):
    """bf16-rounded inputs, `degree` of them per product, against float32 on the unrounded values."""

    degree: int

    def check(self, actual, expected, what: str = "") -> None:
        assert_bfloat16_close(actual, expected, self.degree, what)
