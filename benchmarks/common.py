"""What the benchmarks share: how a plot is drawn off-screen and saved."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def figure(path: Path, *subplots: Any, dpi: int = 120, **options: Any) -> Iterator[tuple[Any, Any]]:
    """`plt.subplots(*subplots, **options)` drawn off-screen and saved to `path` when the block ends."""
    import matplotlib  # the `train` extra: only benchmarks and the tiny recipe plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*subplots, **options)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
