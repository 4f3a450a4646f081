"""The CPU FFI kernels' one shared library: built from the ops' C++ sources on first use, cached by everything
the binary depends on, and its handlers registered with XLA once per process (docs/kernels.md#cpu-ffi-kernels).

Why at first use rather than at install: the package installs as pure Python (no compiler needed to install or to
run the reference path), and the library depends on what only the running process knows: the XLA FFI headers of
the jaxlib it imports (`jax.ffi.include_dir()`) and, built with -march=native, the CPU it runs on. The cache key
hashes both with the sources, flags and compiler, so a new jaxlib, CPU or source builds a fresh library once (a
few seconds) and every later process loads it.

Cache: `$JAXHYBRID_FFI_CACHE` or ~/.cache/jaxhybrid/ffi, one folder per key. A file lock serialises concurrent
processes: the first builds, the others wait and load its result. The compiler: `$JAXHYBRID_CXX`, else `$CXX`,
else g++.

Call `available()` before any other thread compiles or loads an XLA executable: XLA's FFI handler registry is a
plain hash map, and registering into it while another thread looks a handler up (compiling, or reading the
persistent compilation cache) can crash the process. The engine does it where it builds the model
(`jaxhybrid.models.ops.ModelOps`), before its compile threads start; a kernel called from a trace only reads the
result.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# the ops' sources, built into one library, and the handlers it exports: XLA target name -> symbol
SOURCES = (HERE / "gdn" / "cpu" / "gdn.cc", HERE / "mamba2" / "cpu" / "ssd.cc", HERE / "moe" / "cpu" / "experts.cc",
           HERE / "matmul" / "cpu" / "matmul.cc")
HEADERS = (HERE / "cpu_ffi.h", HERE / "bf16_gemm.h")
LIBRARY = "libjaxhybrid_cpu.so"
TARGETS = {
    "jaxhybrid_gdn_decode": "JaxhybridGdnDecode",
    "jaxhybrid_gdn_prefill": "JaxhybridGdnPrefill",
    "jaxhybrid_gdn_verify": "JaxhybridGdnVerify",
    "jaxhybrid_ssd_decode": "JaxhybridSsdDecode",
    "jaxhybrid_ssd_prefill": "JaxhybridSsdPrefill",
    "jaxhybrid_ssd_verify": "JaxhybridSsdVerify",
    "jaxhybrid_routed_experts": "JaxhybridRoutedExperts",
    "jaxhybrid_bf16_matmul": "JaxhybridBf16Matmul",
}

CACHE_ENV = "JAXHYBRID_FFI_CACHE"
COMPILER_ENV = "JAXHYBRID_CXX"
# -ffp-contract=off: no fused multiply-adds the source does not write, so one expression rounds alike in every
# loop that evaluates it (the kernels rely on it for ReplaySSM's bit-identity with plain decoding).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared", "-pthread")
BUILD_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The library could not be built: no compiler, or it rejected the source."""


def compiler() -> str:
    return os.environ.get(COMPILER_ENV) or os.environ.get("CXX") or "g++"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxhybrid" / "ffi")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("flags", "model name", "vendor_id"))}))
    return f"{platform.machine()} {platform.processor()}"


def _compiler_identity(cxx: str) -> str:
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler {cxx!r} on PATH")
    result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise BuildError(f"{cxx} --version failed: {result.stderr.strip()[:200]}")
    return f"{shutil.which(cxx)}\n{result.stdout}"


def cache_key(sources: tuple[Path, ...], cxx: str) -> str:
    parts = (*(path.read_bytes().decode() for path in sources), " ".join(FLAGS), _compiler_identity(cxx),
             jax.__version__, jaxlib.__version__, jax.ffi.include_dir(), _cpu_identity())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl  # POSIX only: elsewhere the ImportError makes the kernels unavailable

    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_library() -> Path:
    """The shared library built from SOURCES, compiled now unless the cache holds it; raises BuildError."""
    cxx = compiler()
    directory = cache_root() / cache_key(SOURCES + HEADERS, cxx)
    library = directory / LIBRARY
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / ".lock"):
        if library.is_file():  # another process built it while this one waited
            return library
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            partial = Path(scratch) / LIBRARY
            command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}", *map(str, SOURCES), "-o", str(partial)]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise BuildError(f"{cxx} failed to run: {error}") from error
            if result.returncode != 0:
                raise BuildError(f"{cxx} failed on the CPU kernels: {result.stderr.strip()[-2000:]}")
            os.replace(partial, library)  # atomic: a reader never sees half a library
    return library


@functools.cache
def _register(library: Path) -> None:
    """Register the handlers of `library` with XLA (once per process: a target name registers once)."""
    handlers = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handlers, symbol)), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernels are built and registered; else why they are not (logged once, as a warning)."""
    try:
        _register(build_library())
    except (BuildError, OSError, ImportError, AttributeError, subprocess.SubprocessError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("CPU FFI kernels unavailable (%s): the pure-JAX reference runs", reason)
        return reason
    return None


def available() -> bool:
    """Whether the FFI kernels run (built and registered on the first call)."""
    return unavailable_reason() is None


def runs_kernel(*pools: jax.Array) -> bool:
    """Whether an op on these pools runs its kernel: the kernels read and write f32 pools, else the reference."""
    return all(pool.dtype == jax.numpy.float32 for pool in pools) and available()


def result_like(x: jax.Array) -> jax.ShapeDtypeStruct:
    """An FFI result of `x`'s shape and dtype (a pool the kernel updates in place)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
