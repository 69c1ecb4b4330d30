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

How the MXU is fed (the weight operand; the activations stay bf16), by the chip's facts
(`perfmodel_kernels.chip`): bf16 as is; int8 codes as bf16 (exact, |code| <= 127: an int8 MXU multiplies
int8 by int8 only, and on the TPU v5e a bf16 x int8 dot left the logits 0.37 of their spread
from the reference's, experiments/results/tpu_megakernel.json); on a chip whose MXU takes fp8
(TPU7x, v6e) fp8 codes as fp8 and 4-bit codes unpacked to fp8 (every int4 and e2m1 value is
exact in e4m3); on one that does not (v5e) both as bf16 (every e4m3, int4 and e2m1 value is
exact in bf16). The 4-bit codes meet a block-diagonal left operand: row block g of the LHS is
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

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from perfmodel.spec.formats import get_format

from . import chip

QUANTISED = ("int8", "fp8", "int4", "int4-g128-f32", "mxfp4", "nvfp4")
INT4 = ("int4", "int4-g128-f32")
E2M1_FORMATS = ("mxfp4", "nvfp4")
FOUR_BIT = INT4 + E2M1_FORMATS
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
FP8 = ml_dtypes.float8_e4m3fn
# storage dtype of each scale dtype (8-bit ones as int8 bit patterns)
SCALE_STORAGE = {"bf16": ml_dtypes.bfloat16, "f32": np.float32, "e8m0": np.int8, "e4m3": np.int8}


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
        return chip.tile_rows(np.dtype(self.scale_dtype)) // self.scale_rows \
            if self.scale_rows else 1

    @property
    def combined(self) -> bool:
        """Scales stored in the codes array (both 8-bit): one DMA per expert."""
        return self.scale_dtype is not None and np.dtype(self.scale_dtype).itemsize == 1 \
            and np.dtype(self.code_dtype).itemsize == 1

    @property
    def global_scale(self) -> bool:
        return self.name == "nvfp4"

    @property
    def word_decode(self) -> bool:
        """mxfp4 fed as bf16 with one scale group a quarter tile (T = 4 x 32, the v5e's 128): the
        kernel builds the weights' bf16 bit patterns with integer ops on 32-bit words, two weights
        a word, each group's power-of-two scale added to their exponents (`_word_decoded`), from
        codes packed for it (`_word_packed`)."""
        return self.name == "mxfp4" and jnp.dtype(self.mxu) == jnp.dtype(jnp.bfloat16) \
            and self.t == 4 * self.group


def tile_format(name: str, t: int, fp8: bool = True) -> TileFormat:
    """Format `name` in tiles of t x t; fp8: whether the chip's MXU takes fp8 operands (else the
    fp8 and 4-bit codes reach it as bf16, every one of their values exact in bf16)."""
    feed = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    if name == "bf16":
        return TileFormat(name, t, ml_dtypes.bfloat16, t, t, None, jnp.bfloat16)
    if name == "int8":
        return TileFormat(name, t, np.int8, t, t, np.float32, jnp.bfloat16)
    if name == "fp8":
        return TileFormat(name, t, FP8, t, t, np.float32, feed)
    f = get_format(name)  # 4-bit: f.block[1] input values per scale
    return TileFormat(name, t, np.int8, t // 2, f.block[1], SCALE_STORAGE[f.scale_dtype], feed)


def feed(fmt: TileFormat) -> str:
    """The dtype the MXU takes the format's weights in: "bf16", "int8" or "fp8"."""
    return {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.int8): "int8",
            jnp.dtype(jnp.float8_e4m3fn): "fp8"}[jnp.dtype(fmt.mxu)]


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

    @property
    def decodes(self) -> bool:
        """Whether the kernel first decodes the codes, scales applied, into a VMEM buffer of bf16
        weights and then runs one dot per column block over all its row tiles: every format the
        MXU takes as bf16 but bf16 itself (whose codes are the operand). On a v5e a dot per
        128 x 128 tile costs ~0.11 us of MXU latency, ~7x a long dot's time per tile."""
        return self.fmt.name != "bf16" and feed(self.fmt) == "bf16"

    @property
    def decode_kind(self) -> str:
        """What the vector unit decodes a weight from when the kernel decodes (`decodes`): "e2m1",
        "int4" or "int8" (fp8 codes widen as int8 do); "" otherwise
        (`perfmodel.cost.components.vpu_decode_time` prices it)."""
        if not self.decodes:
            return ""
        if self.fmt.word_decode:
            return "e2m1_words"
        return "e2m1" if self.fmt.name in E2M1_FORMATS else "int4" if self.fmt.name in INT4 \
            else "int8"

    def column_group(self, m: int) -> int:
        """Column blocks of matrix m decoded per pass: the fewest whose tiles fill whole scale
        chunks (the chunks' scale loads stay aligned), at most the matrix's."""
        r, c = self.shapes[m]
        return min(c, self.fmt.chunk // math.gcd(r, self.fmt.chunk))

    def passes(self, m: int) -> int:
        """Decode passes over matrix m (`column_group` columns a pass)."""
        return -(-self.shapes[m][1] // self.column_group(m))

    def decoded_rows(self) -> int:
        """Rows of the decode buffer [rows, T] bf16 (0 when the kernel does not decode): two
        halves that passes use in turn. On the v5e, a pass decoding into the rows the previous
        pass's dot had just read gave that dot wrong columns (experiments/results/tpu_v5e/
        calls_2026-12-07_*.log)."""
        return 2 * max(self.column_group(m) * r for m, (r, _) in enumerate(self.shapes)) \
            * self.fmt.t if self.decodes else 0


def quantize(w, name: str, t: int):
    """w [..., d_in, d_out] -> (codes [..., d_in, d_out] before packing: int8, fp8, or 4-bit
    codes 0..15 in uint8; scales [..., ceil(d_in / group), d_out] in their storage dtype
    (per-channel formats: one row); the f32 global scale [...] (nvfp4) or ones). numpy in,
    numpy out; `quantize_jax` does the work (vectorised over the leading axes)."""
    codes, s, glob = quantize_jax(jnp.asarray(w, jnp.float32), name, t)
    codes = np.asarray(codes)
    s = np.asarray(s)
    if name in FOUR_BIT:
        codes = codes.astype(np.uint8)
    storage = SCALE_STORAGE.get(get_format(name).scale_dtype) if name in FOUR_BIT else np.float32
    glob = np.asarray(glob)
    return codes, s.astype(storage), (float(glob) if glob.ndim == 0 else glob)


def _bits_int8(x):
    """Values 0..255 (int32) as int8 bit patterns."""
    return lax.bitcast_convert_type(x.astype(jnp.uint8), jnp.int8)


@functools.partial(jax.jit, static_argnames=("name", "t"))
def quantize_jax(w, name: str, t: int):
    """`quantize` in JAX: w [..., d_in, d_out] f32 -> (codes, scales, global scale [...]); 4-bit
    codes as int32 0..15, 8-bit scales as int8 bit patterns."""
    fmt = tile_format(name, t)
    *lead, d_in, d_out = w.shape
    g = fmt.group if fmt.group < t else d_in
    rows = math.ceil(d_in / g) * g
    wp = jnp.pad(w, [(0, 0)] * len(lead) + [(0, rows - d_in), (0, 0)])
    blocks = wp.reshape(*lead, rows // g, g, d_out)
    amax = jnp.abs(blocks).max(axis=-2)
    glob = jnp.ones(lead, jnp.float32)
    if name == "int8":
        s = jnp.where(amax > 0, amax / 127, 1).astype(jnp.float32)
        codes = jnp.clip(jnp.rint(blocks / s[..., None, :]), -127, 127).astype(jnp.int8)
    elif name == "fp8":
        s = jnp.where(amax > 0, amax / 448, 1).astype(jnp.float32)
        codes = (blocks / s[..., None, :]).astype(jnp.float8_e4m3fn)
    elif name in INT4:
        s = jnp.where(amax > 0, amax / 7, 1)
        if jnp.dtype(fmt.scale_dtype) == jnp.dtype(jnp.bfloat16):
            # rounded to bf16 before the codes are taken from it: XLA may elide a plain cast
            # (excess precision; on the TPU v5e the codes came from the unrounded scale, the
            # products 2 % off the stored scale's: experiments/tpu_decode_probe.py)
            s = lax.reduce_precision(s, exponent_bits=8, mantissa_bits=7)
        codes = jnp.clip(jnp.rint(blocks / s[..., None, :]), -8, 7)
        s = s.astype(fmt.scale_dtype)
        codes = codes.astype(jnp.int32) & 0xF
    else:
        if name == "mxfp4":
            k = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))).astype(jnp.int32) - 2
            # e8m0 bits 2..252: every scaled e2m1 value a normal bf16 below its infinity
            # (what `_word_decoded` builds; a block that needs more is 2^+-123 off from 1)
            s = _bits_int8(jnp.clip(k, -125, 125) + 127)
        else:  # nvfp4
            top = jnp.abs(w).max(axis=(-2, -1))
            glob = jnp.where(top > 0, top / (6 * 448), 1.0)
            gb = glob[..., None, None]
            s = lax.bitcast_convert_type(
                jnp.where(amax > 0, amax / 6 / gb, 1.0).astype(jnp.float8_e4m3fn), jnp.int8)
        x = blocks / (_scale(s, name) * glob[..., None, None])[..., None, :]
        # the nearest e2m1 magnitude (ties to the smaller), by its midpoints
        idx = (jnp.abs(x)[..., None] > jnp.asarray(E2M1_MIDPOINTS)).sum(-1).astype(jnp.int32)
        codes = idx | jnp.where(x < 0, 8, 0)
    return codes.reshape(*lead, rows, d_out)[..., :d_in, :], s, glob


def dequantize(codes, scales, name: str, t: int, glob=1.0) -> np.ndarray:
    """The f32 values the codes stand for, [..., d_in, d_out] (before any rounding to bf16);
    numpy in, numpy out (`dequantize_jax`)."""
    codes = jnp.asarray(codes.astype(np.int32) if name in FOUR_BIT else codes)
    return np.asarray(dequantize_jax(codes, jnp.asarray(scales), name, t,
                                     jnp.asarray(glob, jnp.float32)))


@functools.partial(jax.jit, static_argnames=("name", "t"))
def dequantize_jax(codes, scales, name: str, t: int, glob):
    """`dequantize` in JAX, over any leading axes (glob: one global scale per leading index)."""
    fmt = tile_format(name, t)
    *lead, d_in, d_out = codes.shape
    n_g = scales.shape[-2]
    g = fmt.group if n_g > 1 or fmt.group < t else max(d_in, 1)
    c = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, n_g * g - d_in), (0, 0)])
    v = _values(c, name).reshape(*lead, n_g, g, d_out) * _scale(scales, name)[..., None, :]
    v = v * jnp.reshape(glob, jnp.shape(glob) + (1, 1, 1))
    return v.reshape(*lead, n_g * g, d_out)[..., :d_in, :]


