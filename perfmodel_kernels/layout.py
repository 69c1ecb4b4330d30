"""The megakernel's configuration and how weights are laid out in HBM.

Static weights (every matmul except the routed experts, plus the lm_head) form one stream of
bf16 rows [rows, T], cut into ring banks: `perfmodel_kernels.stream`. Routed experts are packed per MoE
layer as [E, rows, T] arrays of codes (and scales): `perfmodel_kernels.quant`. The small per-layer vectors
(RMSNorm weights, conv taps, decay constants, latent norms, router selection bias) are packed
as rows of 128 lanes into [n_layers + 1, vector_rows, 128] (the last entry holds the final
norm); the router bias sits at the same row in every layer. The embedding table is 2-D
[embed_rows, H/tp] bf16, the kernel copying the whole bf16 tile that holds a token's row: as
[V, 1, H/tp] (a row copy on an untiled dimension) XLA relaid the whole table out before every
call (349.5 us a call on a v5e for the 5120 x 7168 table of Kimi K3's TP32 slice).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from perfmodel.spec.arch import Layer, Matmul, ModelSpec
from perfmodel.util.errors import positive_int, require

from . import chip as chip_mod, quant, reference, stream

LANES = chip_mod.LANES
MAX_BATCH = 256     # sequences a kernel is built for (its per-sequence code is unrolled)
PACK_BYTES = 512 << 20  # f32 temporaries of the experts quantised and packed at once (at most 16):
PACK_EXPERTS = 16       # whole K3 experts (33 M weights) 3 at a time, a quarter's 15 (a TP8 chip's
                        # slice ran out of HBM packing 16 whole experts beside its bf16 copy)


@dataclass(frozen=True)
class KernelConfig:
    """batch: real sequences (padded to a multiple of 8 rows in the kernel); max_context: MLA
    cache capacity in tokens; depth: VMEM ring banks for static weights; bank_rows: rows of one
    bank ([bank_rows, tile] bf16, one DMA each); tile: the stream's lane width and the edge of a
    routed-expert tile, a multiple of the MXU width (default the chip's MXU width;
    `vmem.check_vmem` checks it); expert_slots: VMEM slots for routed experts; cache_block: tokens per MLA cache tile
    (one DMA; 3 tile buffers in VMEM); hierarchical: all-reduce with the sibling TensorCore
    first (`perfmodel_kernels.comm`); rows: verify rows per sequence (a draft block, causal within the
    block; `reference.verify_inputs`); host_devices: mesh devices per host for the two-level
    one-shot all-reduce (0: all devices on one host); wire: the dtype reductions travel in
    between devices ("f32" exact, "bf16" half the bytes; `perfmodel_kernels.comm`); chip: the TPU the
    kernel is built for (`perfmodel_kernels.chip`; default the attached one, else TPU7x): its MXU width,
    VMEM and the dtypes its MXU takes."""
    batch: int
    max_context: int = 256
    depth: int = 4
    tile: int = 0
    expert_slots: int = 2
    cache_block: int = 256
    hierarchical: bool = False
    rows: int = 1
    bank_rows: int = 1024
    host_devices: int = 0
    wire: str = "f32"
    chip: str = ""

    def __post_init__(self):
        if not self.chip:
            object.__setattr__(self, "chip", chip_mod.chip().version)
        if not self.tile:
            object.__setattr__(self, "tile", self.target.mxu)
        for name in ("batch", "max_context", "depth", "tile", "expert_slots", "cache_block",
                     "rows", "bank_rows"):
            positive_int(name, getattr(self, name))
        require(self.rows <= reference.MAX_ROWS, "rows", self.rows,
                f"must be <= {reference.MAX_ROWS} (a draft block)")
        require(self.batch <= MAX_BATCH, "batch", self.batch,
                f"must be <= {MAX_BATCH}: the kernel's per-sequence attention code is unrolled, "
                "so its trace grows with the batch")
        require(self.tile % LANES == 0, "tile", self.tile, f"must be a multiple of {LANES} lanes")
        require(self.bank_rows % stream.SPLIT == 0 and self.bank_rows >= self.tile, "bank_rows",
                self.bank_rows, f"must be a multiple of {stream.SPLIT} and at least the tile "
                f"({self.tile})")
        require(self.max_context % self.cache_block == 0, "max_context", self.max_context,
                f"must be a multiple of cache_block ({self.cache_block})")
        require(self.cache_block % stream.ROW_TILE == 0, "cache_block", self.cache_block,
                f"must be a multiple of {stream.ROW_TILE} tokens (a bf16 tile's rows)")
        require(self.max_context >= cache_window(self), "max_context", self.max_context,
                f"must hold the {cache_window(self)} rows a step patches")
        require(self.host_devices >= 0, "host_devices", self.host_devices, "must be >= 0")
        require(self.wire in ("f32", "bf16"), "wire", self.wire, "must be f32 or bf16")

    @property
    def target(self) -> chip_mod.Chip:
        """The chip the kernel is built for (`perfmodel_kernels.chip`)."""
        return chip_mod.chip(self.chip)

    @property
    def token_rows(self) -> int:
        """Rows the kernel processes: row r of sequence b at r * batch + b."""
        return self.batch * self.rows

    @property
    def padded_batch(self) -> int:
        """Token rows padded to whole sublane tiles."""
        return chip_mod.round_rows(self.token_rows, jnp.float32)

    @property
    def bank_bytes(self) -> int:
        return 2 * self.bank_rows * self.tile


def embed_rows(spec: ModelSpec) -> int:
    """Rows of the packed embedding table: the vocabulary padded to whole bf16 tiles."""
    return stream.pad16(spec.vocab)


def cache_window(cfg: KernelConfig) -> int:
    """Rows of the MLA cache a step reads, patches and writes back per sequence: the whole bf16
    tiles (`stream.ROW_TILE` rows) that can hold rows pos .. pos + rows - 1."""
    return stream.pad16(cfg.rows + stream.ROW_TILE - 1)


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


def tp_of(spec: ModelSpec) -> int:
    """Devices the spec's shapes are split over (a `shard.DeviceSpec`), else 1."""
    return getattr(spec, "tp", 1)


