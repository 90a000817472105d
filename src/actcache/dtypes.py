"""Values of a 16-bit cache (protocol 2.0) to and from float32, in numpy.

numpy holds float16 values as ``float16`` and bfloat16 ones as their raw bits (``uint16``; numpy
has no bfloat16); :data:`actcache.protocol.STORAGE` names both. The rules, which the C copy
kernel (loaders/kernels.py) follows byte for byte:

- to 16 bits: round to nearest, ties to even, as torch does; overflow gives +-Inf; Inf stays
  Inf; a NaN becomes the quiet NaN of its sign (0x7E00 / 0x7FC0, sign bit kept).
- to float32: exact (every 16-bit value is a float32 value); a NaN keeps its sign and payload
  and comes out quiet (bit 22 set), as the x86 F16C conversion does.
"""

from __future__ import annotations

import numpy as np

from actcache.protocol import STORAGE

HALF_DTYPES = ("float16", "bfloat16")
_QNAN16 = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def storage_dtype(dtype: str) -> np.dtype:
    return np.dtype(STORAGE[dtype])


def is_stored_as(a: np.ndarray, dtype: str) -> bool:
    """Whether ``a`` already holds ``dtype``'s stored values (so it is written as it is)."""
    return a.dtype == storage_dtype(dtype) or (dtype == "bfloat16" and a.dtype == np.int16)


def to_stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> ``dtype``'s stored values (a new array; float32: the values as they are)."""
    a = np.ascontiguousarray(a, np.float32)
    if dtype == "float32":
        return a
    bits = a.view(np.uint32)
    sign16 = (bits >> 16).astype(np.uint16) & np.uint16(0x8000)
    nan = np.isnan(a)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            out = a.astype(np.float16).view(np.uint16)
    elif dtype == "bfloat16":
        # add 0x7FFF plus the lowest kept bit, then cut: round to nearest, ties to even
        lsb = (bits >> 16) & np.uint32(1)
        out = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    else:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, {', '.join(HALF_DTYPES)}")
    out[nan] = sign16[nan] | np.uint16(_QNAN16[dtype])
    return out.view(storage_dtype(dtype))


def to_float32(a: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``dtype``'s stored values (any shape) -> float32, exactly (into ``out`` if given)."""
    if out is None:
        out = np.empty(a.shape, np.float32)
    if dtype == "float32":
        np.copyto(out, a)
        return out
    bits = np.asarray(a).view(np.uint16)
    if dtype == "bfloat16":
        wide = bits.astype(np.uint32) << 16
    elif dtype == "float16":
        wide = bits.view(np.float16).astype(np.float32).view(np.uint32)
    else:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, {', '.join(HALF_DTYPES)}")
    nan = (bits & np.uint16(0x7FFF)) > np.uint16(0x7C00 if dtype == "float16" else 0x7F80)
    wide[nan] |= np.uint32(0x00400000)
    out.view(np.uint32)[...] = wide
    return out


def count_nonfinite(a: np.ndarray, dtype: str) -> int:
    """NaN and Inf values among stored values of ``dtype`` (exponent bits all ones)."""
    if dtype == "float32":
        a = np.asarray(a).view(np.float32)
        return int(a.size - np.count_nonzero(np.isfinite(a)))
    exp = np.uint16(0x7C00 if dtype == "float16" else 0x7F80)
    return int(np.count_nonzero((np.asarray(a).view(np.uint16) & exp) == exp))
