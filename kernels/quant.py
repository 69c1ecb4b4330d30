"""Routed-expert weights as the megakernel stores and feeds them to the MXU, and the
dequantised values the reference multiplies with.

Formats (groups and scale dtypes of the 4-bit formats from `perfmodel.spec.formats`):
- bf16: the weights themselves;
- int8: codes round(w / s), one f32 scale s = max |w| / 127 per output channel;
- fp8: e4m3 codes of w / s, one f32 scale s = max |w| / 448 per output channel;
- int4 (group 32, bf16 scales), int4-g128-f32 (group 128, f32 scales; the GPTQ / AWQ layout):
  codes in [-8, 7], one scale max |w| / 7 per group of `group` input rows;
- mxfp4: e2m1 codes and one e8m0 scale 2^(k-127) per 32 input rows, k = floor(log2 max|w|) - 2
  (OCP Microscaling spec v1.0);
- nvfp4: e2m1 codes, one e4m3 scale per 16 input rows and one f32 scale per matrix (global =
  max |w| / (6 * 448), block scale = e4m3(max |w_block| / 6 / global); NVIDIA's NVFP4 recipe).

How the MXU is fed (the weight operand; the activations stay bf16): bf16 as is; int8 codes as
int8 (bf16 push rate on TPU7x); fp8 codes as fp8; 4-bit codes unpacked to fp8 (every int4 and
e2m1 value is exact in e4m3) against a block-diagonal left operand: row block g of the LHS is
the input restricted to group g's rows, so one dot gives every group's partial sum and the
group scales multiply those sums (`group_dot`). No format needs a bf16 dequantisation.

Layout of one expert (`ExpertLayout`): its matrices (gate_up then down) cut into T x T tiles,
column block outer; codes of tile k at rows [k * code_rows, (k + 1) * code_rows) of a [rows, T]
array (4-bit codes packed two a byte as int8: row i in the low nibble, row i + T/2 in the high
one); scales G = T / group rows a tile (per-channel formats: G = 1, the channel's scale repeated
for each row tile), grouped into chunks of `chunk` tiles that fill one sublane tile of the
scale dtype, so every slice the kernel takes is tile-aligned. 8-bit scales (e8m0, e4m3) live in
the codes array after the codes (one DMA per expert); 16- and 32-bit scales in an array of
their own (two DMAs). Unsigned values are stored as int8 bit patterns: TPU7x cores crash on
unsigned integer vector ops (docs/sources.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from perfmodel.spec.formats import get_format

QUANTISED = ("int8", "fp8", "int4", "int4-g128-f32", "mxfp4", "nvfp4")
INT4 = ("int4", "int4-g128-f32")
E2M1_FORMATS = ("mxfp4", "nvfp4")
FOUR_BIT = INT4 + E2M1_FORMATS
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP8 = ml_dtypes.float8_e4m3fn
# storage dtype of each scale dtype (8-bit ones as int8 bit patterns)
SCALE_STORAGE = {"bf16": ml_dtypes.bfloat16, "f32": np.float32, "e8m0": np.int8, "e4m3": np.int8}
SUBLANE_TILE = {1: 32, 2: 16, 4: 8}   # rows of a (sublanes, 128) tile by itemsize, TPU7x


@dataclass(frozen=True)
class TileFormat:
    """How one T x T tile of a format is stored and fed: codes [code_rows, T] code_dtype, G
    scale rows [G, T] scale_dtype (G = 0: no scales), `mxu` the weight operand's dtype."""
    name: str
    t: int
    code_dtype: object
    code_rows: int
    group: int
    scale_dtype: object
    mxu: object

    @property
    def scale_rows(self) -> int:
        """G: scale rows per tile."""
        return 0 if self.scale_dtype is None else self.t // self.group

    @property
    def chunk(self) -> int:
        """Tiles whose scale rows fill one sublane tile of the scale dtype."""
        return SUBLANE_TILE[np.dtype(self.scale_dtype).itemsize] // self.scale_rows \
            if self.scale_rows else 1

    @property
    def combined(self) -> bool:
        """Scales stored in the codes array (both 8-bit): one DMA per expert."""
        return self.scale_dtype is not None and np.dtype(self.scale_dtype).itemsize == 1 \
            and np.dtype(self.code_dtype).itemsize == 1

    @property
    def global_scale(self) -> bool:
        return self.name == "nvfp4"


