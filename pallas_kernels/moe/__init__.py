"""Routed (mixture-of-experts) MLPs: each token through its top-k experts, weighted and summed.

The engine's XLA path lays the routed rows out in static shapes (`jaxhybrid.models.experts`); on CPU the C++ FFI
kernel (`pallas_kernels.moe.cpu`) multiplies each expert's routed rows exactly. `reference.routed_experts` is the
kernel's pure-JAX oracle: the XLA path's computation and roundings, one assignment at a time.
"""

from pallas_kernels.moe import cpu, reference

__all__ = ["cpu", "reference"]
