"""Torch tensors as bit patterns: the only place the hub touches torch.

The codec works on flat numpy arrays of unsigned words (uint16 for bf16/fp16, uint32 for fp32, ...),
so every comparison and every change is integer arithmetic on the exact bits: NaN payloads, -0.0
and subnormals survive untouched.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetrl.hub.errors import CodecError

if TYPE_CHECKING:
    import torch

# dtype name in the manifest -> (torch dtype attribute, unsigned numpy word)
DTYPES: dict[str, tuple[str, str]] = {
    "bfloat16": ("bfloat16", "u2"),
    "float16": ("float16", "u2"),
    "float32": ("float32", "u4"),
    "float64": ("float64", "u8"),
    "int8": ("int8", "u1"),
    "uint8": ("uint8", "u1"),
    "int16": ("int16", "u2"),
    "int32": ("int32", "u4"),
    "int64": ("int64", "u8"),
    "bool": ("bool", "u1"),
}
_SAME_WIDTH_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CodecError(f"dtype {name} is not supported; supported: {sorted(DTYPES)}")
    return name


def word_dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise CodecError(f"dtype {name!r} is not supported; supported: {sorted(DTYPES)}")
    return np.dtype(DTYPES[name][1])


def to_words(tensor: torch.Tensor) -> np.ndarray:
    """Flat unsigned-word view of a CPU tensor's bits (a copy only when it is not contiguous or not
    on the CPU). About 2 us: the in-place reader calls it for every tensor of every step."""
    views = _views()
    if tensor.dtype not in views:
        dtype_name(tensor)  # raises, naming the dtype
    as_int, word = views[tensor.dtype]
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    words: np.ndarray = flat.contiguous().view(as_int).numpy().reshape(-1).view(word)
    return words


@functools.cache
def _views() -> dict[Any, tuple[Any, np.dtype]]:
    """torch dtype -> (torch integer dtype of the same width, numpy word dtype)."""
    import torch

    return {getattr(torch, t): (getattr(torch, _SAME_WIDTH_INT[word_dtype(n).itemsize]), word_dtype(n))
            for n, (t, _) in DTYPES.items()}


def from_words(words: np.ndarray, name: str, shape: list[int]) -> torch.Tensor:
    """A tensor of dtype `name` and `shape` sharing memory with `words`."""
    import torch

    width = word_dtype(name).itemsize
    as_int = torch.from_numpy(words.view(np.dtype(f"i{width}") if width > 1 else np.uint8))
    out: torch.Tensor = as_int.view(getattr(torch, DTYPES[name][0])).reshape(shape)
    return out


def sha256_words(words: np.ndarray) -> str:
    """sha256 of the tensor's bytes, little-endian, row-major (what safetensors stores)."""
    data: Any = np.ascontiguousarray(words.astype(words.dtype.newbyteorder("<"), copy=False))
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()
