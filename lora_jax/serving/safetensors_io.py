"""Strict safetensors reading and writing for adapter files (never unpickles).

`safetensors.numpy` cannot return bfloat16 (numpy has no such dtype) and reports a
truncated file without naming the tensor, so adapters are read by this small parser,
which checks every header entry against the file and returns `ml_dtypes` arrays for
bf16 / fp8.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _st_dtype(name: str, file: str, key: str):
    if name in _ST_DTYPES:
        return np.dtype(_ST_DTYPES[name])
    import ml_dtypes  # ships with jax

    extra = {
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
    }
    if name not in extra:
        raise ValueError(f"{file}: tensor {key!r} has unsupported dtype {name!r}")
    return np.dtype(extra[name])


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a `.safetensors` file strictly into numpy arrays (no pickle, no torch).

    Every header entry is checked against the file size and its dtype × shape, so a
    truncated or corrupt file raises `ValueError` naming the file (and tensor).

    Example:
        >>> tensors = read_safetensors("adapter/adapter_model.safetensors")  # doctest: +SKIP
    """
    file = os.fspath(file)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{file}: cannot read: {e}") from e
    if len(raw) < 8:
        raise ValueError(f"{file}: truncated safetensors file ({len(raw)} bytes)")
    n = int.from_bytes(raw[:8], "little")
    if n <= 0 or 8 + n > len(raw):
        raise ValueError(f"{file}: corrupt or truncated safetensors header (length {n})")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{file}: corrupt safetensors header (not an object)")
    data = memoryview(raw)[8 + n :]
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(s) for s in shape)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{file}: tensor {key!r} has a corrupt header entry") from e
        dtype = _st_dtype(dtype_name, file, key)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= start <= end <= len(data) or end - start != size:
            raise ValueError(
                f"{file}: tensor {key!r} (dtype {dtype_name}, shape {list(shape)}) lies outside "
                f"the file or has the wrong byte size: truncated or corrupt file"
            )
        out[key] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape).copy()
    return out


def write_safetensors(file: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes numpy arrays as a `.safetensors` file (for tests and generated adapters).

    Example:
        >>> write_safetensors("/tmp/a.safetensors", {"w": np.ones((2, 3), np.float32)})
        >>> read_safetensors("/tmp/a.safetensors")["w"].shape
        (2, 3)
    """
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.fspath(file))
