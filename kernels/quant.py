"""Quantised routed-expert weights: codes and scales as the megakernel stores them, and the
dequantisation the kernel runs on each tile (the reference uses the same dequantised values).

Formats (group sizes and scale dtypes of the 4-bit formats from `perfmodel.spec.formats`):
- int8: one f32 scale per output channel (max |w| / 127), codes round(w / s);
- fp8: e4m3 codes of w / s, one f32 scale per output channel (max |w| / 448);
- int4 (group 32, bf16 scales) and int4-g128-f32 (group 128, f32 scales; the GPTQ / AWQ
  layout): one scale per group of `group` input rows (max |w| / 7), codes in [-8, 7];
- mxfp4: e2m1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit) and one e8m0 scale 2^(k-127)
  per group of `group` input rows (OCP Microscaling spec v1.0), k = floor(log2 max|w|) - 2.
4-bit codes are packed two per byte inside a T x T tile: row i in the low nibble, row i + T/2
in the high nibble. A tile dequantises to bf16 (code * scale in f32, then rounded), exactly the
values the reference multiplies with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from perfmodel.spec.formats import get_format

QUANTISED = ("int8", "fp8", "int4", "int4-g128-f32", "mxfp4")
INT4 = ("int4", "int4-g128-f32")
SCALE_DTYPES = {"bf16": ml_dtypes.bfloat16, "f32": np.float32, "e8m0": np.uint8}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@dataclass(frozen=True)
class TileFormat:
    """How one T x T tile of a format is stored: codes [code_rows, T] code_dtype and scales
    [T // group, T] scale_dtype (group = T: one scale per column)."""
    name: str
    t: int
    code_dtype: object
    code_rows: int
    group: int
    scale_dtype: object

    @property
    def tile_bytes(self) -> int:
        return self.t * (self.code_rows * np.dtype(self.code_dtype).itemsize
                         + self.t // self.group * np.dtype(self.scale_dtype).itemsize)


def tile_format(name: str, t: int) -> TileFormat:
    if name == "int8":
        return TileFormat(name, t, np.int8, t, t, np.float32)
    if name == "fp8":
        return TileFormat(name, t, ml_dtypes.float8_e4m3fn, t, t, np.float32)
    f = get_format(name)  # 4-bit: f.block[1] input values per scale
    return TileFormat(name, t, np.uint8, t // 2, f.block[1], SCALE_DTYPES[f.scale_dtype])


def quantize(w: np.ndarray, name: str, t: int) -> tuple[np.ndarray, np.ndarray]:
    """w [d_in, d_out] -> (codes [d_in, d_out] as stored before packing: int8, fp8, or 4-bit
    codes in uint8; scales [ceil(d_in / group), d_out]); groups per T-row tile for per-channel
    formats, so scales have one row per row tile (the same value in each)."""
    fmt = tile_format(name, t)
    w = np.asarray(w, np.float32)
    g = fmt.group if fmt.group < t else w.shape[0]
    rows = math.ceil(w.shape[0] / g) * g
    wp = np.zeros((rows, w.shape[1]), np.float32)
    wp[:w.shape[0]] = w
    blocks = wp.reshape(rows // g, g, -1)
    amax = np.abs(blocks).max(axis=1)
    if name == "int8":
        s = np.where(amax > 0, amax / 127, 1).astype(np.float32)
        codes = np.clip(np.rint(blocks / s[:, None]), -127, 127).astype(np.int8)
    elif name == "fp8":
        s = np.where(amax > 0, amax / 448, 1).astype(np.float32)
        codes = (blocks / s[:, None]).astype(ml_dtypes.float8_e4m3fn)
    elif name in INT4:
        s = np.where(amax > 0, amax / 7, 1).astype(fmt.scale_dtype)
        codes = np.clip(np.rint(blocks / s.astype(np.float32)[:, None]), -8, 7)
        codes = (codes.astype(np.int8) & 0xF).astype(np.uint8)
    else:  # mxfp4
        k = np.floor(np.log2(np.where(amax > 0, amax, 1.0))).astype(np.int32) - 2
        s = (np.clip(k, -126, 127) + 127).astype(np.uint8)
        x = blocks / np.exp2(s.astype(np.float32) - 127)[:, None]
        idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
        codes = idx | np.where(x < 0, 8, 0).astype(np.uint8)
    codes = codes.reshape(rows, -1)[:w.shape[0]]
    if fmt.group >= t:  # per channel: one scale row per row tile
        s = np.repeat(s, math.ceil(w.shape[0] / t), axis=0)
    return codes, s


def dequantize(codes: np.ndarray, scales: np.ndarray, name: str, t: int) -> np.ndarray:
    """The f32 values the codes stand for, [d_in, d_out] (before rounding to bf16)."""
    fmt = tile_format(name, t)
    g = fmt.group
    rows = scales.shape[0] * g
    c = np.zeros((rows, codes.shape[1]), codes.dtype)
    c[:codes.shape[0]] = codes
    v = _values(c, name).reshape(scales.shape[0], g, -1) * _scale(scales, name)[:, None]
    return v.reshape(rows, -1)[:codes.shape[0]]


def _values(codes, name):
    xp = jnp if isinstance(codes, jnp.ndarray) else np
    if name in ("int8", "fp8"):
        return codes.astype(xp.float32)
    n = codes.astype(xp.int32)
    if name in INT4:
        return xp.where(n >= 8, n - 16, n).astype(xp.float32)
    e, m = (n >> 1) & 3, (n & 1).astype(xp.float32)
    mag = xp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << xp.maximum(e - 1, 0)).astype(
        xp.float32))
    return xp.where(n >= 8, -mag, mag)


def _scale(scales, name):
    if name != "mxfp4":
        return scales.astype(np.float32) if isinstance(scales, np.ndarray) else \
            scales.astype(jnp.float32)
    if isinstance(scales, np.ndarray):
        return np.exp2(scales.astype(np.float32) - 127)
    return lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)


def tile_codes(codes: np.ndarray, name: str, t: int) -> np.ndarray:
    """[d_in, d_out] codes -> [cols*rows, code_rows, T] tiles (column block outer, zero pad),
    4-bit codes packed (row i low nibble, row i + T/2 high nibble)."""
    r, c = math.ceil(codes.shape[0] / t), math.ceil(codes.shape[1] / t)
    p = np.zeros((r * t, c * t), codes.dtype)
    p[:codes.shape[0], :codes.shape[1]] = codes
    tiles = p.reshape(r, t, c, t).transpose(2, 0, 1, 3).reshape(c * r, t, t)
    if name in INT4 + ("mxfp4",):
        tiles = tiles[:, :t // 2] | (tiles[:, t // 2:] << 4)
    return tiles


def tile_scales(scales: np.ndarray, name: str, t: int, d_out: int) -> np.ndarray:
    """[d_in / group, d_out] scales -> [cols*rows, T / group, T] per tile (padding: scale 1)."""
    fmt = tile_format(name, t)
    per = t // fmt.group
    r = math.ceil(scales.shape[0] / per)
    c = math.ceil(d_out / t)
    one = 127 if name == "mxfp4" else 1
    p = np.full((r * per, c * t), one, scales.dtype)
    p[:scales.shape[0], :scales.shape[1]] = scales
    return p.reshape(r, per, c, t).transpose(2, 0, 1, 3).reshape(c * r, per, t)


def dequantized_weights(weights, name: str):
    """The reference's weights with every routed expert replaced by its dequantised `name`
    values in bf16 (what the kernel multiplies with); t only sets per-channel scale rows."""
    from . import reference
    layers = []
    for lw in weights["layers"]:
        lw = dict(lw)
        for k in ("expert_gate_up", "expert_down"):
            if k in lw:
                w = np.asarray(lw[k], np.float32)
                lw[k] = jnp.asarray(np.stack([dequantize(*quantize(e, name, 256), name, 256)
                                              for e in w]), jnp.bfloat16)
        layers.append(lw)
    return reference.Weights(dict(weights.params, layers=layers), weights.static)


def dequantize_tile(codes, scales, name: str):
    """In-kernel: a tile's codes [code_rows, T] and scales [T/group, T] -> bf16 [T, T]."""
    t = scales.shape[-1]
    if name in INT4 + ("mxfp4",):
        n = codes.astype(jnp.int32)
        codes = jnp.concatenate([n & 0xF, n >> 4], axis=0)
    v = _values(codes, name)
    g = t // scales.shape[0]
    v = (v.reshape(scales.shape[0], g, t) * _scale(scales, name)[:, None, :]).reshape(t, t)
    return v.astype(jnp.bfloat16)
