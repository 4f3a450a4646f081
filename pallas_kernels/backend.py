"""Which implementation of an op runs: its Pallas kernel on GPU, the pure-JAX reference elsewhere."""

import jax


def resolve_backend(backend: str | None, has_pallas: bool = True) -> str:
    """None -> "pallas" on GPU (when the op has a kernel), else "reference"."""
    if backend is None:
        return "pallas" if has_pallas and jax.default_backend() == "gpu" else "reference"
    allowed = ("reference", "pallas", "interpret") if has_pallas else ("reference",)
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    return backend
