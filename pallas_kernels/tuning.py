"""Launch parameters (tiles, warps, pipeline stages) per op and shape class, chosen by measurement.

`benchmarks/tune_kernels.py` times each op's candidates on a GPU and records the fastest in
`pallas_kernels/tunings/<device kind>.yaml`:

    gdn_decode:                      # op
      K128.V128:                     # shape class (the op's static head dims)
        {block_v: 32, num_warps: 4, num_stages: 2}

An op's public function asks `launch(op, shape_class, defaults)` before calling its Pallas launcher and
passes the result as static arguments, so a new choice compiles a new kernel rather than hitting a cached
one. Without a recorded entry (interpret mode on CPU, an unswept device) the op's own defaults apply.
`JAXHYBRID_KERNEL_CONFIGS` names another directory; `override` pins parameters for a sweep.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import yaml

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parent / "tunings"  # package data: a wheel carries its tunings
_OVERRIDES: dict[str, dict] = {}
_TARGETS: list[str] = []  # device kinds being compiled for ahead of time, innermost last (`compiling_for`)
asked: dict[str, str] = {}  # the shape class each op last asked for: the sweep records its choice there


def device_file(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200.yaml'."""
    return "_".join(device_kind.lower().split()) + ".yaml"


@functools.cache
def _recorded(path: Path) -> dict:
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def _device_kind() -> str | None:
    if _TARGETS:
        return _TARGETS[-1]
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None  # interpret mode: the defaults


def recorded(device_kind: str | None = None) -> dict:
    """The sweep's table for this device, or for `device_kind` ({} when none was recorded)."""
    device_kind = device_kind or _device_kind()
    if device_kind is None:
        return {}
    directory = Path(os.environ.get("JAXHYBRID_KERNEL_CONFIGS", CONFIGS))
    return _recorded(directory / device_file(device_kind))


def shape_class(dtype=None, **dims: int) -> str:
    """'K128.V128' from K=128, V=128: the static dims a launch choice depends on; 'K128.V128.float32' with the
    activations' dtype, for ops whose tiles depend on it."""
    return ".".join([f"{name}{size}" for name, size in dims.items()] + ([] if dtype is None else [str(dtype)]))


def defaults(launcher, *names: str) -> dict:
    """The launcher's own keyword defaults for `names`: what runs when nothing is recorded."""
    parameters = inspect.signature(launcher).parameters
    return {name: parameters[name].default for name in names}


def launch(op: str, shape_class: str, defaults: dict) -> dict:
    """`defaults` updated by the recorded entry for (op, shape_class), then by any active `override`."""
    asked[op] = shape_class
    entry = recorded().get(op, {}).get(shape_class, {})
    stale = set(entry) - set(defaults)
    if stale:  # a table from an older kernel must not stop serving: its other choices still apply
        logger.warning("%s: ignoring recorded launch parameters %s; it takes %s", op, sorted(stale), sorted(defaults))
    pinned = _OVERRIDES.get(op, {})
    if set(pinned) - set(defaults):
        raise ValueError(f"{op}: unknown launch parameters {sorted(set(pinned) - set(defaults))}; it takes "
                         f"{sorted(defaults)}")
    return {**defaults, **{k: v for k, v in entry.items() if k in defaults}, **pinned}


def for_launcher(op: str, launcher, shape_class: str, *tiles: str) -> dict:
    """`launch` over the launcher's own defaults for its `tiles` and Triton's num_warps / num_stages."""
    return launch(op, shape_class, defaults(launcher, *tiles, "num_warps", "num_stages"))


def for_state_pool(op: str, launcher, state_pool, dim_names: tuple[str, str], *tiles: str, dtype=None) -> dict:
    """`for_launcher` for an op over a [S, H, X, Y] state pool: its shape class is X and Y (named `dim_names`)
    and, for an op whose defaults depend on it (the prefills), the activations' `dtype`."""
    dims = dict(zip(dim_names, state_pool.shape[2:4], strict=True))
    return for_launcher(op, launcher, shape_class(dtype, **dims), *tiles)


@contextlib.contextmanager
def compiling_for(device_kind: str) -> Iterator[None]:
    """Inside the block ops take `device_kind`'s recorded launch parameters, whatever this host runs on:
    what a deviceless compile for that GPU (`pallas_kernels.aot`) must build."""
    _TARGETS.append(device_kind)
    try:
        yield
    finally:
        _TARGETS.pop()


@contextlib.contextmanager
def override(op: str, **params) -> Iterator[None]:
    """Pin `op`'s launch parameters inside the block (the sweep's candidates)."""
    previous = _OVERRIDES.get(op)
    _OVERRIDES[op] = params
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(op)
        else:
            _OVERRIDES[op] = previous
