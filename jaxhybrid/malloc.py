"""tcmalloc for the command-line programs: they re-execute themselves with it preloaded when it is installed.

XLA:CPU allocates a step's temporaries afresh on every step. glibc's malloc serves blocks over 32 MiB with
fresh mmaps, so every page of them faults in again on every step; tcmalloc keeps and reuses them (the measured
difference is in docs/benchmarks.md). vLLM preloads tcmalloc on CPU for the same reason. Debian/Ubuntu ship it as
`libtcmalloc-minimal4`.

`JAXHYBRID_TCMALLOC`: unset, the library is looked up; `0`, the process keeps its allocator; a path or a
library name, that library is preloaded.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping

SETTING = "JAXHYBRID_TCMALLOC"


def tcmalloc_library(environ: Mapping[str, str] = os.environ) -> str | None:
    """The library to preload: the setting's, else an installed tcmalloc, else None (also when opted out)."""
    chosen = environ.get(SETTING)
    if chosen == "0" or sys.platform != "linux":
        return None
    if chosen:
        return chosen
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preload_environment(environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with, or None when there is nothing to preload or it is preloaded
    already (so the re-executed process does not loop)."""
    preloaded = environ.get("LD_PRELOAD", "")
    if library is None or library in preloaded.replace(":", " ").split():
        return None
    return {**environ, "LD_PRELOAD": f"{library} {preloaded}".strip()}


def preload_tcmalloc() -> None:
    """Re-execute this program with tcmalloc preloaded, unless it is loaded, missing, or opted out."""
    environment = preload_environment(os.environ, tcmalloc_library())
    if environment is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, environment)
