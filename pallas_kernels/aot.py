"""Compile Pallas kernels for an H100/H200 on a machine without a GPU and read back each kernel's resources.

Deviceless AOT (docs/kernels.md#compile-check-without-a-gpu): with the CUDA plugin installed and `JAX_PLATFORMS=cpu
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, a GPU described by XLA's GpuTargetConfigProto text gives a topology whose
devices jit can compile for. XLA's whole GPU pipeline runs (Triton, LLVM, PTX for sm_90a, ptxas), so a kernel
that does not compile here does not compile on the GPU. The compile dumps each module's PTX and thunk
sequence; `ptxas -v` on the PTX gives registers, spills and stack per kernel, the thunk sequence gives each
launch's grid, threads and shared memory. `KernelRecord.problems` is the pass/fail rule.

Without a `target` the same check compiles for this host's GPU (`benchmarks/tune_kernels.py` on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from pallas_kernels import tuning

MAX_SHARED_MEMORY = 232_448  # bytes per block, sm_90 opt-in
MAX_REGISTERS = 255  # per thread
REGISTER_FILE = 65_536  # 32-bit registers per block (and per SM)

# GpuTargetConfigProto text, the subset jaxlib 0.12 reads, with the values of XLA's
# xla/backends/gpu/target_config/specs/{h100_sxm,h200}.txtpb.
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{kind}"
"""
DEVICE_KINDS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}  # jax's device_kind on each
DEVICE_MEMORY = {"h100": 84942979072, "h200": 151397597184}  # bytes of HBM
TARGETS = {
    "h100": _TARGET.format(bandwidth=3352320000000, memory=DEVICE_MEMORY["h100"], kind=DEVICE_KINDS["h100"]),
    "h200": _TARGET.format(bandwidth=4800000000000, memory=DEVICE_MEMORY["h200"], kind=DEVICE_KINDS["h200"]),
}


class KernelRecord(NamedTuple):
    """One Pallas kernel of a compiled module: what ptxas and the launch say about it."""

    name: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared_memory: int  # bytes per block at launch (Triton kernels have no static shared memory)
    threads: int  # per block
    grid: tuple[int, ...]

    def problems(self) -> list[str]:
        """Why this kernel must not ship: spills (local-memory traffic in the hot loop), more registers than a
        thread or the block's register file has, or more shared memory than a block may opt into."""
        found = []
        if self.spill_stores or self.spill_loads:
            found.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.registers > MAX_REGISTERS:
            found.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.registers * self.threads > REGISTER_FILE:
            found.append(f"{self.registers} registers x {self.threads} threads > {REGISTER_FILE}")
        if self.shared_memory > MAX_SHARED_MEMORY:
            found.append(f"shared memory {self.shared_memory} B > {MAX_SHARED_MEMORY}")
        return found

    def summary(self) -> str:
        grid = "x".join(map(str, self.grid))
        return (f"regs {self.registers:3d}  spill {self.spill_stores}/{self.spill_loads} B  stack {self.stack} B  "
                f"smem {self.shared_memory:6d} B ({100 * self.shared_memory / MAX_SHARED_MEMORY:3.0f}%)  "
                f"threads {self.threads}  grid {grid}")


