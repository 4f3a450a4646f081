"""The pools' dtypes from vLLM's --kv-cache-dtype and --mamba-ssm-cache-dtype, with an FP8 checkpoint's KV-cache
scales (`k_scale` / `v_scale`, ModelOpt's and vLLM's names) for an fp8 KV cache.

The KV pools take one per-tensor scale for keys and one for values, the same for every attention layer: the
layers of a segment run as one scanned program. A checkpoint's per-layer scales become their largest: a layer's
scale is its calibrated |K| max / 448, so the largest keeps every layer's values inside e4m3's range (layers with
smaller scales lose a little precision, none saturates). Without such scales the pools use vLLM's default, 1.0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxhybrid.models.pools import CacheDtypes
from jaxhybrid.models.safetensors_reader import read_header

KV_SCALE_NAMES = ("k_scale", "v_scale")


def checkpoint_kv_scales(directory: Path) -> tuple[float, float] | None:
    """(k_scale, v_scale) over the checkpoint's layers (their largest), or None where it has neither."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text()).get("weight_map", {}).values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    found: dict[str, list[float]] = {name: [] for name in KV_SCALE_NAMES}
    for path in files:
        if not path.is_file():
            continue
        for name, entry in read_header(path).items():
            leaf = name.rpartition(".")[2]
            if leaf in found:
                found[leaf].append(float(np.max(entry.read())))
    if not any(found.values()):
        return None
    k_scale, v_scale = (max(found[name], default=1.0) for name in KV_SCALE_NAMES)
    for name, scale in zip(KV_SCALE_NAMES, (k_scale, v_scale), strict=True):
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"the checkpoint's {name} must be a positive finite number, got {scale}")
    return k_scale, v_scale


def cache_dtypes(kv_cache_dtype: str, mamba_ssm_cache_dtype: str, directory: Path) -> CacheDtypes:
    """The pools' `CacheDtypes` for the flags' values; an fp8 KV cache takes the checkpoint's scales if it has any."""
    scales = checkpoint_kv_scales(directory) if kv_cache_dtype != "auto" else None
    return CacheDtypes(kv_cache_dtype, mamba_ssm_cache_dtype, *(scales or (1.0, 1.0)))
