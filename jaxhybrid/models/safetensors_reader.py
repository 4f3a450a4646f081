"""Safetensors files read directly: the JSON header, then each tensor's raw bytes viewed as its dtype.

safetensors' own numpy framework has no float8 (nor bfloat16) type; ml_dtypes (a JAX dependency) has both,
so a header entry's bytes are read into an array of that dtype, one tensor at a time.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

# safetensors dtype names -> numpy dtypes (little-endian, as the format stores them)
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file; the message names it."""


class TensorEntry(NamedTuple):
    """Where one tensor's bytes lie: its file, dtype name, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def read(self) -> np.ndarray:
        """The tensor as a numpy array of its own dtype (only its bytes are read)."""
        dtype = DTYPES.get(self.dtype)
        if dtype is None:
            raise SafetensorsError(f"{self.file}: dtype {self.dtype!r} is not supported")
        count = math.prod(self.shape)
        if self.end - self.start != count * dtype.itemsize:
            raise SafetensorsError(f"{self.file}: a {self.dtype} tensor of shape {list(self.shape)} takes "
                                   f"{count * dtype.itemsize} bytes, its header says {self.end - self.start}")
        with open(self.file, "rb") as f:
            f.seek(self.start)
            array = np.fromfile(f, dtype, count)
        if array.size != count:
            raise SafetensorsError(f"{self.file} ends inside a tensor (truncated file)")
        return array.reshape(self.shape)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, in the order of their bytes."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{path} is too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SafetensorsError(f"{path} has no valid safetensors header: {error}") from error
    header.pop("__metadata__", None)
    base = 8 + length
    entries = {name: TensorEntry(path, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0],
                                 base + info["data_offsets"][1]) for name, info in header.items()}
    return dict(sorted(entries.items(), key=lambda item: item[1].start))
