"""Test-session settings."""

import os

# Two cores on CI: one XLA compute thread per process keeps compile and run times predictable.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