def tile_format(name: str, t: int) -> TileFormat:
    if name == "bf16":
        return TileFormat(name, t, ml_dtypes.bfloat16, t, t, None, jnp.bfloat16)
    if name == "int8":
        return TileFormat(name, t, np.int8, t, t, np.float32, jnp.int8)
    if name == "fp8":
        return TileFormat(name, t, FP8, t, t, np.float32, jnp.float8_e4m3fn)
    f = get_format(name)  # 4-bit: f.block[1] input values per scale
    return TileFormat(name, t, np.int8, t // 2, f.block[1], SCALE_STORAGE[f.scale_dtype],
                      jnp.float8_e4m3fn)


@dataclass(frozen=True)
class ExpertLayout:
    """One expert's tiles: per matrix (row tiles, column blocks), codes and scale rows."""
    fmt: TileFormat
    shapes: tuple[tuple[int, int], ...]   # per matrix (row tiles, column blocks)

    @property
    def tiles(self) -> int:
        return sum(r * c for r, c in self.shapes)

    def first_tile(self, m: int) -> int:
        return sum(r * c for r, c in self.shapes[:m])

    @property
    def code_rows(self) -> int:
        return self.tiles * self.fmt.code_rows

    def scale_first_row(self, m: int) -> int:
        """First scale row of matrix m (relative to the scales' start)."""
        sub = self.fmt.chunk * self.fmt.scale_rows
        return sum(math.ceil(r * c / self.fmt.chunk) * sub for r, c in self.shapes[:m])

    @property
    def scale_rows(self) -> int:
        return self.scale_first_row(len(self.shapes)) if self.fmt.scale_rows else 0

    @property
    def rows(self) -> tuple[int, int]:
        """(rows of the codes array, rows of the separate scales array; 0 when combined or no
        scales)."""
        if self.fmt.combined:
            return self.code_rows + self.scale_rows, 0
        return self.code_rows, self.scale_rows

    def bytes(self) -> tuple[int, int]:
        """(bytes of the codes DMA, bytes of the scales DMA) of one expert."""
        (rc, rs), t = self.rows, self.fmt.t
        return (rc * t * np.dtype(self.fmt.code_dtype).itemsize,
                rs * t * (np.dtype(self.fmt.scale_dtype).itemsize if rs else 0))

    def copies(self) -> int:
        return 1 + bool(self.rows[1])


