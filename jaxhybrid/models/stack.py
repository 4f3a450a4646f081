"""The layer stack as segments of a repeating period, so that a step's program holds each period once.

A model's layers are cut into segments; a segment is a period of layers (each a tuple of sublayer kinds)
run `repeats` times in a row, and compiles as a scan over its repeats. Qwen3-Next-80B is one segment,
12 x (3 GDN + 1 attention); Nemotron-H-8B is 4 x an 11-layer period, then 4 x (Mamba2, MLP).
The cut repeats the period that covers the most layers (the shortest such period on a tie), then cuts the
layers before and after it the same way; a run with no repeat is one segment of one repeat.

Params are stored per segment and period position, stacked on a leading `repeats` axis: model layer
`Segment.layer(j, r)` is entry r of `segment_{k}/layers_{j}` (`layer_location` is the inverse). The pools of
a segment that repeats are stacked the same way (`pools.py`).

A step takes its params as flat leaves (`flatten_params`). On CPU an unrolled step takes each stacked leaf as its
per-repeat views and restacks them in its program (`unflatten_params`): XLA folds each repeat's slice of that
stack back to its view, where slicing a stacked argument copies the layer's weights out, every layer of every
step (docs/engine.md#inside-the-jitted-step).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Layers = tuple[tuple[str, ...], ...]


class Segment(NamedTuple):
    first: int      # index of the segment's first layer in the model
    period: Layers  # the kinds of each layer of one period
    repeats: int

    @property
    def num_layers(self) -> int:
        return len(self.period) * self.repeats

    def layer(self, position: int, repeat: int) -> int:
        """The model layer at period position `position` of repeat `repeat`."""
        return self.first + repeat * len(self.period) + position


@functools.cache
def layer_segments(layers: Layers, first: int = 0) -> tuple[Segment, ...]:
    """`layers` as segments, in order (see the module docstring for the cut)."""
    if not layers:
        return ()
    best = _longest_repeat(layers)
    if best is None:
        return (Segment(first, layers, 1),)
    start, period, repeats = best
    end = start + period * repeats
    return (*layer_segments(layers[:start], first), Segment(first + start, layers[start:start + period], repeats),
            *layer_segments(layers[end:], first + end))


def _longest_repeat(layers: Layers) -> tuple[int, int, int] | None:
    """(start, period, repeats) of the run of at least two equal periods covering the most layers."""
    best, covered = None, 0
    for period in range(1, len(layers) // 2 + 1):
        for start in range(len(layers) - 2 * period + 1):
            repeats = 1
            while layers[start + repeats * period:start + (repeats + 1) * period] == layers[start:start + period]:
                repeats += 1
            if repeats >= 2 and repeats * period > covered:
                best, covered = (start, period, repeats), repeats * period
    return best


def layer_location(layer: int, segments: tuple[Segment, ...]) -> tuple[int, int, int]:
    """(segment k, period position j, repeat r) of model layer `layer`."""
    for k, segment in enumerate(segments):
        offset = layer - segment.first
        if 0 <= offset < segment.num_layers:
            return k, offset % len(segment.period), offset // len(segment.period)
    raise IndexError(f"layer {layer} is past the model's {sum(s.num_layers for s in segments)} layers")


def segment_key(k: int) -> str:
    return f"segment_{k}"


def is_stacked(path: tuple[Any, ...]) -> bool:
    """Whether a params path lies in a segment, whose leaves carry the leading `repeats` axis."""
    return bool(path) and str(getattr(path[0], "key", path[0])).startswith("segment_")


def per_layer(params: dict, segments: tuple[Segment, ...]) -> dict:
    """The params with each segment's stacked leaves split back into `layers_{i}` entries (host arrays), the
    checkpoint's own layout."""
    out = {key: value for key, value in params.items() if not key.startswith("segment_")}
    for k, segment in enumerate(segments):
        for j in range(len(segment.period)):
            stacked = params[segment_key(k)][f"layers_{j}"]
            for r in range(segment.repeats):
                out[f"layers_{segment.layer(j, r)}"] = jax.tree.map(lambda w, r=r: np.asarray(w[r]), stacked)
    return out


class ParamLayout(NamedTuple):
    """How a step's flat param leaves make up the params: `tree`'s leaves in order, each stacked leaf either
    whole (0) or as that many per-repeat views (its repeats)."""

    tree: Any  # jax.tree_util.PyTreeDef
    views: tuple[int, ...]


def flatten_params(params: Any, *, repeat_views: bool) -> tuple[list[jax.Array], ParamLayout]:
    """The params as flat leaves; with `repeat_views` (CPU arrays only) each segment's stacked leaf is passed as
    views of its repeats (`layer_views`)."""
    paths, tree = jax.tree_util.tree_flatten_with_path(params)
    leaves, views = [], []
    for path, leaf in paths:
        split = repeat_views and is_stacked(path)
        leaves += layer_views(leaf) if split else [leaf]
        views.append(leaf.shape[0] if split else 0)
    return leaves, ParamLayout(tree, tuple(views))


def unflatten_params(leaves: list[jax.Array], layout: ParamLayout) -> Any:
    """The params from `flatten_params`' leaves: each leaf's views restacked (in the step's program)."""
    whole, start = [], 0
    for count in layout.views:
        whole.append(jnp.stack(leaves[start:start + count]) if count else leaves[start])
        start += max(count, 1)
    return jax.tree.unflatten(layout.tree, whole)


def layer_views(stacked: jax.Array) -> list[jax.Array]:
    """Each repeat of a stacked CPU array as an array that shares its memory: the host view of repeat r put on the
    array's device, which the CPU client aliases rather than copies where the view is aligned (every weight
    matrix; a small vector may be copied)."""
    host = np.asarray(stacked)  # the CPU buffer itself, read-only
    # placed as the stack is: a committed argument where the step was traced with an uncommitted one retraces it
    place = (lambda view: jax.device_put(view, stacked.sharding)) if stacked.committed else jax.device_put
    return [place(host[r]) for r in range(stacked.shape[0])]