@functools.partial(jax.jit, static_argnames=("name", "t"))
def round_trip_jax(w, name: str, t: int):
    """The f32 values w [..., d_in, d_out] stands for once stored in format `name`."""
    codes, scales, glob = quantize_jax(w.astype(jnp.float32), name, t)
    return dequantize_jax(codes, scales, name, t, glob)


def _values(codes, name):
    """Code values as f32 (4-bit codes 0..15 as int; in the kernel and in `dequantize_jax`)."""
    if name in ("int8", "fp8"):
        return codes.astype(jnp.float32)
    n = codes.astype(jnp.int32)
    if name in INT4:
        return jnp.where(n >= 8, n - 16, n).astype(jnp.float32)
    e, m = (n >> 1) & 3, (n & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m,
                    (1.0 + 0.5 * m) * (1 << jnp.maximum(e - 1, 0)).astype(jnp.float32))
    return jnp.where(n >= 8, -mag, mag)


def _scale(scales, name):
    """Scales in their storage dtype -> f32."""
    if name == "mxfp4":   # e8m0 bits k: 2^(k - 127)
        return lax.bitcast_convert_type((scales.astype(jnp.int32) & 0xFF) << 23, jnp.float32)
    if name == "nvfp4":   # e4m3 bits
        return lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    return scales.astype(jnp.float32)


