"""The uint8 KV cache's layout (LoadOptions.kv_cache_precision "uint8", the attention kernel's mirror_sd.ku8 op,
runtime/native/attention.cc): each position of a KV head holds its head_dim values as codes 0..255 between their
minimum and maximum, then the scale and the minimum as two float32, so a position takes head_dim + CODE_TAIL bytes.
Here the same coding in numpy, for KV memory written or read outside the kernel (the bf16 prompt graphs on OpenVINO).
"""

from __future__ import annotations

import numpy as np

CODE_TAIL = 8  # bytes after a position's codes: its scale and its minimum, float32 each (the kernel's kCodeTail)


def kv_width(head_dim: int, dtype: np.dtype) -> int:
    """Elements a position of one KV head takes in KV memory of `dtype`."""
    return head_dim + CODE_TAIL if np.dtype(dtype) == np.uint8 else head_dim


def coded(values: np.ndarray) -> np.ndarray:
    """float32 [..., head_dim] as the kernel codes them, byte for byte: [..., head_dim + CODE_TAIL] uint8 (codes
    rounded to nearest, ties to even; equal values a scale of 0; a NaN among them a NaN minimum; zeros as +0)."""
    x = np.asarray(values, np.float32)
    with np.errstate(all="ignore"):  # a NaN, an infinity or a subnormal range codes as the kernel's does, silently
        low = x.min(-1, keepdims=True) + np.float32(0)
        high = x.max(-1, keepdims=True) + np.float32(0)
        scale = (high - low) / np.float32(255)
        inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
        codes = np.rint((x - low) * inverse)
        codes = np.clip(np.where(np.isnan(codes), 0, codes), 0, 255).astype(np.uint8)
    return np.concatenate([codes, np.concatenate([scale, low], -1).view(np.uint8)], -1)


def widened(codes: np.ndarray) -> np.ndarray:
    """[..., head_dim + CODE_TAIL] uint8 back to float32 [..., head_dim]: code x scale + minimum (rounded once, as the
    kernel's fused multiply-add rounds it, but for the rare sum float64 rounds first)."""
    tail = np.ascontiguousarray(codes[..., -CODE_TAIL:]).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore"):  # a NaN minimum: the position's values NaN
        return (codes[..., :-CODE_TAIL] * tail[..., :1] + tail[..., 1:]).astype(np.float32)


def as_float32(memory: np.ndarray) -> np.ndarray:
    """KV memory [..., kv_width] of any KV element type (float32, float16, uint8 codes) as float32 [..., head_dim]."""
    return widened(memory) if memory.dtype == np.uint8 else memory.astype(np.float32, copy=False)


def stored(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 values [..., head_dim] as KV memory of `dtype` takes them: uint8 coded here, float16 rounded to nearest
    even by numpy's assignment (as the kernel rounds them), float32 as they are."""
    return coded(values) if np.dtype(dtype) == np.uint8 else values
