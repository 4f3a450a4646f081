"""Test-session settings."""

import atexit
import gc
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Engines with equal configs compile equal steps (the greedy matrix runs each setting serially and one step
# ahead): a session-wide persistent cache, empty at the start, compiles each once. Subprocesses inherit it.
_CACHE = tempfile.mkdtemp(prefix="jaxhybrid-test-compiles-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
for _name, _value in (("JAX_COMPILATION_CACHE_DIR", _CACHE), ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                      ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")):
    os.environ.setdefault(_name, _value)

# Two cores on CI: one XLA compute thread per process keeps compile and run times predictable.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
# Compiling is most of the suite's time and the tests' models are tiny: LLVM's optimisations cost more time
# than they save. XLA's HLO passes (fusion) are unchanged; code generation rounds differently, within float
# error, on both sides of every comparison. Subprocesses inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# CI explores nothing new: the same examples on every clean checkout, no example database, and a failure
# prints the blob that reproduces it; no verdict depends on how fast a loaded machine runs an example.
# Locally hypothesis keeps exploring; pin what it finds with @example.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# XLA's FFI handler registry has no lock: each test process registers the CPU FFI kernels once, here, before any
# test compiles on another thread (a server's background compile) that registering could race.
import jax  # noqa: E402  (after the environment above)

from pallas_kernels import cpu_ffi as _cpu_ffi  # noqa: E402

_cpu_ffi.available()


# Every loaded XLA:CPU executable maps each of its kernels into memory (about 1,450 maps for a tiny model's step),
# and Linux allows 65,530 maps per process (vm.max_map_count): past it the next compile or cache read dies with
# SIGSEGV. A test process runs many files' engines, so each file's executables are released when it ends.
@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()
