"""The Pallas TPU megakernel: a whole hybrid-MoE decode step in one `pallas_call`.

Weights stay in HBM (`memory_space=ANY`). The static weights stream through a ring of `depth`
VMEM banks, one DMA a bank (`perfmodel_kernels.ring`, layout `perfmodel_kernels.stream`), across layer and phase
boundaries, so the ring keeps prefetching through routing, attention and the collectives.
After each MoE router, the top-k picks are reduced to a mask of used experts, moved VMEM ->
SMEM, compacted into ascending expert ids in SMEM by scalar code, and the experts are fetched
by data-dependent DMAs (`expert_fetch`: one or two per expert) into `expert_slots` VMEM slots
(expert j goes to slot j mod slots; expert j+slots is fetched as soon as expert j has been
applied); experts reach the MXU as the chip takes them (`perfmodel_kernels.quant`: fp8 where it takes fp8,
else decoded with their scales to bf16 and fed a column block a dot). The KDA state / conv window
and the MLA latent cache live in HBM, aliased in and out; they are prefetched at the start of
their layer (MLA: only the blocks holding positions < pos) and written back in place (KDA:
whole state; MLA: one row). On a mesh the collectives are remote DMAs (`perfmodel_kernels.comm`) behind
a barrier at the start of the call. A step may verify a block of `cfg.rows` tokens per
sequence (causal within the block; only the first `accepted` rows of each sequence update the
caches; see `make_step`). Every DMA issue site also records itself (`dma.Dma`) so that
`perfmodel_kernels.plan` derives the DMA plan from the kernel's own code. Numerics follow
`perfmodel_kernels.reference` (same helpers).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from perfmodel.spec.arch import Layer, ModelSpec
from perfmodel.util.errors import require

from . import comm as comm_mod, layout, quant, reference as ref, shard, stream as stream_mod, vmem
from .comm import Comm
from .dma import Copies, Dma
from .layout import KernelConfig, Packed
from .stream import ROW_TILE
from .ring import PartReader, Ring

F32, BF16 = jnp.float32, jnp.bfloat16
COLLECTIVE_ID = 0   # the barrier semaphore of this kernel (one collective pattern: the tp axis)


def _argmax_first(x, iota):
    """Index of the first maximum along the last axis, [rows, 1] int32."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1, keepdims=True)


def _switch(pred_is_first, kinds, fns, *args):
    """fns[kinds[0]](*args) if only one kind is present, else a cond on the traced predicate."""
    if len(kinds) == 1:
        return fns[kinds[0]](*args)
    return lax.cond(pred_is_first, fns[kinds[0]], fns[kinds[1]], *args)


Ref = Any   # a Pallas ref inside the kernel: SMEM, VMEM, HBM (memory_space=ANY) or DMA semaphores


@dataclass(frozen=True)
class KdaRefs:
    """The KDA state and conv window of every KDA layer, and one layer's in VMEM."""
    state: Ref        # [n_kda, B, ..] f32 (HBM, updated in place)
    conv: Ref         # [n_kda, B, ..] (HBM, updated in place)
    state_buf: Ref    # VMEM
    conv_buf: Ref     # VMEM
    sem: Ref          # DMA [4]: state and window reads, their write-backs
    flag: Ref         # SMEM [1]: 1 while a write-back is in flight

    def write_backs(self, o) -> list[Copies]:
        """The VMEM state and window into KDA layer o's."""
        return [Copies("kda state (write back)", (self.state_buf, self.state.at[o], self.sem.at[2])),
                Copies("conv window (write back)", (self.conv_buf, self.conv.at[o], self.sem.at[3]))]

    def await_write_back(self):
        """Waits for the last KDA layer's write-back, if one is in flight."""
        @pl.when(self.flag[0] == 1)
        def _():
            for cp in self.write_backs(0):
                cp.wait()


@dataclass(frozen=True)
class MlaRefs:
    """The latent cache of every MLA layer and its VMEM buffers."""
    cache: Ref        # [n_mla, B, max_context, r + rope] (HBM, new rows written in place)
    blocks: Ref       # VMEM [3, block, r + rope] bf16: cache blocks being read
    window: Ref       # VMEM [B, W, r + rope] bf16: the tiles holding each sequence's new rows
    sem: Ref          # DMA [3], one a block buffer


@dataclass(frozen=True)
class ExpertRefs:
    """The routed experts: their layout, HBM arrays, VMEM slots and the used-expert lists."""
    lay: quant.ExpertLayout
    hbm: Ref                  # [n_moe, E/groups, rows, T] codes (and 8-bit scales)
    scales_hbm: Ref | None    # [n_moe, E/groups, scale rows, T]: 16- and 32-bit scales
    slots: Ref                # VMEM [slots, rows, T]
    scale_slots: Ref | None   # VMEM [slots, scale rows, T]: 16- and 32-bit scales
    sems: Ref                 # DMA [slots]
    glob: Ref | None          # SMEM [n_moe * E/groups * 2] f32: nvfp4 global scales
    mask_v: Ref               # VMEM [1, E] int32: the used-expert mask
    mask_s: Ref               # SMEM [1, E]: its copy
    ids: Ref                  # SMEM [E]: the used experts, ascending
    decoded: Ref | None       # VMEM [decoded rows, T] bf16: formats decoded before the MXU
    ndist: Ref                # SMEM [n_moe] output: distinct experts per MoE layer


def expert_fetch(x: ExpertRefs, mo, e, s) -> Copies:
    """Expert `e` (of MoE layer `mo`) into slot s: its codes (with 8-bit scales) and, for 16-
    and 32-bit scales, its scales: one or two DMAs."""
    pairs = [(x.hbm.at[mo, e], x.slots.at[s], x.sems.at[s])]
    if x.scales_hbm is not None:
        pairs.append((x.scales_hbm.at[mo, e], x.scale_slots.at[s], x.sems.at[s]))
    return Copies("expert", *pairs)