_FUNCTION = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads")
_USED = re.compile(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", re.S)
_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")
_PALLAS_CALL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*\bname = "(\w+)"')


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """`ptxas -v` output -> {entry function: registers, spill_stores, spill_loads, stack}."""
    found: dict[str, dict[str, int]] = {}
    for name, stack, stores, loads in _FUNCTION.findall(text):
        found.setdefault(name, {}).update(stack=int(stack), spill_stores=int(stores), spill_loads=int(loads))
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        match = _USED.search(block)
        if match:
            found.setdefault(match[1], {})["registers"] = int(match[2])
    return found


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def parse_thunks(text: str) -> dict[str, dict]:
    """A `*.thunk_sequence.txt` -> {kernel: grid, threads (per block), shared_memory (bytes)} per kernel launch."""
    launches = {}
    for name, grid, threads, shared in _THUNK.findall(text):
        launches[name] = dict(grid=_dims(grid), threads=math.prod(_dims(threads)), shared_memory=int(shared))
    return launches


def pallas_kernels(hlo: str) -> list[str]:
    """Kernel names of the Pallas (Triton custom call) launches in an optimised HLO module's text; XLA's own
    fusions, Triton ones included, are not ours to check."""
    return list(dict.fromkeys(match[1] for line in hlo.splitlines() if (match := _PALLAS_CALL.search(line))))


def records(pallas: Sequence[str], ptxas_info: dict[str, dict], launches: dict[str, dict]) -> list[KernelRecord]:
    """One record per Pallas kernel from what ptxas and the thunk sequence said about it."""
    return [KernelRecord(name=name, **ptxas_info[name], **launches[name]) for name in pallas]


def ptxas() -> str:
    """The ptxas XLA uses (nvidia-cuda-nvcc-cu12's), else one on PATH."""
    try:
        import nvidia.cuda_nvcc  # noqa: PLC0415 - only present in a CUDA venv

        bundled = Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin" / "ptxas"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("ptxas")
    if found is None:
        raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (or jax[cuda12])")
    return found


@functools.cache
def topology_mesh(target: str, devices: int = 1, axis: str = "aot") -> jax.sharding.Mesh:
    """A mesh of `devices` GPUs of one host on a topology described by TARGETS[target] (needs the CUDA plugin,
    no GPU): "1x1x4" is 1 slice x 1 host x 4 devices."""
    from jax.experimental import topologies  # noqa: PLC0415 - loads the CUDA plugin's topology support

    found = topologies.get_topology_desc("", platform="cuda", target_config=TARGETS[target],
                                         topology=f"1x1x{devices}").devices
    return jax.sharding.Mesh(np.array(found[:devices]), (axis,))


@contextlib.contextmanager
def lowering_for(target: str, mesh: jax.sharding.Mesh) -> Iterator[None]:
    """Inside the block jit lowers for `target` on `mesh` (a `topology_mesh`): Pallas reads the GPU it lowers
    for from the abstract mesh; the ops read their launch parameters for it."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tuning.compiling_for(DEVICE_KINDS[target]):
        yield


def _lower(fn: Callable, specs: Sequence[jax.ShapeDtypeStruct], target: str | None) -> jax.stages.Lowered:
    fn = functools.partial(fn)  # a new callable: jit's trace cache, keyed by it, must not skip the ops' launch choice
    if target is None:
        return jax.jit(fn).trace(*specs).lower()
    mesh = topology_mesh(target)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated) for s in specs]
    with lowering_for(target, mesh):
        return jax.jit(fn).trace(*specs).lower()


# H100 and H200 are both sm_90a: a module whose lowering is the same for both compiles to the same kernels
_compiled: dict[str, list[KernelRecord]] = {}


def compile_kernels(fn: Callable, specs: Sequence[jax.ShapeDtypeStruct], target: str | None) -> list[KernelRecord]:
    """Compile `fn(*specs)` for `target` (a TARGETS key; None: this host's GPU) and return a record per Pallas
    kernel in it. Compile errors raise, as they would on the GPU."""
    lowered = _lower(fn, specs, target)
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest() if target else None
    if key in _compiled:
        return _compiled[key]
    with tempfile.TemporaryDirectory(prefix="aot-") as dump, _without_persistent_cache():
        lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"})
        found = _read_dump(Path(dump))
    if key:
        _compiled[key] = found
    return found


@contextlib.contextmanager
def _without_persistent_cache() -> Iterator[None]:
    """A module the persistent compilation cache answers is not compiled, so nothing would be dumped."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def _read_dump(folder: Path) -> list[KernelRecord]:
    hlo = "\n".join(p.read_text() for p in folder.glob("*gpu_after_optimizations.txt"))
    if not hlo:
        raise RuntimeError(f"the compile dumped no optimised HLO into {folder}")
    names = pallas_kernels(hlo)
    launches, info = {}, {}
    for path in folder.glob("*.thunk_sequence.txt"):
        launches.update(parse_thunks(path.read_text()))
    for path in folder.glob("*.ptx"):
        text = path.read_text()
        if any(f".entry {name}(" in text for name in names):
            info.update(_ptxas_info(path))
    return records(names, info, launches)


def _ptxas_info(ptx: Path) -> dict[str, dict[str, int]]:
    """ptxas -v on one PTX file, with the architecture and ptxas XLA compiled it with."""
    done = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull], check=True,
                          capture_output=True, text=True)
    return parse_ptxas(done.stdout + done.stderr)