def quantize(w: np.ndarray, name: str, t: int):
    """w [d_in, d_out] -> (codes [d_in, d_out] before packing: int8, fp8, or 4-bit codes 0..15 in
    uint8; scales [ceil(d_in / group), d_out] in their storage dtype (per-channel formats: one
    row); the f32 global scale (nvfp4) or 1.0)."""
    fmt = tile_format(name, t)
    w = np.asarray(w, np.float32)
    g = fmt.group if fmt.group < t else w.shape[0]
    rows = math.ceil(w.shape[0] / g) * g
    wp = np.zeros((rows, w.shape[1]), np.float32)
    wp[:w.shape[0]] = w
    blocks = wp.reshape(rows // g, g, -1)
    amax = np.abs(blocks).max(axis=1)
    glob = 1.0
    if name == "int8":
        s = np.where(amax > 0, amax / 127, 1).astype(np.float32)
        codes = np.clip(np.rint(blocks / s[:, None]), -127, 127).astype(np.int8)
    elif name == "fp8":
        s = np.where(amax > 0, amax / 448, 1).astype(np.float32)
        codes = (blocks / s[:, None]).astype(FP8)
    elif name in INT4:
        s = np.where(amax > 0, amax / 7, 1).astype(fmt.scale_dtype)
        codes = np.clip(np.rint(blocks / s.astype(np.float32)[:, None]), -8, 7)
        codes = (codes.astype(np.int8) & 0xF).astype(np.uint8)
    else:
        if name == "mxfp4":
            k = np.floor(np.log2(np.where(amax > 0, amax, 1.0))).astype(np.int32) - 2
            s = (np.clip(k, -126, 127) + 127).astype(np.uint8).view(np.int8)
        else:  # nvfp4
            top = float(np.abs(w).max())
            glob = top / (6 * 448) if top > 0 else 1.0
            s = (np.where(amax > 0, amax / 6 / glob, 1.0)).astype(FP8).view(np.int8)
        x = blocks / (_scale(s, name) * glob)[:, None]
        idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
        codes = idx | np.where(x < 0, 8, 0).astype(np.uint8)
    return codes.reshape(rows, -1)[:w.shape[0]], s, glob


def dequantize(codes: np.ndarray, scales: np.ndarray, name: str, t: int,
               glob: float = 1.0) -> np.ndarray:
    """The f32 values the codes stand for, [d_in, d_out] (before any rounding to bf16)."""
    fmt = tile_format(name, t)
    g = fmt.group if scales.shape[0] > 1 or fmt.group < t else max(codes.shape[0], 1)
    rows = scales.shape[0] * g
    c = np.zeros((rows, codes.shape[1]), codes.dtype)
    c[:codes.shape[0]] = codes
    v = _values(c, name).reshape(scales.shape[0], g, -1) * _scale(scales, name)[:, None] * glob
    return v.reshape(rows, -1)[:codes.shape[0]]


def _values(codes, name):
    """Code values as f32: numpy on the host, jnp in the kernel (4-bit codes 0..15 as int)."""
    xp = np if isinstance(codes, np.ndarray) else jnp
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
    """Scales in their storage dtype -> f32 (numpy or in-kernel jnp)."""
    host = isinstance(scales, np.ndarray)
    if name == "mxfp4":   # e8m0 bits k: 2^(k - 127)
        if host:
            return np.exp2((scales.view(np.uint8).astype(np.float32)) - 127)
        return lax.bitcast_convert_type((scales.astype(jnp.int32) & 0xFF) << 23, jnp.float32)
    if name == "nvfp4":   # e4m3 bits
        if host:
            return scales.view(FP8).astype(np.float32)
        return lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    return scales.astype(np.float32 if host else jnp.float32)


def expert_layout(name: str, t: int, matrices: list[tuple[int, int]]) -> ExpertLayout:
    """The layout of an expert whose matrices are [d_in, d_out] (in order)."""
    return ExpertLayout(tile_format(name, t),
                        tuple((math.ceil(i / t), math.ceil(o / t)) for i, o in matrices))


def pack_expert(lay: ExpertLayout, mats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None,
                                                                     list[float]]:
    """One expert's (codes array, scales array or None, global scale per matrix) in the layout."""
    f, t = lay.fmt, lay.fmt.t
    codes = np.zeros((lay.code_rows, t), f.code_dtype)
    scales = np.zeros((lay.scale_rows, t), f.scale_dtype) if f.scale_rows else None
    globs = []
    for m, (w, (r, c)) in enumerate(zip(mats, lay.shapes)):
        w = np.asarray(w, np.float32)
        if f.name == "bf16":
            cw, s, glob = w.astype(ml_dtypes.bfloat16), None, 1.0
        else:
            cw, s, glob = quantize(w, f.name, t)
        globs.append(glob)
        full = np.zeros((r * t, c * t), cw.dtype)
        full[:w.shape[0], :w.shape[1]] = cw
        tiles = full.reshape(r, t, c, t).transpose(2, 0, 1, 3).reshape(c * r, t, t)
        if f.name in FOUR_BIT:
            tiles = (tiles[:, :t // 2] | (tiles[:, t // 2:] << 4)).view(np.int8)
        k0 = lay.first_tile(m)
        codes[k0 * f.code_rows:(k0 + r * c) * f.code_rows] = tiles.reshape(-1, t)
        if scales is not None:
            g = f.scale_rows
            per = np.repeat(s, r, axis=0) if f.group >= t else s    # per-channel: each row tile
            sp = np.ones((r * g, c * t), np.float32).astype(s.dtype) if f.name != "mxfp4" else \
                np.full((r * g, c * t), 127, np.uint8).view(np.int8)
            sp[:per.shape[0], :per.shape[1]] = per
            st = sp.reshape(r, g, c, t).transpose(2, 0, 1, 3).reshape(c * r * g, t)
            base = lay.scale_first_row(m)
            scales[base:base + st.shape[0]] = st
    if f.combined:
        return np.concatenate([codes, scales]), None, globs
    return codes, scales, globs


def dequantized_weights(weights, name: str, t: int = 256):
    """The reference's weights with every routed expert replaced by its dequantised `name`
    values in bf16 (code * scale in f32, rounded once); t only sets per-channel scale rows."""
    from . import reference
    layers = []
    for lw in weights["layers"]:
        lw = dict(lw)
        for k in ("expert_gate_up", "expert_down"):
            if k in lw:
                w = np.asarray(lw[k], np.float32)
                lw[k] = jnp.asarray(np.stack([round_trip(e, name, t) for e in w]),
                                    jnp.bfloat16)
        layers.append(lw)
    return reference.Weights(dict(weights.params, layers=layers), weights.static)


def round_trip(w: np.ndarray, name: str, t: int) -> np.ndarray:
    """The f32 values `w` stands for once stored in format `name`."""
    codes, scales, glob = quantize(w, name, t)
    return dequantize(codes, scales, name, t, glob)


# ----- in the kernel ----------------------------------------------------------------------------

def mxu_operand(codes, fmt: TileFormat):
    """A tile's codes [code_rows, T] -> the MXU weight operand [T, T] (bf16, int8 or fp8)."""
    if fmt.name not in FOUR_BIT:
        return codes
    n = codes.astype(jnp.int32)                       # int8 bits, sign-extended
    lo, hi = n & 0xF, (n >> 4) & 0xF
    return _values(jnp.concatenate([lo, hi], axis=0), fmt.name).astype(jnp.float8_e4m3fn)


def tile_scales(scale_chunk, u: int, fmt: TileFormat):
    """Scale rows [G, T] f32 of tile u of a loaded chunk [chunk * G, T] (storage dtype)."""
    g = fmt.scale_rows
    return _scale(scale_chunk, fmt.name)[u * g:(u + 1) * g]


def group_dot(x, w, scales, fmt: TileFormat):
    """x [bp, T] f32 @ one tile: w the MXU operand [T, T], scales [G, T] f32 or None ->
    [bp, T] f32. G > 1: one dot against the block-diagonal LHS [G * bp, T] (row block g = x on
    the inputs of group g), then the G partial sums weighted by their scales."""
    dims = (((1,), (0,)), ((), ()))
    dot = lambda a: lax.dot_general(a.astype(jnp.bfloat16), w, dims,
                                    preferred_element_type=jnp.float32)
    if scales is None:
        return dot(x)
    g, bp = scales.shape[0], x.shape[0]
    if g == 1:
        return dot(x) * scales
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1) // fmt.group
    p = dot(jnp.concatenate([jnp.where(lane == k, x, 0.0) for k in range(g)]))  # f32 rows
    return sum(p[k * bp:(k + 1) * bp] * scales[k:k + 1] for k in range(g))