def embedding_tiles(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int, int]:
    """[Bp, ROW_TILE, H/tp]: the bf16 tiles the kernel copies its sequences' embedding rows in, one
    a sequence, and picks each row out of (`megakernel.pick_rows`)."""
    return cfg.padded_batch, stream.ROW_TILE, spec.hidden // tp_of(spec)


def static_stream(spec: ModelSpec, cfg: KernelConfig) -> stream.Stream:
    return stream.stream(spec, cfg.tile, cfg.bank_rows)


def part(spec: ModelSpec, cfg: KernelConfig, key: tuple[str, str]) -> stream.Part:
    return stream.part(spec, key, cfg.tile, cfg.bank_rows)


def expert_matmuls(spec: ModelSpec) -> list[Matmul]:
    return [mm for mm in spec.ffn_matmuls("moe") if mm.family == "routed_expert"]


def expert_layout(spec: ModelSpec, cfg: KernelConfig) -> quant.ExpertLayout:
    """How one routed expert is stored (`quant.ExpertLayout`; bf16: no scales)."""
    return quant.expert_layout(spec.formats["routed_expert"].name, cfg.tile,
                               [(mm.d_in, mm.d_out) for mm in expert_matmuls(spec)],
                               fp8=cfg.target.fp8)


def max_row_col_tiles(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int]:
    """The most input row tiles and output column blocks of any matmul the kernel runs (its
    VMEM scratch for an input's T-wide pieces and the output column blocks)."""
    t = cfg.tile
    groups = [g for l in (*spec.layers, None) for key in stream.layer_parts(spec, l)
              for g in stream.groups_of(spec, key)]
    rows = [math.ceil(g.d_in / t) for g in groups]
    cols = [max(1, g.blocks(t)) for g in groups]
    if spec.moe:
        for r, c in expert_layout(spec, cfg).shapes:
            rows.append(r)
            cols.append(c)
    return max(rows), max(cols)


# ----- the layer table ------------------------------------------------------------------------

# columns of the layer table (int32 [n_layers, 6], in SMEM): attention kind (0 KDA, 1 MLA), FFN
# kind (0 dense, 1 MoE), ordinal among layers of the same attention kind (cache slot), ordinal
# among MoE layers, first ring bank of the layer's attention part, first ring bank of its FFN
ATT, FFN, ATT_ORD, MOE_ORD, FIRST, FFN_FIRST = range(6)
ATTENTION_IDS, FFN_IDS = {"kda": 0, "mla": 1}, {"dense": 0, "moe": 1}


def layer_table(spec: ModelSpec, cfg: KernelConfig) -> np.ndarray:
    """The layer loop's per-layer scalars (columns ATT .. FFN_FIRST), int32 [n_layers, 6]."""
    first = static_stream(spec, cfg).first_bank
    rows = []
    for layer in spec.layers:
        ffn_family = stream.layer_parts(spec, layer)[1][1]
        rows.append([ATTENTION_IDS[layer.attention], FFN_IDS[layer.ffn],
                     reference.kind_ordinal(spec, layer),
                     sum(1 for l in spec.layers[:layer.index - 1] if l.ffn == "moe"),
                     first[(layer.index, "attention")], first[(layer.index, ffn_family)]])
    return np.asarray(rows, np.int32)


# ----- small vectors ----------------------------------------------------------------------------

def _rows(n: int) -> int:
    return math.ceil(n / LANES)


def _attention_rows(spec: ModelSpec, attention: str) -> int:
    shapes = reference.small_param_shapes(spec, Layer(1, attention, "dense"))
    return stream.pad16(sum(_shape_rows(s) for s in shapes.values()))


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
    out = [("attention", 0, stream.pad16(att_end))]
    if "router_bias" in lay:
        r, n, _ = lay["router_bias"]
        out.append(("router", r, stream.pad16(n)))
    return out


def vector_rows(spec: ModelSpec) -> int:
    return max(r + n for l in (*spec.layers, None) for _, r, n in vector_copies(spec, l))


