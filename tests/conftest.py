"""Test-session settings."""

import os

from hypothesis import settings

# Two cores on CI: one XLA compute thread per process keeps compile and run times predictable.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

# CI explores nothing new: the same examples on every clean checkout, no example database, and a failure
# prints the blob that reproduces it. Locally hypothesis keeps exploring; pin what it finds with @example.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
