"""bf16 matmuls (`x @ w`, f32 accumulation, rounded once): the model's projections. XLA's dot runs them on every
platform; on CPU the C++ FFI kernel (`pallas_kernels.matmul.cpu`) takes them on weights packed at load, which
stream from memory at its speed where a decode step's projection is the read of its weight. `reference.matmul`
is the kernel's pure-JAX oracle.
"""

from pallas_kernels.matmul import cpu, reference

__all__ = ["cpu", "reference"]
