"""The kernel ops a model is built from, as one frozen value: tests and training swap implementations
by passing another `ModelOps`, never by patching module globals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import causal_conv1d
from pallas_kernels.gdn import gdn_chunked, gdn_recurrent
from pallas_kernels.mamba2 import ssd_chunked, ssd_recurrent


def _ssd_recurrent(*args, chunk_size: int):
    del chunk_size  # the token recurrence has no chunks
    return ssd_recurrent(*args)


@dataclass(frozen=True)
class ModelOps:
    conv1d: Callable = causal_conv1d  # (x, weight, bias, cu_seqlens, window) -> (y, window)
    gdn: Callable = gdn_chunked  # (q, k, v, g, beta, cu_seqlens, state) -> (o, state)
    ssd: Callable = ssd_chunked  # (x, dt, A, B, C, D, cu_seqlens, state, *, chunk_size) -> (y, state)
    attention: Callable = ragged_paged_attention  # see pallas_kernels.attention


CHUNKED = ModelOps()
RECURRENT = ModelOps(gdn=gdn_recurrent, ssd=_ssd_recurrent)  # token by token: the decode path's maths
