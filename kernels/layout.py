"""The megakernel's configuration and how weights are packed into uniform HBM tiles.

Static weights (every matmul except the routed experts, plus the lm_head) are packed, in the
order the kernel consumes them, into one array [n_tiles, T, T] of square bf16 tiles; a matmul
[d_in, d_out] is zero-padded to multiples of T and cut into ceil(d_out/T) column blocks of
ceil(d_in/T) row tiles each (column block outer), so the kernel accumulates one output block
over its row tiles. Layers of the same kind have identical tile blocks, so the stream is a stack
of per-layer blocks: the kernel's layer loop finds a layer's block from its first tile (the
layer table, `layer_table`) and each matmul at a static offset inside it (`layer_tiles`).
Routed experts are packed per MoE layer as [E, tiles_per_expert, T, T] (gate_up tiles then down
tiles). The small per-layer vectors (RMSNorm weights, conv taps, decay constants, latent norms,
router selection bias) are packed as rows of 128 lanes into [n_layers + 1, vector_rows, 128]
(the last entry holds the final norm); the router bias sits at the same row in every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from perfmodel.spec.arch import Layer, Matmul, ModelSpec
from perfmodel.util.errors import positive_int, require

from . import quant, reference

LANES = 128
SUBLANES = 8
BF16_SUBLANES = 16  # rows of a packed bf16 (16, 128) tile


@dataclass(frozen=True)
class KernelConfig:
    """batch: real sequences (padded to a multiple of 8 rows in the kernel); max_context: MLA
    cache capacity in tokens; depth: VMEM ring banks for static weights (one tile each);
    tile: edge T of a square bf16 weight tile (bank bytes = 2*T*T), a multiple of the MXU width
    (`vmem.check_vmem` checks it against the chip); expert_slots: VMEM slots for routed
    experts; cache_block: tokens per MLA cache tile (one DMA; 3 tile buffers in VMEM);
    hierarchical: all-reduce with the sibling TensorCore first (`kernels.comm`); rows: verify
    rows per sequence (a draft block, causal within the block; `reference.verify_inputs`)."""
    batch: int
    max_context: int = 256
    depth: int = 4
    tile: int = 256
    expert_slots: int = 2
    cache_block: int = 256
    hierarchical: bool = False
    rows: int = 1

    def __post_init__(self):
        for name in ("batch", "max_context", "depth", "tile", "expert_slots", "cache_block",
                     "rows"):
            positive_int(name, getattr(self, name))
        require(self.rows <= reference.MAX_ROWS, "rows", self.rows,
                f"must be <= {reference.MAX_ROWS} (a draft block)")
        require(self.tile % LANES == 0, "tile", self.tile, f"must be a multiple of {LANES} lanes")
        require(self.max_context % self.cache_block == 0, "max_context", self.max_context,
                f"must be a multiple of cache_block ({self.cache_block})")

    @property
    def token_rows(self) -> int:
        """Rows the kernel processes: row r of sequence b at r * batch + b."""
        return self.batch * self.rows

    @property
    def padded_batch(self) -> int:
        """Token rows padded to whole sublane tiles."""
        return -(-self.token_rows // SUBLANES) * SUBLANES

    @property
    def bank_bytes(self) -> int:
        return 2 * self.tile * self.tile


def check_kernel_spec(spec: ModelSpec, cfg: KernelConfig) -> None:
    """Refuse specs and configs the megakernel cannot run (clear SpecError)."""
    reference.check_spec(spec)
    if spec.count(ffn="moe"):
        require(cfg.expert_slots <= spec.moe.top_k * cfg.token_rows, "expert_slots",
                cfg.expert_slots, "more slots than experts a step can pick "
                f"(top_k*batch*rows = {spec.moe.top_k * cfg.token_rows})")
    for fam, fmt in spec.formats.items():
        want = ("f32",) if fam == "state" else ("bf16",)
        if fam == "routed_expert":
            want += quant.QUANTISED
        if fam in ("activation",):
            continue
        require(fmt.name in want, f"formats.{fam}", fmt.name,
                f"the megakernel stores {fam} as {' or '.join(want)}")


@dataclass(frozen=True)
class TiledMatmul:
    """A matmul's place in the static tile stream."""
    layer: int          # 1-based; n_layers + 1 for the lm_head
    mm: Matmul
    rows: int           # row tiles (ceil(d_in / T))
    cols: int           # column blocks (ceil(d_out / T))
    first: int          # index of its first tile in the stream

    @property
    def tiles(self) -> int:
        return self.rows * self.cols


