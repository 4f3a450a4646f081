"""The kernel backend and the swappable ops a model is built from, as one frozen value: tests and
training swap implementations by passing another `ModelOps`, never by patching module globals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.gdn import gdn_prefill


@dataclass(frozen=True)
class ModelOps:
    # every pool op's backend: "reference" (XLA), "pallas" (Triton) or "interpret" (the Pallas kernels on CPU,
    # for tests); None picks pallas on GPU and reference elsewhere
    backend: str | None = None
    attention: Callable = ragged_paged_attention  # see pallas_kernels.attention
    gdn_prefill: Callable = gdn_prefill  # see pallas_kernels.gdn (training swaps in a fresh-rows form)


DEFAULT_OPS = ModelOps()