@dataclass(frozen=True)
class Context:
    """What the phases of one kernel call share: the model and config, the DMA recorder, the
    weight ring, the collectives, the refs (those of a kind the model lacks: None) and `real`."""
    spec: ModelSpec
    cfg: KernelConfig
    dma: Dma
    ring: Ring
    comm: Comm
    tok: Ref                   # SMEM [Bp] token ids
    pos: Ref                   # SMEM [B] positions
    acc: Ref                   # SMEM [B] accepted rows
    table: Ref                 # SMEM [n_layers, 6] layer table
    me: Ref                    # SMEM [1] device index
    count_in: Ref | None       # SMEM [5] exchanges so far, per group kind (mesh only)
    count: Ref | None          # SMEM [5] output, aliased to count_in (mesh only)
    emb_hbm: Ref               # [embed_rows, H/tp] bf16 (`layout.embed_rows`)
    vec_hbm: Ref               # [n_layers + 1, vrows, 128] small vectors
    next_tokens: Ref           # VMEM [Bp, 128] int32 output
    logits: Ref                # VMEM [Bp, V/tp] f32 output
    vbuf: Ref                  # VMEM [2, vrows, 128] bf16: two layers' small vectors
    vsem: Ref                  # DMA [2]
    xrows: Ref                 # VMEM [Bp, ROW_TILE, H/tp] bf16: the tile holding each token's row
    misc_sem: Ref              # DMA [4]: embedding rows (0), latent cache windows (2), expert mask (3)
    xs: Ref                    # VMEM [rmax, Bp, T] f32 matmul input tiles
    ys: Ref                    # VMEM [cmax, Bp, T] f32 matmul output column blocks
    kda: KdaRefs | None
    mla: MlaRefs | None
    experts: ExpertRefs | None
    real: jax.Array            # [Bp, 1] bool: token rows (row r of sequence b at r * B + b)

    @property
    def tp(self) -> int:
        return layout.tp_of(self.spec)

    @property
    def n_layers(self) -> int:
        return len(self.spec.layers)

    @property
    def att_kinds(self) -> list[str]:
        return sorted({l.attention for l in self.spec.layers}, key=layout.ATTENTION_IDS.get)

    @property
    def ffn_kinds(self) -> list[str]:
        return sorted({l.ffn for l in self.spec.layers}, key=layout.FFN_IDS.get)

    def ffn_families(self, kind: str) -> list[str]:
        return [f for _, f in stream_mod.layer_parts(self.spec, perfmodel_layer("kda", kind))
                if f != "attention"]

    def matmuls(self, i, kind: str, *families: str) -> LayerMatmuls:
        return LayerMatmuls(self, i, kind, families)

    # ----- small vectors: double-buffered, layer i+1's block issued when layer i starts -------
    def vector_copies(self, entry, attention, with_router) -> list[Copies]:
        """The copies of vector entry `entry` (traced; n_layers = final norm) for a layer kind."""
        layer = None if attention is None else \
            perfmodel_layer(attention, "moe" if with_router else "dense")
        slot = lax.rem(entry, 2)
        return [Copies("vectors", (self.vec_hbm.at[entry, pl.ds(r, n)],
                                   self.vbuf.at[slot, pl.ds(r, n)], self.vsem.at[slot]))
                for _, r, n in layout.vector_copies(self.spec, layer)]

    def for_vector_copies(self, entry, fn):
        """fn(copy) for each copy of entry's block (entry: an int, or traced in the loop, where
        the copies are chosen by the entry's kinds from the layer table)."""
        def each(attention, with_router):
            for cp in self.vector_copies(entry, attention, with_router):
                fn(cp)
        if isinstance(entry, int):
            layer = (*self.spec.layers, None)[entry]
            return each(layer and layer.attention, layer is not None and layer.ffn == "moe")
        last = entry == self.n_layers
        pl.when(last)(lambda: each(None, False))
        safe = jnp.minimum(entry, self.n_layers - 1)
        for a in self.att_kinds:
            for f in self.ffn_kinds:
                hit = jnp.logical_and(self.table[safe, layout.ATT] == layout.ATTENTION_IDS[a],
                                      self.table[safe, layout.FFN] == layout.FFN_IDS[f])
                pl.when(jnp.logical_and(jnp.logical_not(last), hit))(
                    lambda a=a, f=f: each(a, f == "moe"))

    def vectors(self, slot, attention=None, ffn=None) -> dict:
        """name -> f32 value of the block in vbuf slot, for one attention (or FFN) kind."""
        lay_v = layout.vector_layout(self.spec, perfmodel_layer(attention or self.att_kinds[0],
                                                                ffn or "dense"))
        rows = self.vbuf[slot]
        keep = ("router_bias",) if ffn else tuple(n for n in lay_v if n != "router_bias")
        return {name: layout.unpack_vector(rows, lay_v[name]) for name in keep if name in lay_v}

    def accepted(self):
        """Rows kept per sequence, [B, 1] int32 (from SMEM)."""
        b_real = self.cfg.batch
        seq = lax.broadcasted_iota(jnp.int32, (b_real, 1), 0)
        out = jnp.zeros((b_real, 1), jnp.int32)
        for b in range(b_real):
            out = jnp.where(seq == b, self.acc[b], out)
        return out


class LayerMatmuls:
    """matmul(name, x) for layer i's parts of `families` (layer kind `kind`), reading each
    part's banks from the ring in order; a fused group is computed once, at the call for its
    first member, and its other members are sliced from that result."""

    def __init__(self, ctx: Context, i, kind: str, families: tuple[str, ...]):
        col = layout.FIRST if families[0] == "attention" else layout.FFN_FIRST
        self.ctx, self.g0 = ctx, ctx.table[i, col]
        self.parts = [layout.part(ctx.spec, ctx.cfg, (kind, f)) for f in families]
        self.firsts = [sum(p.banks for p in self.parts[:k]) for k in range(len(self.parts))]
        self.readers: dict[int, PartReader] = {}   # part -> its reader, in the order opened
        self.results = {}                          # name -> (its group's input, its output)

    def _reader(self, name):
        k = next(q for q, p in enumerate(self.parts) if any(name in g.names for g in p.groups))
        if k not in self.readers:
            self.finish()
            self.readers[k] = PartReader(self.ctx.ring, self.parts[k], self.g0 + self.firsts[k],
                                         self.ctx.xs, self.ctx.ys)
        return self.readers[k], self.parts[k]

    def __call__(self, name, x):
        if name not in self.results:
            rd, p = self._reader(name)
            k = p.group_of(name)
            g = p.groups[k]
            y = rd.matmul(k, x)
            for nm, w in zip(g.names, g.widths):
                c = g.column(nm)
                self.results[nm] = (x, y[:, c:c + w])
        x0, y = self.results[name]
        assert x0 is x, f"{name} must read the same input as its group"
        comm = self.ctx.comm
        if name in shard.GATHERED:   # latent_down's output only feeds bf16 dots
            return comm.all_gather(y, name, dtype=BF16 if name == "latent_down" else F32)
        return comm.all_reduce(y, name) if name in ("o_proj", "down") else y

    def matrix(self, name):
        rd, p = self._reader(name)
        return rd.matrix(p.group_of(name))

    def finish(self):
        for r in self.readers.values():
            r.finish()


def _kernel(spec: ModelSpec, cfg: KernelConfig, record, barrier, *refs):
    """The step: unpacks the refs into a `Context`, then embed, the layer loop (one trace of
    each layer kind, whatever the layer count) and the head."""
    n_kda, n_mla = spec.count(attention="kda"), spec.count(attention="mla")
    n_moe = spec.count(ffn="moe")
    tp = layout.tp_of(spec)
    lay = layout.expert_layout(spec, cfg) if n_moe else None
    separate = lay is not None and lay.rows[1] > 0
    glob = lay is not None and lay.fmt.global_scale
    widths = comm_mod.collective_widths(spec, cfg)
    bufs = comm_mod.buffer_shapes(spec, cfg, widths, tp) if tp > 1 else {}
    refs = list(refs)
    take = lambda k: [refs.pop(0) for _ in range(k)]
    # inputs
    tok_ref, pos_ref, acc_ref, table, row0_ref, cls_ref, me_ref = take(7)  # SMEM
    # [Bp], [B], [B], [n_layers, 6], [n_banks], [n_banks], [1]
    (glob_ref,) = take(1) if glob else (None,)      # SMEM [n_moe * E/groups * 2] f32
    (count_in,) = take(1) if tp > 1 else (None,)    # SMEM [5] exchanges so far, per group kind
    emb_hbm, static_hbm, exp_hbm, vec_hbm = take(4)
    # [embed_rows, H/tp], [stream rows, T], [n_moe, E/groups, rows, T], [n_layers + 1, vrows, 128]
    (exp_scale_hbm,) = take(1) if separate else (None,)   # [n_moe, E/groups, scale rows, T]
    take(2 * bool(n_kda) + bool(n_mla))  # cache inputs: aliased to the cache outputs below
    # outputs
    next_ref, logits_ref = take(2)                  # [Bp, 128] int32, [Bp, V/tp] f32 (VMEM)
    kda_state, kda_conv = take(2) if n_kda else (None, None)   # [n_kda, B, ..] (HBM, in place)
    (mla_cache,) = take(1) if n_mla else (None,)    # [n_mla, B, max_context, r + rope] (HBM)
    (ndist_ref,) = take(1)                          # [max(n_moe, 1)] int32 (SMEM)
    (count_ref,) = take(1) if tp > 1 else (None,)   # [5] int32 (SMEM), aliased to count_in
    # scratch
    ring_buf, ring_sem, slot_buf, slot_sem, vbuf, vsem, xrows, misc_sem, xs, ys = take(10)
    # [depth, bank_rows, T] bf16, DMA [depth], [slots, rows, T] codes, DMA [slots],
    # [2, vrows, 128] bf16, DMA [2], [Bp, ROW_TILE, H/tp] bf16, DMA [4], [rmax, Bp, T] f32,
    # [cmax, Bp, T] f32
    (scale_buf,) = take(1) if separate else (None,)  # [slots, scale rows, T]
    kda = KdaRefs(kda_state, kda_conv, *take(4)) if n_kda else None  # state, window, DMA, flag
    mla = MlaRefs(mla_cache, *take(3)) if n_mla else None  # blocks, windows, DMA [3]
    experts = None
    if n_moe:
        mask_v, mask_s, ids_s = take(3)      # [1, E] int32 VMEM, [1, E] SMEM, [E] SMEM
        (wbuf,) = take(1) if lay.decodes else (None,)   # [decoded rows, T] bf16
        experts = ExpertRefs(lay, exp_hbm, exp_scale_hbm, slot_buf, scale_buf, slot_sem, glob_ref,
                             mask_v, mask_s, ids_s, wbuf, ndist_ref)
    if tp > 1:
        comm_bufs = {key: tuple(take(2)) for key in bufs}   # send, receive per (kind, dtype)
        (comm_sem,) = take(1)                                 # DMA [2, 5, 2]
    assert not refs

    dma = Dma(record)
    ring = Ring(cfg.depth, layout.static_stream(spec, cfg), static_hbm, ring_buf, ring_sem, row0_ref,
                cls_ref, dma)
    comm = Comm(tp, me_ref, comm_bufs if tp > 1 else {}, comm_sem if tp > 1 else None,
                count_ref, cfg, spec, dma)
    real = lax.broadcasted_iota(jnp.int32, (cfg.padded_batch, 1), 0) < cfg.token_rows
    ctx = Context(spec, cfg, dma, ring, comm, tok=tok_ref, pos=pos_ref, acc=acc_ref, table=table,
                  me=me_ref, count_in=count_in, count=count_ref, emb_hbm=emb_hbm, vec_hbm=vec_hbm,
                  next_tokens=next_ref, logits=logits_ref, vbuf=vbuf, vsem=vsem, xrows=xrows,
                  misc_sem=misc_sem, xs=xs, ys=ys, kda=kda, mla=mla, experts=experts, real=real)

    x = embed(ctx, barrier)
    attention = _branches(ctx, "attention", {"kda": kda_attention, "mla": mla_attention})
    ffn = _branches(ctx, "ffn", {"dense": dense_ffn, "moe": moe})
    dma.scope = "loop"

    def layer(i, x):
        with jax.named_scope("layer/attention"):
            # the waits carry their own trace markers (`state_wait` too); layer 0's vectors
            # were waited for before the ring started (`embed`)
            with jax.named_scope("vector_wait"):
                pl.when(i > 0)(lambda: ctx.for_vector_copies(i, lambda cp: cp.wait()))
            dma.note("vectors", layer=1)
            with jax.named_scope("vector_start"):
                ctx.for_vector_copies(i + 1, lambda cp: cp.start())
            common = ctx.vectors(lax.rem(i, 2), attention=ctx.att_kinds[0])
            with jax.named_scope("norm"):
                h = ref.rms_norm(x, common["attn_norm"])
            x = x + _switch(table[i, layout.ATT] == 0, ctx.att_kinds, attention, i, h)
        with jax.named_scope("layer/ffn"):
            with jax.named_scope("norm"):
                h = ref.rms_norm(x, common["ffn_norm"])
            return x + _switch(table[i, layout.FFN] == 0, ctx.ffn_kinds, ffn, i, h)

    x = lax.fori_loop(0, len(spec.layers), layer, x)
    dma.scope = "post"
    head(ctx, x)


