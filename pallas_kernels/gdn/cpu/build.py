"""Compile a C++ FFI source into a shared library on first use, cached by everything the binary depends on.

Why at first use rather than at install: the package installs as pure Python (no compiler needed to install or to
run the reference path), and the library depends on what only the running process knows: the XLA FFI headers of
the jaxlib it imports (`jax.ffi.include_dir()`) and, built with -march=native, the CPU it runs on. The cache key
hashes both with the source, flags and compiler, so a new jaxlib, CPU or source builds a fresh library once (a
few seconds) and every later process loads it.

Cache: `$JAXHYBRID_FFI_CACHE` or ~/.cache/jaxhybrid/ffi, one folder per key. A file lock serialises concurrent
processes: the first builds, the others wait and load its result. The compiler: `$JAXHYBRID_CXX`, else `$CXX`,
else g++.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jaxlib

CACHE_ENV = "JAXHYBRID_FFI_CACHE"
COMPILER_ENV = "JAXHYBRID_CXX"
# -ffp-contract=off: no fused multiply-adds the source does not write, so one expression rounds alike in every
# loop that evaluates it (gdn.cc relies on it for ReplaySSM's bit-identity with plain decoding).
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


def cache_key(source: Path, cxx: str) -> str:
    parts = (source.read_bytes().decode(), " ".join(FLAGS), _compiler_identity(cxx), jax.__version__,
             jaxlib.__version__, jax.ffi.include_dir(), _cpu_identity())
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


def build_library(source: Path, name: str) -> Path:
    """The shared library `name` built from `source`, compiled now unless the cache holds it; raises BuildError."""
    cxx = compiler()
    directory = cache_root() / cache_key(source, cxx)
    library = directory / name
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / ".lock"):
        if library.is_file():  # another process built it while this one waited
            return library
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            partial = Path(scratch) / name
            command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(partial)]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise BuildError(f"{cxx} failed to run: {error}") from error
            if result.returncode != 0:
                raise BuildError(f"{cxx} failed on {source.name}: {result.stderr.strip()[-2000:]}")
            os.replace(partial, library)  # atomic: a reader never sees half a library
    return library
