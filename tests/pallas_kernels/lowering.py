"""Lower a function for CUDA on the CPU machine (docs/kernels.md#tests) and return the StableHLO text."""

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args) -> str:
    """`args` are arrays or ShapeDtypeStructs; the lowering targets an abstract H200 (sm90)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
