"""Strict safetensors reading and writing for adapter files (never unpickles).

`safetensors.numpy` cannot return bfloat16 (numpy has no such dtype) and reports a
truncated file without naming the tensor, so adapters are read by this small parser,
which checks every header entry against the file and returns `ml_dtypes` arrays for
bf16 / fp8.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

# The format's little-endian dtypes (numpy's native order may differ: spell it out).
_ST_DTYPES: dict[str, Any] = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
    "C64": "<c8",
}
# As the reference reader: a larger header is refused before it is parsed.
MAX_HEADER_BYTES = 100_000_000
# numpy's limit (NPY_MAXDIMS): a larger shape cannot be made into an array.
MAX_NDIM = 64


def _st_dtype(name, file: str, key: str):
    if not isinstance(name, str):
        raise ValueError(f"{file}: tensor {key!r} has a dtype that is not a string: {name!r}")
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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        # one pass: a count per key is quadratic, and a header may hold millions of keys
        seen, dup = set(), set()
        for k, _ in pairs:
            (dup if k in seen else seen).add(k)
        raise ValueError(f"duplicate keys {sorted(dup)[:4]}")
    return out


def _parse_header(raw: bytes, file: str) -> tuple[dict, int]:
    """The header dict and its byte length, checked as the format requires."""
    if len(raw) < 8:
        raise ValueError(f"{file}: truncated safetensors file ({len(raw)} bytes)")
    n = int.from_bytes(raw[:8], "little")
    if n <= 0 or n > MAX_HEADER_BYTES or 8 + n > len(raw):
        raise ValueError(f"{file}: corrupt or truncated safetensors header (length {n})")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{file}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{file}: corrupt safetensors header (not an object)")
    meta = header.get("__metadata__")
    # null is no metadata, as the reference reader (an optional map) takes it
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise ValueError(f"{file}: __metadata__ must map strings to strings")
    return header, n


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a `.safetensors` file strictly into numpy arrays (no pickle, no torch).

    As the format (and the reference reader) requires: a header of at most
    `MAX_HEADER_BYTES` with no duplicate keys, each entry's dtype, shape and offsets well
    typed, its byte span its dtype × shape, and the spans tiling the data exactly (no
    overlap, gap or trailing bytes); as numpy requires, at most `MAX_NDIM` dimensions.
    Anything else raises `ValueError` naming the file (and tensor).

    Example:
        >>> tensors = read_safetensors("adapter/adapter_model.safetensors")  # doctest: +SKIP
    """
    file = os.fspath(file)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{file}: cannot read: {e}") from e
    header, n = _parse_header(raw, file)
    data = memoryview(raw)[8 + n :]
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise ValueError(f"{file}: tensor {key!r} has a corrupt header entry: {info!r:.200}")
        dtype = _st_dtype(info["dtype"], file, key)
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"{file}: tensor {key!r} has a corrupt shape {shape!r:.200}")
        if len(shape) > MAX_NDIM:
            raise ValueError(
                f"{file}: tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} "
                "are supported"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{file}: tensor {key!r} has corrupt data_offsets {offsets!r:.200}")
        start, end = offsets
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{file}: tensor {key!r} (dtype {info['dtype']}, shape {shape}) spans "
                f"{end - start} bytes, not its dtype x shape: corrupt file"
            )
        entries.append((start, end, key, dtype, tuple(shape)))
    entries.sort(key=lambda e: (e[0], e[1]))
    at = 0
    for start, end, key, _, _ in entries:
        if start != at:
            what = "overlaps the one before" if start < at else "leaves a gap before it"
            raise ValueError(f"{file}: tensor {key!r} {what} (offset {start}): corrupt file")
        at = end
    if at != len(data):
        raise ValueError(
            f"{file}: the tensors cover {at} of {len(data)} data bytes: truncated or corrupt file"
        )
    return {
        key: np.frombuffer(data[start:end], dtype=dtype).reshape(shape).copy()
        for start, end, key, dtype, shape in entries
    }


def write_safetensors(file: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes numpy arrays as a `.safetensors` file (for tests and generated adapters).

    Example:
        >>> write_safetensors("/tmp/a.safetensors", {"w": np.ones((2, 3), np.float32)})
        >>> read_safetensors("/tmp/a.safetensors")["w"].shape
        (2, 3)
    """
    from safetensors.numpy import save_file

    # order="C" keeps a scalar 0-d (np.ascontiguousarray would make it [1])
    save_file({k: np.asarray(v, order="C") for k, v in tensors.items()}, os.fspath(file))
