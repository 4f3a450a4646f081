"""The kernel backend and the swappable ops a model is built from, as one frozen value: tests and
training swap implementations by passing another `ModelOps`, never by patching module globals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxhybrid.models import tensor_parallel
from jaxhybrid.models.pools import AUTO_CACHE, CacheDtypes
from jaxhybrid.models.tensor_parallel import AXIS, MixerConfig
from pallas_kernels import cpu_ffi
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.backend import resolve_backend
from pallas_kernels.gdn import gdn_prefill

CPU_KERNELS = ("auto", "ffi", "reference")


@dataclass(frozen=True)
class ModelOps:
    # every pool op's backend: "reference" (XLA), "pallas" (Triton) or "interpret" (the Pallas kernels on CPU,
    # for tests); None picks pallas on GPU and reference elsewhere
    backend: str | None = None
    attention: Callable = ragged_paged_attention  # see pallas_kernels.attention
    gdn_prefill: Callable = gdn_prefill  # see pallas_kernels.gdn (training swaps in a fresh-rows form)
    # tensor parallel: the mixers run on their local heads in shard_map over this mesh's "tp" axis
    # (jaxhybrid.models.tensor_parallel); None: one device, no shard_map
    mesh: Mesh | None = None
    # each segment of repeating layers (models/stack.py) compiles as one scan over its repeats; off, every
    # repeat is its own copy in the program (same bits; for XLA's cost analysis, which counts a loop's body once,
    # and on CPU, where the engine's unrolled step reads each layer's weights in place: `stack.flatten_params`)
    scan_layers: bool = True
    # what the pools store (--kv-cache-dtype, --mamba-ssm-cache-dtype) and the fp8 KV pools' scales
    cache: CacheDtypes = AUTO_CACHE
    # where the GDN and Mamba2 prefill/decode/verify ops and, with unrolled layers, the bf16 matmuls
    # (`cpu_matmuls`) would run the reference (XLA) on CPU (--cpu-kernels): "ffi" the C++ kernels
    # (pallas_kernels/cpu_ffi.py; fails here where they cannot be built), "auto" those where they build (else the
    # reference, with one warning), "reference" the reference
    cpu_kernels: str = "reference"

    def __post_init__(self) -> None:
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernels!r}")
        # built and registered here, on the thread that builds the model: XLA's handler registry has no lock,
        # so registering from a step's trace (a background compile thread) could race another thread's compile
        wants_ffi = self.cpu_kernels != "reference" and self._reference_on_cpu()
        if wants_ffi and not cpu_ffi.available() and self.cpu_kernels == "ffi":
            raise RuntimeError(f"cpu_kernels='ffi': the CPU FFI kernels cannot be built "
                               f"({cpu_ffi.unavailable_reason()})")

    def _reference_on_cpu(self) -> bool:
        return resolve_backend(self.backend) == "reference" and jax.default_backend() == "cpu"

    def state_backend(self) -> str | None:
        """The backend of the recurrent mixers' prefill, decode and verify ops: "ffi" where `cpu_kernels` puts the
        C++ kernels in place of the CPU reference, else `backend`."""
        if self.cpu_kernels == "reference" or not self._reference_on_cpu():
            return self.backend
        return "ffi" if cpu_ffi.available() else self.backend

    def cpu_matmuls(self) -> bool:
        """Whether bf16 matmuls run the CPU FFI kernels: where the recurrent ops run the C++ kernels, on one device
        (the kernels have no sharding rule), with the layers unrolled. The runner then packs the matmul weights
        (`pallas_kernels.matmul.cpu.packed_params`), and the projections and routed experts on them run the
        kernels. Under a layer scan a custom call would take a copy of each layer's weights out of their stack
        every step, which cost more than the kernels save at batch 1 (docs/kernels.md#bf16-matmuls-on-cpu)."""
        return self.state_backend() == "ffi" and self.mesh is None and not self.scan_layers

    def platform(self) -> str:
        """The platform the step is compiled for: "gpu" with the Triton kernels (also when compiling for a GPU
        on a host without one, `benchmarks/aot_step.py`), else the default backend's."""
        return "gpu" if resolve_backend(self.backend) == "pallas" else jax.default_backend()

    def compiler_options(self) -> dict[str, bool]:
        """XLA options for the step. On the GPU a scanned layer's weights are one entry of a stacked array:
        cuBLAS GEMMs read that entry in place (dynamic-slice fusion), where Triton GEMM fusions would first copy
        it out, every layer of every step."""
        if self.platform() != "gpu" or not self.scan_layers:
            return {}
        return {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}

    def local_heads(self, mixer: MixerConfig) -> tuple[MixerConfig, str | None]:
        """The mixer's config on one device's heads, and the mesh axis its head axes split over (None: not
        split, without a mesh or where tp does not divide its heads)."""
        shards = 1 if self.mesh is None else tensor_parallel.head_shards(mixer, self.mesh.shape[AXIS])
        return tensor_parallel.local_heads(mixer, shards), AXIS if shards > 1 else None

    def on_local_heads(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """`fn` run on each device's shards of its arguments (the specs name the "tp" axis where they split,
        `jax.shard_map`); `fn` itself without a mesh. The kernels inside read and write only local heads."""
        if self.mesh is None:
            return fn
        # check_vma=False: pallas_call has no replication rule (tpu-inference and maxtext wrap kernels so too)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


DEFAULT_OPS = ModelOps()