def _branches(ctx: Context, family: str, phases: dict) -> dict:
    """kind -> phase(ctx, i, h) of `family`, its DMA records tagged with (family, kind)."""
    return {kind: ctx.dma.branch((family, kind))(functools.partial(fn, ctx))
            for kind, fn in phases.items()}


def embed(ctx: Context, barrier: bool):
    """The token rows' embeddings copied and waited for, then layer 0's vectors and the ring
    started; the rows (gathered over the mesh, after the entry barrier) -> x [Bp, H] f32,
    padding rows zero. A token's row is copied in the whole bf16 tile holding it (`ROW_TILE`
    rows: the row offset is tile-aligned) and picked from it (`pick_rows`). The rows are waited
    for before the ring starts: the DMA engine serves copies in issue order (on a v5e a small
    copy started after k 2 MiB copies arrives k x 2.8 us late: experiments/tpu_microbench.py,
    queue), and started merely before the ring's banks in the program the rows still arrived
    after them (a 27.8 us embed phase in a 1.1 ms step's trace; the compiler may reorder the
    starts of independent copies). Layer 0's vectors are waited for before the ring for the same
    reason: its first op needs them, and merely started before the banks they arrived behind
    the ring's first 64 MiB (a 72.7 us `vector_wait` in layer 0's attention, TP32-core batch 1)."""
    dma, tp, h = ctx.dma, ctx.tp, ctx.spec.hidden // ctx.tp
    with jax.named_scope("embed"):
        first = [pl.multiple_of(ctx.tok[b] // ROW_TILE * ROW_TILE, ROW_TILE)
                 for b in range(ctx.cfg.token_rows)]
        emb = [Copies("embedding row", (ctx.emb_hbm.at[pl.ds(r, ROW_TILE)], ctx.xrows.at[b],
                                        ctx.misc_sem.at[0]))
               for b, r in enumerate(first)]
        for cp in emb:
            dma.note("copy", 0, "embedding", "embedding row", ROW_TILE * h * 2,
                     padding=(ROW_TILE - 1) * h * 2)
            cp.start()
        for cp in emb:
            cp.wait()
        dma.note("vectors", layer=0)
        ctx.for_vector_copies(0, lambda cp: cp.start())
        ctx.for_vector_copies(0, lambda cp: cp.wait())
        ctx.ring.start()
        if ctx.kda is not None:
            ctx.kda.flag[0] = 0
        if tp > 1:
            for k in range(len(comm_mod.KINDS)):
                ctx.count[k] = ctx.count_in[k]
        ctx.comm.barrier(skip=not barrier)   # before the first remote write of the call
        return ctx.comm.all_gather(pick_rows(ctx.tok, ctx.xrows, ctx.cfg.token_rows),
                                   "embedding", dtype=BF16)


def pick_rows(tok, tiles, n: int):
    """Row tok[b] % ROW_TILE of tiles[b] (VMEM [Bp, ROW_TILE, H] bf16) for b < n, bit-exact
    (selects only), as [Bp, H] f32; rows n.. zero."""
    rows = lax.broadcasted_iota(jnp.int32, (tiles.shape[0], 1), 0)
    which = jnp.full(rows.shape, -1, jnp.int32)
    for b in range(n):
        which = jnp.where(rows == b, tok[b] % ROW_TILE, which)
    x = jnp.zeros((tiles.shape[0], tiles.shape[-1]), F32)
    for k in range(ROW_TILE):
        x = jnp.where(which == k, tiles[:, k, :].astype(F32), x)
    return x


# ----- attention kinds -----
def kda_attention(ctx: Context, i, h):
    """Layer i's KDA attention of the normed input h: its state and window are read while the
    projections run (after the previous KDA layer's write-back) and written back in place."""
    kda, dma = ctx.kda, ctx.dma
    o = ctx.table[i, layout.ATT_ORD]
    v = ctx.vectors(lax.rem(i, 2), attention="kda")
    with jax.named_scope("write_back_wait"):
        kda.await_write_back()   # the previous KDA layer's
    reads = [Copies("kda state", (kda.state.at[o], kda.state_buf, kda.sem.at[0])),
             Copies("conv window", (kda.conv.at[o], kda.conv_buf, kda.sem.at[1]))]
    sizes = [kda.state.size // kda.state.shape[0] * 4,
             kda.conv.size // kda.conv.shape[0] * kda.conv.dtype.itemsize]
    for nb, cp in zip(sizes, reads):
        dma.note("copy", None, "state", cp.name, nb)
        cp.start()

    def load_state():
        with jax.named_scope("state_wait"):
            for cp in reads:
                cp.wait()
        return kda.state_buf[...], kda.conv_buf[...]

    matmul = ctx.matmuls(i, "kda", "attention")
    out, st, win = ref.kda_block(ctx.spec, matmul, v, load_state, h, ctx.accepted(), ctx.cfg.rows)
    matmul.finish()
    with jax.named_scope("state_store"):
        kda.state_buf[...] = st
        kda.conv_buf[...] = win.astype(kda.conv_buf.dtype)
        for nb, cp in zip(sizes, kda.write_backs(o)):
            dma.note("copy", None, "state", cp.name, nb)
            cp.start()
        kda.flag[0] = 1
    return out


@dataclass(frozen=True)
class LatentCache:
    """MLA layer o's latent cache: token tile k of sequence b is read into buffer k mod 3; the
    new rows of b are written by a read-modify-write of its window (whole tiles: one row is not
    a tile)."""
    ctx: Context
    o: jax.Array

    def tile_copy(self, b, k) -> Copies:
        """Token tile k of sequence b into buffer k mod 3."""
        cb, mla = self.ctx.cfg.cache_block, self.ctx.mla
        first = k * cb if isinstance(k, int) else pl.multiple_of(k * cb, cb)
        return Copies("latent cache block", (mla.cache.at[self.o, b, pl.ds(first, cb)],
                                             mla.blocks.at[k % 3], mla.sem.at[k % 3]))

    def window_base(self, b):
        """First row of sequence b's window (a whole tile)."""
        cfg = self.ctx.cfg
        w_rows = layout.cache_window(cfg)
        base = jnp.minimum(self.ctx.pos[b] // ROW_TILE * ROW_TILE, cfg.max_context - w_rows)
        return pl.multiple_of(base, ROW_TILE)

    def window_copy(self, b, write: bool) -> Copies:
        """The tile-aligned rows holding the new rows of b, into or out of its window."""
        mla = self.ctx.mla
        hbm = mla.cache.at[self.o, b, pl.ds(self.window_base(b), layout.cache_window(self.ctx.cfg))]
        pair = (mla.window.at[b], hbm) if write else (hbm, mla.window.at[b])
        return Copies(f"latent cache window ({'write' if write else 'read'})",
                      (*pair, self.ctx.misc_sem.at[2]))

    def n_tiles(self, b):
        """Tiles holding positions < pos."""
        cb = self.ctx.cfg.cache_block
        return (self.ctx.pos[b] + cb - 1) // cb

    def start_first(self, b):
        """Starts the first two tiles of sequence b (those it holds)."""
        cfg = self.ctx.cfg
        for k in range(min(2, cfg.max_context // cfg.cache_block)):
            pl.when(k < self.n_tiles(b))(lambda k=k: self.tile_copy(b, k).start())


def mla_attention(ctx: Context, i, h):
    """Layer i's MLA attention of the normed input h: the cached tiles of each sequence are read
    while the projections run; the accepted new latents are written into the cache in place."""
    spec, cfg, dma, acc = ctx.spec, ctx.cfg, ctx.dma, ctx.acc
    m, b_real = spec.mla, cfg.batch
    cache = LatentCache(ctx, ctx.table[i, layout.ATT_ORD])
    v = ctx.vectors(lax.rem(i, 2), attention="mla")
    matmul = ctx.matmuls(i, "mla", "attention")
    row_bytes = (m.kv_lora_rank + m.qk_rope_dim) * ctx.mla.cache.dtype.itemsize
    dma.note("cache_blocks", None, "kv_cache", "latent cache block", cfg.cache_block * row_bytes)
    if b_real:
        cache.start_first(0)  # overlaps the projections
    # only sequences that keep a row take part in the windows' read-modify-write
    w_bytes = layout.cache_window(cfg) * row_bytes
    dma.note("cache_window", None, "kv_cache", "latent cache window (read)", w_bytes,
             row_bytes=row_bytes)
    for b in range(b_real):
        pl.when(acc[b] > 0)(cache.window_copy(b, False).start)
    q_nope, q_rope, c_new = ref.mla_project(spec, matmul, v, h)
    kv_b = matmul.matrix("kv_b")
    w_uk, _ = ref.split_kv_b(spec, kv_b)
    c_new = c_new.astype(BF16).astype(F32)
    q_lat = jnp.einsum("bhn,rhn->bhr", q_nope, w_uk)
    with jax.named_scope("core"):   # a trace marker: the model's mla_attention op
        o_lat = _latent_attention(ctx, cache, q_lat, q_rope, c_new)
    dma.note("wait", name="latent cache block")
    with jax.named_scope("window"):
        _patch_windows(ctx, cache, c_new)
    dma.note("cache_window", None, "kv_cache", "latent cache window (write)", w_bytes,
             row_bytes=row_bytes)
    out = ref.mla_output(spec, matmul, expand_latent(spec, o_lat, kv_b), h)
    dma.note("wait", name="latent cache window (write)")
    with jax.named_scope("window_wait"):
        for b in range(b_real):
            pl.when(acc[b] > 0)(cache.window_copy(b, True).wait)
    matmul.finish()
    return out


def expand_latent(spec, o_lat, kv_b):
    """The latent attention values o_lat [Bp, heads, r] through each head's W_uv -> [Bp, heads, v]
    f32 (the reference's einsum bhr,rhv->bhv): one 2-D dot a head on its columns of kv_b [r, heads
    x (nope + v)]. As an einsum Mosaic relays W_uv out first: 20.7 us against 0.19 us at the K3
    TP32-core widths on a v5e (`tpu_microbench.py --only attn_parts`, mla-expand-*)."""
    m = spec.mla
    w = m.qk_nope_dim + m.v_head_dim
    return jnp.stack([jnp.dot(o_lat[:, h, :], kv_b[:, h * w + m.qk_nope_dim:(h + 1) * w].astype(F32))
                      for h in range(m.heads)], axis=1)


_NT = (((1,), (1,)), ((), ()))  # dot_general dimensions contracting the last dims: a @ b.T


def _latent_attention(ctx: Context, cache: LatentCache, q_lat, q_rope, c_new):
    """Absorbed form, flash-style: for each sequence the new rows first (causal within the
    verify block), then its cached tiles with an online softmax (3 buffers: tiles k+1, k+2 in
    flight while k is used) -> [Bp, heads, r] f32, padding rows zero."""
    m, b_real, n_rows = ctx.spec.mla, ctx.cfg.batch, ctx.cfg.rows
    scale = (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
    hr = m.heads * n_rows  # query rows of one sequence: (draft row, head)
    # causal within the verify block: query row (rr, head) sees block rows 0..rr
    causal = lax.broadcasted_iota(jnp.int32, (hr, n_rows), 1) <= \
        lax.broadcasted_iota(jnp.int32, (hr, n_rows), 0) // m.heads
    outs = []
    for b in range(b_real):
        if b:
            cache.start_first(b)
        mine = [rr * b_real + b for rr in range(n_rows)]  # this sequence's token rows
        ql = jnp.concatenate([q_lat[k] for k in mine])    # [rows * heads, r]
        qr = jnp.concatenate([q_rope[k] for k in mine])
        blk = jnp.concatenate([c_new[k:k + 1] for k in mine])  # [rows, r + rope]
        o_b = _sequence_attention(ctx, cache, b, ql, qr, blk, causal, scale)
        outs.append(o_b.reshape(n_rows, m.heads, m.kv_lora_rank))
    return jnp.stack([outs[b][rr] for rr in range(n_rows) for b in range(b_real)]
                     + [jnp.zeros((m.heads, m.kv_lora_rank), F32)] * (ctx.cfg.padded_batch
                                                                     - ctx.cfg.token_rows))


def _sequence_attention(ctx: Context, cache: LatentCache, b, ql, qr, blk, causal, scale):
    """Sequence b's latent queries (ql, qr [rows * heads, .]) over its new rows blk [rows, r +
    rope] and its cached tiles -> [rows * heads, r] f32."""
    r, cb = ctx.spec.mla.kv_lora_rank, ctx.cfg.cache_block
    s_b = (lax.dot_general(ql, blk[:, :r], _NT) + lax.dot_general(qr, blk[:, r:], _NT)) * scale
    s_b = jnp.where(causal, s_b, -jnp.inf)
    mx0 = jnp.max(s_b, axis=-1, keepdims=True)
    p0 = jnp.exp(s_b - mx0)

    def body(k, carry):
        mx, den, acc = carry
        with jax.named_scope("tile_wait"):
            cache.tile_copy(b, k).wait()
        pl.when(k + 2 < cache.n_tiles(b))(lambda: cache.tile_copy(b, k + 2).start())
        c = ctx.mla.blocks[k % 3].astype(F32)
        s = (lax.dot_general(ql, c[:, :r], _NT) + lax.dot_general(qr, c[:, r:], _NT)) * scale
        t_pos = k * cb + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(t_pos < ctx.pos[b], s, -jnp.inf)
        new_mx = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True))
        alpha, p = jnp.exp(mx - new_mx), jnp.exp(s - new_mx)
        return (new_mx, den * alpha + jnp.sum(p, axis=-1, keepdims=True),
                acc * alpha + jnp.dot(p, c[:, :r]))
    mx, den, acc = lax.fori_loop(
        0, cache.n_tiles(b), body,
        (mx0, jnp.sum(p0, axis=-1, keepdims=True), jnp.dot(p0, blk[:, :r])))
    return acc / den


def _patch_windows(ctx: Context, cache: LatentCache, c_new):
    """Writes the new latents c_new only now (no write overlaps a tile read of the same range),
    and only the accepted rows of each sequence: rows pos + rr (rr < accepted) of its window
    take the new latents, the others keep what was read; starts the windows' writes."""
    b_real, acc, window = ctx.cfg.batch, ctx.acc, ctx.mla.window
    w_row = lax.broadcasted_iota(jnp.int32, (layout.cache_window(ctx.cfg), 1), 0)
    for b in range(b_real):   # the reads share a semaphore: all of them land first
        pl.when(acc[b] > 0)(cache.window_copy(b, False).wait)
    for b in range(b_real):
        @pl.when(acc[b] > 0)
        def _(b=b):
            at = ctx.pos[b] - cache.window_base(b)
            val = window[b].astype(F32)
            for rr in range(ctx.cfg.rows):
                k = rr * b_real + b
                hit = jnp.logical_and(w_row == at + rr, rr < acc[b])
                val = jnp.where(hit, c_new[k:k + 1], val)
            window[b] = val.astype(BF16)
            cache.window_copy(b, True).start()


# ----- FFN kinds -----
def dense_ffn(ctx: Context, i, h):
    """Layer i's dense SwiGLU FFN of the normed input h."""
    matmul = ctx.matmuls(i, "dense", *ctx.ffn_families("dense"))
    out = matmul("down", ref.swiglu(matmul("gate_up", h)))
    matmul.finish()
    return out


def moe(ctx: Context, i, h):
    """Layer i's MoE of the normed input h: the router, this device's used routed experts and
    the shared expert, summed over the mesh."""
    me = ctx.spec.moe
    mo = ctx.table[i, layout.MOE_ORD]
    matmul = ctx.matmuls(i, "moe", *ctx.ffn_families("moe"))   # router first
    lane = lax.broadcasted_iota(jnp.int32, (ctx.cfg.padded_batch, me.experts), 1)
    with jax.named_scope("router"):
        picked, comb = _route(ctx, i, matmul, h, lane)
        own_first, n_used = _list_used_experts(ctx, mo, picked, lane)
    with jax.named_scope("experts"):
        out = _routed_experts(ctx, mo, matmul, h, lane, comb, own_first, n_used)
    if me.shared_width:
        with jax.named_scope("shared"):
            out = out + matmul("shared_down", ref.swiglu(matmul("shared_gate_up", h)))
    matmul.finish()
    return ctx.comm.all_reduce(out, "moe output")


def _route(ctx: Context, i, matmul: LayerMatmuls, h, lane):
    """The router's top-k picks of every row -> (picked [Bp, E] bool, their combine weights)."""
    me = ctx.spec.moe
    logits = matmul("router", h)
    scores = jax.nn.sigmoid(logits)
    sel = scores + ctx.vectors(lax.rem(i, 2), ffn="moe")["router_bias"]
    picked = jnp.zeros((ctx.cfg.padded_batch, me.experts), jnp.bool_)
    for _ in range(me.top_k):
        hit = lane == _argmax_first(sel, lane)
        picked, sel = picked | hit, jnp.where(hit, -jnp.inf, sel)
    comb = jnp.where(picked, scores, 0.0)
    return picked, comb / jnp.sum(comb, axis=-1, keepdims=True)


def _list_used_experts(ctx: Context, mo, picked, lane):
    """This device's experts picked by a token row: their ids, ascending, into SMEM (the mask
    moved VMEM -> SMEM, compacted by scalar code) -> (this device's first expert, their count),
    the count also recorded for MoE layer mo."""
    spec, x, tp, e_n = ctx.spec, ctx.experts, ctx.tp, ctx.spec.moe.experts
    own_first = (ctx.me[0] // spec.expert_tp) * spec.local_experts if tp > 1 else 0
    n_own = spec.local_experts if tp > 1 else e_n
    own = (lane >= own_first) & (lane < own_first + n_own)
    used = jnp.max(jnp.where(ctx.real & picked & own, 1, 0), axis=0, keepdims=True)
    x.mask_v[...] = used.astype(jnp.int32)
    cp = Copies("used-expert mask", (x.mask_v, x.mask_s, ctx.misc_sem.at[3]))  # VMEM -> SMEM
    cp.start()
    cp.wait()

    def compact(e, n):
        @pl.when(x.mask_s[0, e] != 0)
        def _():
            x.ids[n] = e
        return n + x.mask_s[0, e]
    n_used = lax.fori_loop(0, e_n, compact, jnp.int32(0))
    x.ndist[mo] = n_used
    return own_first, n_used


def _routed_experts(ctx: Context, mo, matmul: LayerMatmuls, h, lane, comb, own_first, n_used):
    """The used experts applied in turn, weighted by comb: expert j is fetched into slot j mod
    slots, expert j + slots as soon as expert j is applied -> the routed output [Bp, H] f32."""
    spec, x, tp, s_n = ctx.spec, ctx.experts, ctx.tp, ctx.cfg.expert_slots
    me, e_n = spec.moe, spec.moe.experts
    fetch = lambda j: expert_fetch(x, mo, x.ids[j] - own_first, j % s_n)
    pads = expert_padding_bytes(spec, ctx.cfg)
    ctx.dma.note("experts", None, "routed_expert", "expert", routed=True,
                 sizes=[b for b in x.lay.bytes() if b],
                 padding=[sum(pads)] if x.lay.copies() == 1 else list(pads))
    for j in range(s_n):   # the first experts land while the latent projection runs
        pl.when(j < n_used)(lambda j=j: fetch(j).start())
    z = matmul("latent_down", h) if me.latent_dim else h
    d_lat = me.latent_dim or spec.hidden

    def apply(j, acc):
        fetch(j).wait()
        e, slot = x.ids[j], j % s_n
        e_glob = ((mo * spec.local_experts if tp > 1 else mo * e_n) + e - own_first) * 2
        gu = expert_matmul(ctx, 0, z, slot, e_glob, j)
        y = expert_matmul(ctx, 1, ref.swiglu(gu), slot, e_glob, j)
        pl.when(j + s_n < n_used)(lambda: fetch(j + s_n).start())
        w_e = jnp.sum(jnp.where(lane == e, comb, 0.0), axis=1, keepdims=True)
        return acc + w_e * y

    # this device's experts' partial sum; summed over devices below
    routed = lax.fori_loop(0, n_used, apply, jnp.zeros((ctx.cfg.padded_batch, d_lat), F32))
    if me.latent_dim and tp > 1:
        if ctx.comm.alg == "one_shot":   # the whole sum on every device; my latent rows
            mine = ctx.comm.my_chunk(ctx.comm.all_reduce(routed, "routed experts"), tp)
        else:
            mine = ctx.comm.reduce_scatter(routed, "routed experts")[:, :d_lat // tp]
        return matmul("latent_up", mine)
    return matmul("latent_up", routed) if me.latent_dim else routed


def expert_matmul(ctx: Context, m, x, slot, e_glob, turn):
    """x [bp, d_in] @ matrix m of the expert in `slot`, the turn-th applied -> [bp, d_out] f32."""
    ex, ys = ctx.experts, ctx.ys
    (r, c), mm = ex.lay.shapes[m], layout.expert_matmuls(ctx.spec)[m]
    xp = jnp.pad(x, ((0, 0), (0, r * ctx.cfg.tile - x.shape[1])))
    if ex.lay.fmt.name == "bf16" or ex.lay.decodes:
        expert_columns(ctx, m, xp.astype(BF16), slot, turn)
    else:
        expert_tiles(ctx, m, xp, slot)
    out = jnp.concatenate([ys[j] for j in range(c)], axis=1)[:, :mm.d_out] \
        if c > 1 else ys[0][:, :mm.d_out]
    return out * ex.glob[e_glob + m] if ex.glob is not None else out


def expert_columns(ctx: Context, m, xb, slot, turn):
    """Column block j of matrix m -> ys[j] by one dot of xb [bp, r * T] bf16 over its r row
    tiles: bf16 codes are the operand; other formats are first decoded with their scales
    into wbuf, `column_group` columns a pass, their scale chunks loaded aligned, each pass into
    the other half of wbuf than the one before (`ExpertLayout.decoded_rows`; the expert is the
    turn-th applied)."""
    ex, t, ys = ctx.experts, ctx.cfg.tile, ctx.ys
    lay, xfmt, slots = ex.lay, ex.lay.fmt, ex.slots
    (r, c), k0 = lay.shapes[m], lay.first_tile(m)

    def column_dot(j, w_rows):
        ys[j] = jnp.dot(xb, w_rows, preferred_element_type=F32)

    if xfmt.name == "bf16":
        lax.fori_loop(0, c, lambda j, cy: (column_dot(j, slots[slot, pl.ds(
            pl.multiple_of((k0 + j * r) * t, t), r * t)]), cy)[1], 0)
        return
    ch, cg = xfmt.chunk, lay.column_group(m)
    src, base = _scale_source(ex, m)
    sub = ch * xfmt.scale_rows
    half = lay.decoded_rows() // 2
    first = turn * sum(map(lay.passes, range(len(lay.shapes)))) + sum(map(lay.passes, range(m)))

    def decode(q, count, k_first, off):
        """Tiles q*ch .. q*ch + count - 1 (count static) into wbuf from tile k_first on, row off."""
        sc = src[slot, pl.ds(base + q * sub, sub)]
        for u in range(count):
            k = q * ch + u
            codes = slots[slot, pl.ds((k0 + k) * xfmt.code_rows, xfmt.code_rows)]
            w = quant.decoded_tile(codes, sc, u, xfmt)
            ex.decoded[pl.ds(pl.multiple_of(off + (k - k_first) * t, t), t)] = w

    def columns(p, n_cols):
        """Pass p: columns p * cg .. p * cg + n_cols - 1 (n_cols static)."""
        j0 = p * cg
        k_first, n_t = j0 * r, n_cols * r
        q0 = k_first // ch
        off = lax.rem(first + p, 2) * half
        if n_t // ch:
            lax.fori_loop(q0, q0 + n_t // ch,
                          lambda q, cy: (decode(q, ch, k_first, off), cy)[1], 0)
        if n_t % ch:
            decode(q0 + n_t // ch, n_t % ch, k_first, off)
        for jj in range(n_cols):
            column_dot(j0 + jj, ex.decoded[pl.ds(pl.multiple_of(off + jj * r * t, t), r * t)])

    if c // cg:
        lax.fori_loop(0, c // cg, lambda g, cy: (columns(g, cg), cy)[1], 0)
    if c % cg:
        columns(c // cg, c % cg)


def expert_tiles(ctx: Context, m, xp, slot):
    """Matrix m tile by tile (formats fed as fp8, whose scales cannot be folded into the
    operand): the tiles in chunks of xfmt.chunk (one aligned load of their scale rows), each
    fed to the MXU in its format (`quant.group_dot`), column block j accumulated in ys[j]."""
    ex, t, xs, ys = ctx.experts, ctx.cfg.tile, ctx.xs, ctx.ys
    lay, xfmt = ex.lay, ex.lay.fmt
    (r, c), k0 = lay.shapes[m], lay.first_tile(m)
    n_t, ch = r * c, xfmt.chunk
    for q in range(r):
        xs[q] = xp[:, q * t:(q + 1) * t]
    for j in range(c):
        ys[j] = jnp.zeros((ctx.cfg.padded_batch, t), F32)
    src, base = _scale_source(ex, m)
    sub = ch * xfmt.scale_rows

    def tiles(q, count):
        """Tiles q*ch .. q*ch + count - 1 (count static)."""
        sc = src[slot, pl.ds(base + q * sub, sub)] if xfmt.scale_rows else None
        for u in range(count):
            k = q * ch + u
            codes = ex.slots[slot, pl.ds((k0 + k) * xfmt.code_rows, xfmt.code_rows)]
            w = quant.mxu_operand(codes, xfmt)
            y = quant.group_dot(xs[lax.rem(k, r)], w,
                                quant.tile_scales(sc, u, xfmt) if sc is not None else None,
                                xfmt)
            j = k // r
            ys[j] = ys[j] + y

    if n_t // ch:
        lax.fori_loop(0, n_t // ch, lambda q, cy: (tiles(q, ch), cy)[1], 0)
    if n_t % ch:
        tiles(n_t // ch, n_t % ch)


def _scale_source(ex: ExpertRefs, m):
    """(the slots holding the experts' scales, first row of matrix m's scales in a slot)."""
    separate = ex.scale_slots is not None
    return (ex.scale_slots if separate else ex.slots,
            (0 if separate else ex.lay.code_rows) + ex.lay.scale_first_row(m))


# ----- head -----
def head(ctx: Context, x):
    """The final norm and lm_head -> the logits and the greedy next token of every row (the
    first maximum over the whole vocabulary); waits for the last KDA write-back."""
    with jax.named_scope("head"):
        ctx.for_vector_copies(ctx.n_layers, lambda cp: cp.wait())
        final = layout.unpack_vector(ctx.vbuf[ctx.n_layers % 2],
                                     layout.vector_layout(ctx.spec, None)["final_norm"])
        h = ref.rms_norm(x, final)
        lm_head = PartReader(ctx.ring, layout.part(ctx.spec, ctx.cfg, ("head", "lm_head")),
                             ctx.ring.s.first_bank[(ctx.n_layers + 1, "lm_head")], ctx.xs, ctx.ys)
        logits = lm_head.matmul(0, h)
        lm_head.finish()
        ctx.logits[...] = logits
        lane = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        best = _argmax_first(logits, lane)
        if ctx.tp > 1:
            best = _mesh_argmax(ctx, logits, best)
        ctx.next_tokens[...] = jnp.broadcast_to(best, ctx.next_tokens.shape)
        if ctx.kda is not None:
            ctx.kda.await_write_back()


def _mesh_argmax(ctx: Context, logits, best):
    """The global index of the first maximum over every vocabulary shard, from this shard's
    logits and local index `best` ([Bp, 1] int32)."""
    d_out = stream_mod.lm_head_matmul(ctx.spec).d_out
    mx = jnp.max(logits, axis=-1, keepdims=True)
    idx = (best + ctx.me[0] * d_out).astype(F32)
    pairs = ctx.comm.all_gather(jnp.concatenate([mx, idx], axis=1), "argmax")  # [bp, 2 tp]
    pl_lane = lax.broadcasted_iota(jnp.int32, pairs.shape, 1)
    at = _argmax_first(jnp.where(pl_lane % 2 == 0, pairs, -jnp.inf), pl_lane)
    return jnp.sum(jnp.where(pl_lane == at + 1, pairs, 0.0), axis=1,
                   keepdims=True).astype(jnp.int32)


def perfmodel_layer(attention: str, ffn: str) -> Layer:
    """A stand-in layer of the given kinds (layouts depend only on the kinds)."""
    return Layer(1, attention, ffn)


def expert_padding_bytes(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int]:
    """(zero bytes among one expert's codes, among its scales): the tiles' zeros around
    matrices that do not fill whole T x T tiles, and the scale rows that pad a matrix's last
    scale chunk (with their tiles' scale rows beyond the matrix)."""
    lay = layout.expert_layout(spec, cfg)
    f, t = lay.fmt, cfg.tile
    per_value = np.dtype(f.code_dtype).itemsize / (2 if f.name in quant.FOUR_BIT else 1)
    mms = layout.expert_matmuls(spec)
    codes = sum((r * c * t * t - mm.d_in * mm.d_out) * per_value
                for (r, c), mm in zip(lay.shapes, mms))
    if not f.scale_rows:
        return int(codes), 0
    item = np.dtype(f.scale_dtype).itemsize
    g = f.group if f.group < t else None
    used = sum((math.ceil(mm.d_in / g) if g else math.ceil(mm.d_in / t)) * mm.d_out
               for mm in mms) * item
    return int(codes), int(lay.scale_rows * t * item - used)


def _shapes(spec: ModelSpec, cfg: KernelConfig):
    """(output shapes, scratch shapes) of the pallas_call."""
    bp, t, e = cfg.padded_batch, cfg.tile, spec.moe.experts if spec.moe else 1
    caches = ref.cache_shapes(spec, cfg.batch, cfg.max_context)
    n_moe = spec.count(ffn="moe")
    tp = layout.tp_of(spec)
    out = [jax.ShapeDtypeStruct((bp, layout.LANES), jnp.int32),
           jax.ShapeDtypeStruct((bp, spec.vocab // tp), F32)]
    out += [jax.ShapeDtypeStruct(s, d) for s, d in caches.values()]
    out.append(jax.ShapeDtypeStruct((max(n_moe, 1),), jnp.int32))
    if tp > 1:
        out.append(jax.ShapeDtypeStruct((len(comm_mod.KINDS),), jnp.int32))
    lay = layout.expert_layout(spec, cfg) if n_moe else None
    rows_c, rows_s = lay.rows if lay else (t, 0)
    code_dtype = lay.fmt.code_dtype if lay else BF16
    rmax, cmax = layout.max_row_col_tiles(spec, cfg)
    scratch = [pltpu.VMEM((cfg.depth, cfg.bank_rows, t), BF16),
               pltpu.SemaphoreType.DMA((cfg.depth,)),
               pltpu.VMEM((cfg.expert_slots, rows_c, t), code_dtype),
               pltpu.SemaphoreType.DMA((cfg.expert_slots,)),
               pltpu.VMEM((2, layout.vector_rows(spec), layout.LANES), BF16),
               pltpu.SemaphoreType.DMA((2,)),
               pltpu.VMEM(layout.embedding_tiles(spec, cfg), BF16), pltpu.SemaphoreType.DMA((4,)),
               pltpu.VMEM((rmax, bp, t), F32), pltpu.VMEM((cmax, bp, t), F32)]
    if rows_s:
        scratch.append(pltpu.VMEM((cfg.expert_slots, rows_s, t), lay.fmt.scale_dtype))
    if "kda_state" in caches:
        scratch += [pltpu.VMEM(caches["kda_state"][0][1:], F32),
                    pltpu.VMEM(caches["kda_conv"][0][1:], caches["kda_conv"][1]),
                    pltpu.SemaphoreType.DMA((4,)), pltpu.SMEM((1,), jnp.int32)]
    if "mla_latent" in caches:
        d = caches["mla_latent"][0][-1]
        scratch += [pltpu.VMEM((3, cfg.cache_block, d), BF16),
                    pltpu.VMEM((cfg.batch, layout.cache_window(cfg), d), BF16),
                    pltpu.SemaphoreType.DMA((3,))]
    if n_moe:
        scratch += [pltpu.VMEM((1, e), jnp.int32), pltpu.SMEM((1, e), jnp.int32),
                    pltpu.SMEM((e,), jnp.int32)]
        if lay.decodes:
            scratch.append(pltpu.VMEM((lay.decoded_rows(), t), BF16))
    if tp > 1:
        for (kind, dtype), (send, recv) in comm_mod.buffer_shapes(
                spec, cfg, comm_mod.collective_widths(spec, cfg), tp).items():
            scratch += [pltpu.VMEM(send, dtype), pltpu.VMEM(recv, dtype)]
        scratch.append(pltpu.SemaphoreType.DMA((2, len(comm_mod.KINDS), 2)))
    return out, scratch


def _n_inputs(spec: ModelSpec, cfg: KernelConfig) -> tuple[int, int, int]:
    """(SMEM inputs, HBM weight inputs, cache inputs) of the pallas_call."""
    tp, n_moe = layout.tp_of(spec), spec.count(ffn="moe")
    lay = layout.expert_layout(spec, cfg) if n_moe else None
    smem = 7 + bool(lay and lay.fmt.global_scale) + (tp > 1)
    hbm = 4 + bool(lay and lay.rows[1])
    return smem, hbm, len(ref.cache_shapes(spec, cfg.batch, cfg.max_context))


def build_call(spec: ModelSpec, cfg: KernelConfig, interpret=None, record: list | None = None,
               vmem_limit_bytes: int | None = None, barrier: bool = True):
    """The pallas_call: (token rows [Bp], positions [B], accepted rows [B], layer table, bank
    first rows, bank size classes, device index, (nvfp4 global scales,) (exchange counts,)
    embed, static, experts, vectors, (expert scales,) *caches) -> (next [Bp, 128], logits
    [Bp, V], *caches, distinct experts per MoE layer, (exchange counts)); token row r of
    sequence b at r * B + b (`reference.verify_inputs`). barrier=False leaves out the entry
    barrier of a mesh call: only for the test that shows why it is there."""
    out_shapes, scratch = _shapes(spec, cfg)
    n_smem, n_hbm, n_cache = _n_inputs(spec, cfg)
    tp = layout.tp_of(spec)
    smem, anyspace = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)
    vmem_block = pl.BlockSpec(memory_space=pltpu.VMEM)
    aliases = {n_smem + n_hbm + k: 2 + k for k in range(n_cache)}
    if tp > 1:
        aliases[n_smem - 1] = len(out_shapes) - 1
    params = dict(collective_id=COLLECTIVE_ID) if tp > 1 else {}
    if not interpret:
        params["vmem_limit_bytes"] = vmem_limit_bytes
    return pl.pallas_call(
        functools.partial(_kernel, spec, cfg, record, barrier),
        out_shape=tuple(out_shapes),
        in_specs=[smem] * n_smem + [anyspace] * (n_hbm + n_cache),
        out_specs=tuple([vmem_block, vmem_block] + [anyspace] * n_cache
                        + [smem] * (len(out_shapes) - 2 - n_cache)),
        scratch_shapes=scratch,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(**params) if params else None,
        interpret=interpret)


def static_inputs(spec: ModelSpec, cfg: KernelConfig) -> list[np.ndarray]:
    """The layer table and the bank tables (first row, size class), as the kernel reads them."""
    return [layout.layer_table(spec, cfg),
            *stream_mod.bank_tables(layout.static_stream(spec, cfg))]


def call_args(spec: ModelSpec, cfg: KernelConfig) -> list[jax.ShapeDtypeStruct]:
    """The pallas_call's arguments as abstract values (for tracing and lowering)."""
    t, bp, n_moe, tp = cfg.tile, cfg.padded_batch, spec.count(ffn="moe"), layout.tp_of(spec)
    e = (spec.local_experts if tp > 1 else spec.moe.experts) if spec.moe else 1
    lay = layout.expert_layout(spec, cfg) if n_moe else None
    sds = jax.ShapeDtypeStruct
    args = [sds((bp,), jnp.int32), sds((cfg.batch,), jnp.int32), sds((cfg.batch,), jnp.int32)]
    args += [sds(a.shape, jnp.int32) for a in static_inputs(spec, cfg)]
    args.append(sds((1,), jnp.int32))
    if lay and lay.fmt.global_scale:
        args.append(sds((n_moe * e * 2,), F32))
    if tp > 1:
        args.append(sds((len(comm_mod.KINDS),), jnp.int32))
    args += [sds((layout.embed_rows(spec), spec.hidden // tp), BF16),
             sds((layout.static_stream(spec, cfg).rows, t), BF16),
             sds((n_moe, e, lay.rows[0], t), lay.fmt.code_dtype) if n_moe else
             sds((1, 1, t, t), BF16),
             sds((len(spec.layers) + 1, layout.vector_rows(spec), layout.LANES), BF16)]
    if lay and lay.rows[1]:
        args.append(sds((n_moe, e, lay.rows[1], t), lay.fmt.scale_dtype))
    return args + [sds(s, d) for s, d in
                   ref.cache_shapes(spec, cfg.batch, cfg.max_context).values()]


def kernel_equations(spec: ModelSpec, cfg: KernelConfig) -> int:
    """Equations in the kernel body's jaxpr, sub-jaxprs (loops, conds) included: the trace
    size, which must not grow with the layer count."""
    closed = jax.make_jaxpr(build_call(spec, cfg))(*call_args(spec, cfg))
    kernel = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")

    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub)
        return n
    return count(kernel.params["jaxpr"])


def step_inputs(cfg: KernelConfig, tokens, positions, accepted):
    """(token rows padded to cfg.padded_batch, positions [B], accepted [B]) for the kernel, from
    tokens [B] (cfg.rows 1) or [B, cfg.rows] (`reference.verify_inputs`; accepted None: all)."""
    flat, positions, accepted, rows = ref.verify_inputs(cfg.batch, tokens, positions, accepted)
    require(rows == cfg.rows, "rows", rows, f"the kernel was built for rows={cfg.rows}")
    return jnp.pad(flat, (0, cfg.padded_batch - cfg.token_rows)), positions, accepted


def weight_args(packed: Packed, cfg: KernelConfig) -> tuple[list, list]:
    """(SMEM weight inputs, HBM weight inputs) of packed weights, in the call's order; a
    SpecError unless they are laid out for cfg's tile and banks (packed for another bank size,
    the ring reads other rows, past the stream's end on the chip)."""
    require(packed.banks == (cfg.tile, cfg.bank_rows), "packed.banks", packed.banks,
            f"(tile, bank_rows) of this config is ({cfg.tile}, {cfg.bank_rows}): pack the "
            "weights for it (layout.pack_weights, layout.with_banks)")
    smem = [] if packed.expert_global is None else [packed.expert_global]
    hbm = [packed.embed, packed.static, packed.experts, packed.vectors]
    hbm += [] if packed.expert_scales is None else [packed.expert_scales]
    return smem, hbm


@functools.partial(jax.jit, static_argnames=("static", "cfg", "interpret", "vmem_limit_bytes"),
                   donate_argnames=("cache",))
def _step(packed, cache, tokens, positions, accepted, *, static, cfg, interpret,
          vmem_limit_bytes=None):
    spec = static.spec
    names = list(ref.cache_shapes(spec, cfg.batch, cfg.max_context))
    smem, hbm = weight_args(packed, cfg)
    outs = build_call(spec, cfg, interpret, vmem_limit_bytes=vmem_limit_bytes)(
        tokens, positions, accepted, *map(jnp.asarray, static_inputs(spec, cfg)),
        jnp.zeros(1, jnp.int32), *smem, *hbm, *[cache[k] for k in names])
    nxt, logits, *caches, ndist = outs
    return nxt[:, 0], logits, dict(zip(names, caches)), ndist[:spec.count(ffn="moe")]


def make_step(spec: ModelSpec, cfg: KernelConfig, interpret=None):
    """Validate once (spec, config, VMEM budget: SpecError if it does not fit) and return
    step(packed, cache, tokens, positions, accepted=None) -> (next tokens, logits f32, new
    cache, distinct experts fetched per MoE layer [n_moe]): tokens [B] -> next [B], logits
    [B, V]; a verify block tokens [B, cfg.rows] -> next [B, rows], logits [B, rows, V], only
    the first accepted[b] rows of each sequence written to the caches (default all). The cache
    (as `reference.init_cache`) is donated and updated in place. interpret: None on a TPU, or a
    `pltpu.InterpretParams`."""
    return functools.partial(verify_step, functools.partial(_step, **_step_options(
        spec, cfg, interpret)), cfg)


def _step_options(spec: ModelSpec, cfg: KernelConfig, interpret) -> dict:
    """`_step`'s static arguments, the VMEM budget checked (SpecError if it does not fit)."""
    budget = vmem.check_vmem(spec, cfg)
    return dict(static=ref.StaticSpec(spec), cfg=cfg, interpret=interpret,
                vmem_limit_bytes=None if interpret else budget.capacity_bytes)


def make_loop(spec: ModelSpec, cfg: KernelConfig, interpret=None):
    """Validate once (as `make_step`) and return loop(packed, cache, tokens [B], positions [B],
    steps) -> (tokens [B] after `steps` (a traced int32) greedy decode steps run in one jitted
    program (a loop around the pallas_call: one host dispatch for all of them), new cache, the
    distinct experts each MoE layer picked in each step as `reference.make_loop` returns them):
    the kernel's time per step is the slope of a call's time over `steps`, and one compile serves
    every count."""
    require(cfg.rows == 1, "rows", cfg.rows, "the decode loop runs one row per sequence")
    budget = vmem.check_vmem(spec, cfg)
    call = build_call(spec, cfg, interpret,
                      vmem_limit_bytes=None if interpret else budget.capacity_bytes)
    names = list(ref.cache_shapes(spec, cfg.batch, cfg.max_context))
    static = [jnp.asarray(a) for a in static_inputs(spec, cfg)]
    accepted = jnp.ones((cfg.batch,), jnp.int32)
    n_moe = spec.count(ffn="moe")

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def loop(packed, cache, tokens, positions, steps):
        smem, hbm = weight_args(packed, cfg)

        def body(i, carry):
            tok, pos, caches, picks = carry
            flat = jnp.pad(tok, (0, cfg.padded_batch - cfg.batch))
            nxt, _, *caches, ndist = call(flat, pos, accepted, *static, jnp.zeros(1, jnp.int32),
                                          *smem, *hbm, *caches)
            return nxt[:cfg.batch, 0], pos + 1, caches, picks.at[i].set(ndist[:n_moe], mode="drop")
        picks0 = jnp.zeros((ref.PICKS_KEPT, n_moe), jnp.int32)
        tok, _, caches, picks = lax.fori_loop(
            0, steps, body, (tokens, positions, [cache[k] for k in names], picks0))
        return tok, dict(zip(names, caches)), picks
    return loop


def lower_step(spec: ModelSpec, cfg: KernelConfig, packed, cache, tokens, positions,
               accepted=None, interpret=None):
    """The jitted program behind `make_step`'s step, lowered for these inputs: `.compile()`
    compiles it ahead, and `verify_step(compiled, cfg, ...)` runs it as the step does."""
    return _step.lower(packed, cache, *step_inputs(cfg, tokens, positions, accepted),
                       **_step_options(spec, cfg, interpret))


def verify_step(run, cfg, packed, cache, tokens, positions, accepted=None):
    """The step of `make_step`: inputs to the kernel's token-row layout, run, outputs back."""
    nxt, logits, cache, ndist = run(packed, cache, *step_inputs(cfg, tokens, positions, accepted))
    return (*ref.verify_outputs(nxt, logits, cfg.batch, cfg.rows, jnp.ndim(tokens) == 2), cache,
            ndist)


def decode_step(spec: ModelSpec, cfg: KernelConfig, packed: Packed, cache, tokens, positions,
                accepted=None, interpret=None):
    """One decode (or verify) step in one pallas_call (see `make_step`), checking the inputs'
    ranges first (positions + rows - 1 in [0, max_context), tokens in [0, vocab))."""
    pos, tok = np.asarray(positions), np.asarray(tokens)
    require(pos.shape == (cfg.batch,), "positions.shape", pos.shape,
            f"expected ({cfg.batch},) = (cfg.batch,)")
    require(bool(((pos >= 0) & (pos + cfg.rows <= cfg.max_context)).all()), "positions",
            pos.tolist(), f"must lie in [0, max_context - rows = {cfg.max_context - cfg.rows}] "
            "(the cache is written in place)")
    require(bool(((tok >= 0) & (tok < spec.vocab)).all()), "tokens", tok.tolist(),
            f"must lie in [0, vocab={spec.vocab})")
    return make_step(spec, cfg, interpret)(packed, cache, jnp.asarray(tokens),
                                           jnp.asarray(positions), accepted)
