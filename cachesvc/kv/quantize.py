"""Quantized KV blocks: one byte per value (int8, or float8 e4m3fn), with per-channel scales for
K and per-token scales for V, as KIVI does: a head's K channels differ in range by several
times (a per-token K scale would spend its range on the widest channel), while V's error
matters per token. Scales are bfloat16 rounded up, so no value is clipped and a value is
quantized against the scale that is stored. numpy only, vectorized; used by `cachesvc.kv.codec`.

A block is `[layers, 2 (K/V), block_size, kv_heads, head_dim]` in float32, float16 or bfloat16
(bfloat16 travels as its uint16 bits).
"""

from __future__ import annotations

import numpy as np

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest code of each mode


def num_scales(shape: tuple[int, ...]) -> int:
    """K's per channel `[layers, heads, head_dim]`, then V's per token `[layers, tokens, heads]`."""
    layers, _, tokens, heads, head_dim = shape
    return layers * heads * (head_dim + tokens)


def quantize(array: np.ndarray, dtype: str, mode: str) -> tuple[bytes, bytes]:
    """The scales (bfloat16 bits) and the codes (one byte per value, in the array's layout)."""
    if array.ndim != 5 or array.shape[1] != 2:
        raise ValueError(
            f"a quantized block is [layers, 2, block_size, kv_heads, head_dim], got {array.shape}"
        )
    x = _to_float32(array, dtype)  # a fresh array: scaled in place
    qmax = QMAX[mode]
    k_bits = _scale_bits(np.abs(x[:, 0]).max(axis=1) / qmax)  # per channel, over the tokens
    v_bits = _scale_bits(np.abs(x[:, 1]).max(axis=3) / qmax)  # per token, over head_dim
    x[:, 0] /= _scale_values(k_bits)[:, None]
    x[:, 1] /= _scale_values(v_bits)[..., None]
    np.clip(x, -qmax, qmax, out=x)  # only float rounding can step past the scale
    codes = np.rint(x).astype(np.int8) if mode == "int8" else _to_fp8(x)
    return k_bits.tobytes() + v_bits.tobytes(), codes.tobytes()


def dequantize(
    scales: memoryview, codes: memoryview, shape: tuple[int, ...], dtype: str, mode: str
) -> np.ndarray:
    """The block in `dtype`'s storage dtype (a fresh, writable array)."""
    layers, _, tokens, heads, head_dim = shape
    bits = np.frombuffer(scales, dtype="<u2")
    num_k = layers * heads * head_dim
    k_scale = _scale_values(bits[:num_k]).reshape(layers, heads, head_dim)
    v_scale = _scale_values(bits[num_k:]).reshape(layers, tokens, heads)
    raw = np.frombuffer(codes, dtype=np.uint8).reshape(shape)
    x = raw.view(np.int8).astype(np.float32) if mode == "int8" else np.take(_FP8_VALUES, raw)
    x[:, 0] *= k_scale[:, None]
    x[:, 1] *= v_scale[..., None]
    return _from_float32(x, dtype)


def _scale_bits(scale: np.ndarray) -> np.ndarray:
    """Scales as bfloat16 bits rounded up, so that no value exceeds the largest code; at least
    float32's smallest normal, so that an all-zero channel divides by something."""
    bits = np.maximum(scale, np.finfo(np.float32).tiny).astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0xFFFF)) >> np.uint32(16)).astype(np.uint16)


def _scale_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return array.astype(np.float32)


def _from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # round to nearest even, as torch does
        bits = x.view(np.uint32)
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return (bits >> np.uint32(16)).astype(np.uint16)
    return x if dtype == "float32" else x.astype(np.float16)


def _fp8_values() -> np.ndarray:
    """The value of each float8 e4m3fn code: a sign, 4 exponent bits biased by 7, 3 mantissa
    bits; subnormal below 2**-6, no infinities, 0x7f and 0xff are NaN."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0xF, (code & 7) / 8
    magnitude = np.where(
        exponent == 0, mantissa * 2.0**-6, (1 + mantissa) * 2.0 ** (exponent - 7.0)
    )
    magnitude[(code & 0x7F) == 0x7F] = np.nan
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.float32)


_FP8_VALUES = _fp8_values()


def _to_fp8(x: np.ndarray) -> np.ndarray:
    """float32 values within +-448 as e4m3fn codes, rounded to nearest even (as torch's cast):
    rounding the float32 bits to 3 mantissa bits carries into the exponent by itself; values
    below 2**-6 are subnormal, multiples of 2**-9."""
    bits = x.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    half = np.uint32(0x7FFFF) + ((magnitude >> np.uint32(20)) & np.uint32(1))
    rounded = (magnitude + half) >> np.uint32(20)  # float32 exponent and 3 mantissa bits
    codes = (rounded - np.uint32(120 << 3)).astype(np.uint8)  # rebias the exponent 127 -> 7
    small = magnitude < np.uint32(0x3C800000)  # 2**-6
    if small.any():
        codes[small] = np.rint(magnitude[small].view(np.float32) * np.float32(512))
    codes |= (bits >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    return codes