def expert_layout(name: str, t: int, matrices: list[tuple[int, int]],
                  fp8: bool = True) -> ExpertLayout:
    """The layout of an expert whose matrices are [d_in, d_out] (in order); fp8: the chip's MXU
    takes fp8 (`tile_format`)."""
    return ExpertLayout(tile_format(name, t, fp8),
                        tuple((math.ceil(i / t), math.ceil(o / t)) for i, o in matrices))


def pack_expert(lay: ExpertLayout, mats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None,
                                                                     list[float]]:
    """One expert's (codes array, scales array or None, global scale per matrix) in the layout,
    as numpy (`pack_experts`)."""
    codes, scales, globs = pack_experts(lay, [jnp.asarray(m, jnp.float32)[None] for m in mats])
    return (np.asarray(codes[0]), None if scales is None else np.asarray(scales[0]),
            [float(g) for g in np.asarray(globs[0])])


@functools.partial(jax.jit, static_argnames=("lay",))
def pack_experts(lay: ExpertLayout, mats: list):
    """Experts in the layout, all at once (JAX: on an accelerator when there is one): mats, per
    matrix [E, d_in, d_out] -> (codes [E, rows[0], T], scales [E, rows[1], T] or None (8-bit
    scales share the codes array), global scales [E, matrices] f32)."""
    f, t = lay.fmt, lay.fmt.t
    codes, scales, globs = [], [], []
    for w, (r, c) in zip(mats, lay.shapes):
        e, d_in, d_out = w.shape
        if f.name == "bf16":
            cw, s, glob = w.astype(jnp.bfloat16), None, jnp.ones((e,), jnp.float32)
        else:
            cw, s, glob = quantize_jax(w.astype(jnp.float32), f.name, t)
        globs.append(glob)
        full = jnp.pad(cw, ((0, 0), (0, r * t - d_in), (0, c * t - d_out)))
        tiles = full.reshape(e, r, t, c, t).transpose(0, 3, 1, 2, 4).reshape(e, c * r, t, t)
        if f.word_decode:
            tiles = _word_packed(tiles, t)
        elif f.name in FOUR_BIT:   # two codes a byte: row i low nibble, row i + T/2 high
            tiles = _bits_int8(tiles[:, :, :t // 2] | (tiles[:, :, t // 2:] << 4))
        codes.append(tiles.reshape(e, -1, t).astype(f.code_dtype))
        if f.scale_rows:
            g = f.scale_rows
            per = jnp.repeat(s, r, axis=1) if f.group >= t else s   # per-channel: each row tile
            sp = jnp.pad(per, ((0, 0), (0, r * g - per.shape[1]), (0, c * t - per.shape[2])),
                         constant_values=127 if f.name == "mxfp4" else 1)
            st = sp.reshape(e, r, g, c, t).transpose(0, 3, 1, 2, 4).reshape(e, c * r * g, t)
            chunked = math.ceil(r * c / f.chunk) * f.chunk * g   # whole chunks of tiles
            scales.append(jnp.pad(st, ((0, 0), (0, chunked - c * r * g), (0, 0))))
    codes = jnp.concatenate(codes, axis=1)
    scales = jnp.concatenate(scales, axis=1).astype(f.scale_dtype) if scales else None
    globs = jnp.stack(globs, axis=1)
    if f.combined:
        return jnp.concatenate([codes, scales], axis=1), None, globs
    return codes, scales, globs


def _word_packed(tiles, t: int):
    """e2m1 code tiles [E, n, T, T] (int32 0..15) -> [E, n, T/2, T] int8 for `_word_decoded`.
    Each code's magnitude becomes q, its step above half the scale in bf16's (exponent, top
    mantissa bit): 0.5 -> 0, 1 -> 2, 1.5 -> 3, ..., 6 -> 7, and zero the unused q = 1 (the
    magnitude's low bit flipped below 2). Weight row 32 k + 2 c + p (k < 4 the tile's scale
    group, c < T/8, p < 2) goes to bits 4 k + 16 p of the 32-bit word c the kernel reads: byte
    2 p + k // 2 of it, nibble k % 2."""
    e, n = tiles.shape[:2]
    c = tiles ^ ((tiles & 7) < 2).astype(tiles.dtype)
    x = c.reshape(e, n, 2, 2, t // 8, 2, t)          # rows (k // 2, k % 2, c, p)
    b = x[:, :, :, 0] | (x[:, :, :, 1] << 4)         # [E, n, k // 2, c, p, T]
    return _bits_int8(b.transpose(0, 1, 3, 4, 2, 5).reshape(e, n, t // 2, t))


def dequantized_weights(weights, name: str, t: int = 256):
    """The reference's weights with every routed expert replaced by its dequantised `name`
    values in bf16 (code * scale in f32, rounded once); t only sets per-channel scale rows."""
    from . import reference
    layers = []
    for lw in weights["layers"]:
        lw = dict(lw)
        for k in EXPERT_KEYS:
            if k in lw:
                lw[k] = dequantized_experts(lw[k], name, t)
        layers.append(lw)
    return reference.Weights(dict(weights.params, layers=layers), weights.static)


EXPERT_KEYS = ("expert_gate_up", "expert_down")


def dequantized_experts(w, name: str, t: int = 256, chunk: int = 16):
    """Experts [E, d_in, d_out] -> their dequantised `name` values in bf16, `chunk` experts at
    a time (bounded f32 temporaries on the device)."""
    w = jnp.asarray(w)
    return jnp.concatenate([round_trip_jax(w[e:e + chunk], name, t).astype(jnp.bfloat16)
                            for e in range(0, w.shape[0], chunk)])


def round_trip(w: np.ndarray, name: str, t: int) -> np.ndarray:
    """The f32 values `w` stands for once stored in format `name` (numpy)."""
    return np.asarray(round_trip_jax(jnp.asarray(w, jnp.float32), name, t))


# ----- in the kernel ----------------------------------------------------------------------------

def mxu_operand(codes, fmt: TileFormat):
    """A tile's codes [code_rows, T] -> the MXU weight operand [T, T] in `fmt.mxu` (bf16, int8
    or fp8), unscaled (`group_dot` applies the scales)."""
    return _decoded(codes, fmt).astype(fmt.mxu) if fmt.name in FOUR_BIT \
        else codes.astype(fmt.mxu)


def decoded_tile(codes, scale_chunk, u: int, fmt: TileFormat):
    """Tile u of a loaded scale chunk: its codes [code_rows, T] -> the bf16 weights [T, T] with
    their scales (a format the MXU takes as bf16, `ExpertLayout.decodes`)."""
    if fmt.word_decode:
        g = fmt.scale_rows
        return _word_decoded(codes, (scale_chunk.astype(jnp.int32) & 0xFF)[u * g:(u + 1) * g], fmt)
    return scaled_operand(codes, tile_scales(scale_chunk, u, fmt), fmt)


# 32-bit words of two bf16 halves: masks a half (low | high << 16) and the two sign bits
_HALVES_Q, _HALVES_ONE, _SIGNS = 0x00070007, 0x00010001, -0x7FFF8000   # -0x7FFF8000: 0x80008000


def _word_decoded(codes, exps, fmt: TileFormat):
    """mxfp4 codes [T/2, T] int8 (`_word_packed`) and the e8m0 bits [4, T] int32 of the tile's
    four scale groups -> the weights [T, T] bf16, built as bit patterns two a 32-bit word: half
    = sign << 15 | ((q << 6) + ((e - 1) << 7) where the code is not zero), about a dozen integer
    ops a word for two weights where `scaled_operand` spends as many a weight in f32."""
    w = pltpu.bitcast(codes, jnp.int32)                        # [T/8, T]: 8 codes a word
    # bit 3 of each nibble: its q is not 1 (zero): (q ^ 1) + 7 carries into bit 3 unless q == 1
    nonzero = (((w & 0x77777777) ^ 0x11111111) + 0x77777777) & -0x77777778   # & 0x88888888
    out = []
    for k in range(4):                                          # scale group k: rows 32k..32k+31
        q = (w >> 4 * k) & _HALVES_Q
        nz = (nonzero >> (4 * k + 3)) & _HALVES_ONE
        half = (exps[k:k + 1] - 1) << 7
        bits = ((q << 6) + (half | (half << 16))) & ((nz << 15) - nz)
        out.append(bits | ((w << (12 - 4 * k)) & _SIGNS))
    return pltpu.bitcast(jnp.concatenate(out, axis=0), jnp.bfloat16)


def scaled_operand(codes, scales, fmt: TileFormat):
    """A tile's codes [code_rows, T] and its scales [G, T] f32 (`tile_scales`) -> the weights
    [T, T] bf16, each row group times its scales (exact in bf16 for 8- and 4-bit float codes;
    rounded as the reference's dequantised bf16 weights are for the integer formats)."""
    g, t = fmt.scale_rows, fmt.t
    w = _decoded(codes, fmt).reshape(g, t // g, t) * scales[:, None, :]
    return w.reshape(t, t).astype(jnp.bfloat16)


def _decoded(codes, fmt: TileFormat):
    """Codes [code_rows, T] -> their values [T, T] f32, on the vector unit in few 32-bit ops a
    weight (their cost bounds the expert path on chips that feed them as bf16): int4 by
    sign-extending shifts, e2m1 as twice its value (`_twice_e2m1`; `tile_scales` takes the
    half back)."""
    if fmt.name not in FOUR_BIT:
        return codes.astype(jnp.float32)
    n = codes.astype(jnp.int32)                       # the byte, sign-extended: hi nibble at 4..7
    if fmt.name in INT4:
        return jnp.concatenate([(n << 28) >> 28, n >> 4], axis=0).astype(jnp.float32)
    return _twice_e2m1(jnp.concatenate([n & 0xF, (n >> 4) & 0xF], axis=0))


def _twice_e2m1(c):
    """e2m1 codes (int32 0..15) -> 2 x their value as f32, exactly, in nine vector ops: the
    magnitude bits c & 7 = (e, m) shifted into an f32's exponent and top mantissa bit over a
    bias of 127 are 2^e (1 + m / 2) = 2 x value for e >= 1; for e = 0 twice the value is c & 7
    itself (0 or 1); the sign bit moves to bit 31."""
    mag = c & 7
    normal = lax.bitcast_convert_type((mag << 22) + (127 << 23), jnp.float32)
    twice = jnp.where(mag < 2, mag.astype(jnp.float32), normal)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(twice, jnp.int32) | ((c & 8) << 28),
                                    jnp.float32)


def tile_scales(scale_chunk, u: int, fmt: TileFormat):
    """Scale rows [G, T] f32 of tile u of a loaded chunk [chunk * G, T] (storage dtype); for
    e2m1 formats halved, as `mxu_operand` feeds twice the code values."""
    g = fmt.scale_rows
    s = _scale(scale_chunk, fmt.name)[u * g:(u + 1) * g]
    return s * 0.5 if fmt.name in E2M1_FORMATS else s


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