# ----- packing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packed:
    """Weights laid out for the megakernel (all arrays in HBM)."""
    embed: object      # [embed_rows, H/tp] bf16 (row = token id; zero rows pad the vocabulary)
    static: object     # [stream rows, T] bf16 (`perfmodel_kernels.stream`)
    experts: object    # [n_moe_layers, E/groups, rows, T] codes (and 8-bit scales; bf16: the
    #                    weights; a zero block if no MoE)
    vectors: object    # [n_layers + 1, vector_rows, 128] bf16
    expert_scales: object = None  # [n_moe_layers, E/groups, scale rows, T] (16/32-bit scales)
    expert_global: object = None  # [n_moe_layers * E/groups * 2] f32 (nvfp4 per-matrix scales)
    banks: tuple = ()  # (tile, bank_rows) the arrays are laid out for (megakernel.weight_args checks)


def with_banks(packed: Packed, weights: reference.Weights, cfg: KernelConfig) -> Packed:
    """`packed` for a config of another bank size: its static stream packed again from
    `weights` in cfg's banks, the rest shared (laid out by the tile alone)."""
    require(packed.banks[:1] == (cfg.tile,), "tile", cfg.tile,
            f"the packed weights are of tile {packed.banks[:1]}: pack them again (pack_weights)")
    if packed.banks == (cfg.tile, cfg.bank_rows):
        return packed
    return dataclasses.replace(packed, static=_pack_static(weights, cfg),
                               banks=(cfg.tile, cfg.bank_rows))


def _pack_static(weights: reference.Weights, cfg: KernelConfig):
    """The static weight stream [stream rows, T] bf16 in banks of cfg.bank_rows rows."""
    spec, layers, slabs = weights.spec, weights["layers"], []
    for layer in (*spec.layers, None):
        src = {"lm_head": weights["lm_head"]} if layer is None else layers[layer.index - 1]
        for key in stream.layer_parts(spec, layer):
            slabs.append(stream.pack_part(part(spec, cfg, key), src))
    return jnp.asarray(np.concatenate(slabs), jnp.bfloat16)


def pack_weights(weights: reference.Weights, cfg: KernelConfig) -> Packed:
    """Pack reference weights (bf16) into the megakernel's HBM layout."""
    spec = weights.spec
    check_kernel_spec(spec, cfg)
    np_ = lambda a: np.asarray(a)
    layers = weights["layers"]
    experts, scales, globs = [], [], []
    if spec.moe:
        lay = expert_layout(spec, cfg)
        for layer, lw in zip(spec.layers, layers):
            if layer.ffn != "moe":
                continue
            mats = [lw[mm.name] for mm in expert_matmuls(spec)]
            n_e = mats[0].shape[0]
            values = sum(math.prod(m.shape[1:]) for m in mats)   # one expert's weights
            step = max(1, min(PACK_EXPERTS, PACK_BYTES // (4 * values)))
            parts = [quant.pack_experts(lay, [jnp.asarray(m[e:e + step]) for m in mats])
                     for e in range(0, n_e, step)]   # bounded f32 temporaries
            experts.append(jnp.concatenate([c for c, _, _ in parts]))
            if parts[0][1] is not None:
                scales.append(jnp.concatenate([sc for _, sc, _ in parts]))
            globs.append(jnp.concatenate([gl for _, _, gl in parts]).reshape(-1))
    t = cfg.tile
    experts = jnp.stack(experts) if experts else jnp.zeros((1, 1, t, t), jnp.bfloat16)
    vr = vector_rows(spec)
    vec = np.zeros((len(spec.layers) + 1, vr, LANES), jnp.bfloat16)
    for i, layer in enumerate((*spec.layers, None)):
        src = {"final_norm": weights["final_norm"]} if layer is None else layers[i]
        for name, (r, n, shape) in vector_layout(spec, layer).items():
            v = np_(src[name]).reshape(-1, shape[-1]) if len(shape) == 2 else np_(src[name])[None]
            block = np.zeros((v.shape[0], _rows(shape[-1]) * LANES), vec.dtype)
            block[:, :shape[-1]] = v
            vec[i, r:r + n] = block.reshape(n, LANES)
    glob = spec.moe and expert_layout(spec, cfg).fmt.global_scale
    emb = jnp.asarray(weights["embed"])
    return Packed(embed=jnp.pad(emb, ((0, embed_rows(spec) - spec.vocab), (0, 0))),
                  static=_pack_static(weights, cfg), banks=(cfg.tile, cfg.bank_rows),
                  experts=experts, vectors=jnp.asarray(vec),
                  expert_scales=jnp.stack(scales) if scales else None,
                  expert_global=jnp.concatenate(globs) if glob else None)


def unpack_vector(vrows, layout_entry):
    """Rows of a loaded vector block -> the vector(s) [n] or [W, C] as f32."""
    r, n, shape = layout_entry
    block = vrows[r:r + n].astype(jnp.float32)
    if len(shape) == 2:
        return block.reshape(shape[0], -1)[:, :shape[1]]
    return block.reshape(1, -1)[:, :shape[0]]


jax.tree_util.register_dataclass(
    Packed, data_fields=["embed", "static", "experts", "vectors", "expert_scales",
                         "expert_global"], meta_fields=["banks"])