def tiles_of(mm: Matmul, t: int) -> tuple[int, int]:
    return math.ceil(mm.d_in / t), math.ceil(mm.d_out / t)


def static_matmuls(spec: ModelSpec, layer: Layer) -> list[Matmul]:
    """A layer's static matmuls in the kernel's consumption order."""
    return [mm for mm in spec.layer_matmuls(layer) if mm.family != "routed_expert"]


def tp_of(spec: ModelSpec) -> int:
    """Devices the spec's shapes are split over (a `shard.DeviceSpec`), else 1."""
    return getattr(spec, "tp", 1)


def lm_head_matmul(spec: ModelSpec) -> Matmul:
    """The lm_head (a vocabulary shard on each of tp devices)."""
    return Matmul("lm_head", "lm_head", spec.hidden, spec.vocab // tp_of(spec))


def static_stream(spec: ModelSpec, cfg: KernelConfig) -> list[TiledMatmul]:
    """Every static matmul, in stream order, with its tile range."""
    out, first = [], 0
    entries = [(l.index, mm) for l in spec.layers for mm in static_matmuls(spec, l)]
    entries.append((len(spec.layers) + 1, lm_head_matmul(spec)))
    for layer, mm in entries:
        r, c = tiles_of(mm, cfg.tile)
        out.append(TiledMatmul(layer, mm, r, c, first))
        first += r * c
    return out


def expert_matmuls(spec: ModelSpec) -> list[Matmul]:
    return [mm for mm in spec.ffn_matmuls("moe") if mm.family == "routed_expert"]


def max_row_col_tiles(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int]:
    """The most row tiles and column blocks of any matmul the kernel runs (its VMEM scratch
    for a matmul's input row tiles and output column blocks)."""
    shapes = [(tm.rows, tm.cols) for tm in static_stream(spec, cfg)]
    shapes += [tiles_of(mm, cfg.tile) for mm in expert_matmuls(spec)] if spec.moe else []
    return max(r for r, _ in shapes), max(c for _, c in shapes)


def expert_format(spec: ModelSpec, cfg: KernelConfig) -> quant.TileFormat:
    """How a routed-expert tile is stored (bf16: codes are the weights, no scales)."""
    name = spec.formats["routed_expert"].name
    if name in quant.QUANTISED:
        return quant.tile_format(name, cfg.tile)
    return quant.TileFormat("bf16", cfg.tile, jnp.bfloat16, cfg.tile, cfg.tile, None)


def expert_bytes(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int]:
    """(code bytes, scale bytes) of one routed expert as the kernel fetches it."""
    f, tpe = expert_format(spec, cfg), tiles_per_expert(spec, cfg)
    codes = tpe * f.code_rows * cfg.tile * np.dtype(f.code_dtype).itemsize
    scales = 0 if f.scale_dtype is None else \
        tpe * (cfg.tile // f.group) * cfg.tile * np.dtype(f.scale_dtype).itemsize
    return codes, scales


def tiles_per_expert(spec: ModelSpec, cfg: KernelConfig) -> int:
    return sum(r * c for r, c in (tiles_of(mm, cfg.tile) for mm in expert_matmuls(spec)))


def _tile_matrix(w: np.ndarray, t: int) -> np.ndarray:
    """[d_in, d_out] -> [cols*rows, T, T], column block outer, zero-padded."""
    r, c = math.ceil(w.shape[0] / t), math.ceil(w.shape[1] / t)
    p = np.zeros((r * t, c * t), w.dtype)
    p[:w.shape[0], :w.shape[1]] = w
    return p.reshape(r, t, c, t).transpose(2, 0, 1, 3).reshape(c * r, t, t)


# ----- small vectors ------------------------------------------------------------------------------

# columns of the layer table (int32 [n_layers, 6], in SMEM): attention kind (0 KDA, 1 MLA), FFN
# kind (0 dense, 1 MoE), ordinal among layers of the same attention kind (cache slot), ordinal
# among MoE layers, first static tile of the layer, first static tile of its FFN part
ATT, FFN, ATT_ORD, MOE_ORD, FIRST, FFN_FIRST = range(6)
ATTENTION_IDS, FFN_IDS = {"kda": 0, "mla": 1}, {"dense": 0, "moe": 1}


def layer_tiles(spec: ModelSpec, cfg: KernelConfig, attention: str | None, ffn: str | None
                ) -> dict[str, tuple[int, int, int]]:
    """name -> (first tile relative to the attention (or FFN) part, rows, cols) of the matmuls
    of one attention kind or one FFN kind (give one of the two)."""
    mms = spec.attention_matmuls(attention) if attention else \
        [mm for mm in spec.ffn_matmuls(ffn) if mm.family != "routed_expert"]
    out, first = {}, 0
    for mm in mms:
        r, c = tiles_of(mm, cfg.tile)
        out[mm.name] = (first, r, c)
        first += r * c
    return out


def layer_table(spec: ModelSpec, cfg: KernelConfig) -> np.ndarray:
    """The layer loop's per-layer scalars (columns ATT .. FFN_FIRST), int32 [n_layers, 6]."""
    rows, first = [], 0
    for layer in spec.layers:
        att = sum(r * c for _, r, c in layer_tiles(spec, cfg, layer.attention, None).values())
        ffn = sum(r * c for _, r, c in layer_tiles(spec, cfg, None, layer.ffn).values())
        rows.append([ATTENTION_IDS[layer.attention], FFN_IDS[layer.ffn],
                     reference.kind_ordinal(spec, layer),
                     sum(1 for l in spec.layers[:layer.index - 1] if l.ffn == "moe"),
                     first, first + att])
        first += att + ffn
    return np.asarray(rows, np.int32)


def _rows(n: int) -> int:
    return math.ceil(n / LANES)


def _pad16(n: int) -> int:
    return -(-n // BF16_SUBLANES) * BF16_SUBLANES


def _attention_rows(spec: ModelSpec, attention: str) -> int:
    shapes = reference.small_param_shapes(spec, Layer(1, attention, "dense"))
    return _pad16(sum(_shape_rows(s) for s in shapes.values()))


def _shape_rows(shape: tuple) -> int:
    return shape[0] * _rows(shape[1]) if len(shape) == 2 else _rows(shape[0])


def router_row(spec: ModelSpec) -> int:
    """The row of the router bias in every layer's vector block (after the longest attention
    block, so that the layer loop reads it at a static row)."""
    return max(_attention_rows(spec, l.attention) for l in spec.layers)


def vector_layout(spec: ModelSpec, layer: Layer | None) -> dict[str, tuple[int, int, tuple]]:
    """name -> (first row, rows, shape) of a layer's small vectors (layer None: final norm).
    Attention-family vectors come first (the two RMSNorm weights at rows shared by all kinds);
    the router bias starts at `router_row`."""
    shapes = {"final_norm": (spec.hidden,)} if layer is None else \
        reference.small_param_shapes(spec, layer)
    out, row = {}, 0
    for name, shape in shapes.items():
        if name == "router_bias":
            row = router_row(spec)
        n = _shape_rows(shape)
        out[name] = (row, n, shape)
        row += n
    return out


def vector_copies(spec: ModelSpec, layer: Layer | None) -> list[tuple[str, int, int]]:
    """(family, first row, rows) of the DMAs that bring a layer's vectors on chip."""
    lay = vector_layout(spec, layer)
    att_end = max(r + n for name, (r, n, _) in lay.items() if name != "router_bias")
    out = [("attention", 0, _pad16(att_end))]
    if "router_bias" in lay:
        r, n, _ = lay["router_bias"]
        out.append(("router", r, _pad16(n)))
    return out


def vector_rows(spec: ModelSpec) -> int:
    return max(r + n for l in (*spec.layers, None) for _, r, n in vector_copies(spec, l))


# ----- packing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packed:
    """Weights laid out for the megakernel (all arrays in HBM)."""
    embed: object      # [V, 1, H/tp] bf16 (one row per token id)
    static: object     # [n_tiles, T, T] bf16
    experts: object    # [n_moe_layers, E/groups, tiles_per_expert, code_rows, T] codes (bf16:
    #                    the weights; a zero tile if no MoE)
    vectors: object    # [n_layers + 1, vector_rows, 128] bf16
    expert_scales: object = None  # [n_moe_layers, E/groups, tiles_per_expert, T/group, T]


def pack_weights(weights: reference.Weights, cfg: KernelConfig) -> Packed:
    """Pack reference weights (bf16) into the megakernel's tile layout."""
    spec = weights.spec
    check_kernel_spec(spec, cfg)
    t = cfg.tile
    np_ = lambda a: np.asarray(a)
    layers = weights["layers"]
    tiles = []
    for tm in static_stream(spec, cfg):
        w = weights["lm_head"] if tm.mm.name == "lm_head" else layers[tm.layer - 1][tm.mm.name]
        tiles.append(_tile_matrix(np_(w), t))
    experts, scales = [], []
    fmt = expert_format(spec, cfg).name if spec.moe else "bf16"
    for layer, lw in zip(spec.layers, layers):
        if layer.ffn == "moe":
            per_e, per_s = [], []
            for e in range(lw[expert_matmuls(spec)[0].name].shape[0]):
                cs, ss = [], []
                for mm in expert_matmuls(spec):
                    w = np_(lw[mm.name][e])
                    if fmt == "bf16":
                        cs.append(_tile_matrix(w, t))
                        continue
                    c, s = quant.quantize(w.astype(np.float32), fmt, t)
                    cs.append(quant.tile_codes(c, fmt, t))
                    ss.append(quant.tile_scales(s, fmt, t, w.shape[1]))
                per_e.append(np.concatenate(cs))
                per_s.append(np.concatenate(ss) if ss else None)
            experts.append(np.stack(per_e))
            scales.append(None if fmt == "bf16" else np.stack(per_s))
    tpe = tiles_per_expert(spec, cfg) if spec.moe else 1
    experts = np.stack(experts) if experts else np.zeros((1, 1, tpe, t, t), jnp.bfloat16)
    vr = vector_rows(spec)
    vec = np.zeros((len(spec.layers) + 1, vr, LANES), jnp.bfloat16)
    for i, layer in enumerate((*spec.layers, None)):
        src = {"final_norm": weights["final_norm"]} if layer is None else layers[i]
        for name, (r, n, shape) in vector_layout(spec, layer).items():
            v = np_(src[name]).reshape(-1, shape[-1]) if len(shape) == 2 else np_(src[name])[None]
            block = np.zeros((v.shape[0], _rows(shape[-1]) * LANES), vec.dtype)
            block[:, :shape[-1]] = v
            vec[i, r:r + n] = block.reshape(n, LANES)
    return Packed(embed=jnp.asarray(weights["embed"]).reshape(spec.vocab, 1, -1),
                  static=jnp.asarray(np.concatenate(tiles)), experts=jnp.asarray(experts),
                  vectors=jnp.asarray(vec),
                  expert_scales=jnp.asarray(np.stack(scales)) if fmt != "bf16" else None)


def unpack_vector(vrows, layout_entry):
    """Rows of a loaded vector block -> the vector(s) [n] or [W, C] as f32."""
    r, n, shape = layout_entry
    block = vrows[r:r + n].astype(jnp.float32)
    if len(shape) == 2:
        return block.reshape(shape[0], -1)[:, :shape[1]]
    return block.reshape(1, -1)[:, :shape[0]]


jax.tree_util.register_dataclass(
    Packed, data_fields=["embed", "static", "experts", "vectors", "expert_scales"],
    meta_fields=[])
