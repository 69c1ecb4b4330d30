"""The Pallas TPU megakernel: a whole hybrid-MoE decode step in one `pallas_call`.

Weights stay in HBM (`memory_space=ANY`). Static weight tiles stream through a ring of `depth`
VMEM banks: the copy of tile g+depth is issued as soon as tile g has been consumed, across layer
and phase boundaries, so the ring keeps prefetching through routing and attention. After each
MoE router, the top-k picks are reduced to a mask of used experts, moved VMEM -> SMEM, compacted
into ascending expert ids in SMEM by scalar code, and the experts are fetched by data-dependent
DMAs into `expert_slots` VMEM slots (expert j goes to slot j mod slots; expert j+slots is fetched
as soon as expert j has been applied). The KDA state / conv window and the MLA latent cache live
in HBM, aliased in and out; they are prefetched at the start of their layer (MLA: only the
blocks holding positions < pos) and written back in place (KDA: whole state; MLA: one row).
A step may verify a block of `cfg.rows` tokens per sequence (causal within the block; only the
first `accepted` rows of each sequence update the caches; see `make_step`). Every DMA issue
site also records itself (`Dma.note`) so that `kernels.plan` derives the DMA plan from the
kernel's own code. Numerics follow `kernels.reference` (same helpers).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from perfmodel.spec.arch import Layer, ModelSpec
from perfmodel.util.errors import require

from . import comm, layout, quant, reference as ref, shard, vmem
from .comm import Comm
from .layout import KernelConfig, Packed

F32, BF16 = jnp.float32, jnp.bfloat16


class Dma:
    """Issues nothing itself; records each DMA issue site (in program order) for the plan.

    A record is a dict(site, scope, when, layer, family, name, bytes, routed); scope is "pre"
    (before the layer loop), "loop" (the loop body, traced once for all layers) or "post"
    (the head); when is None or the ("attention" | "ffn", kind) of the branch it lies in; site
    is "copy" (one copy; layer None = the loop's current layer), "ring_start" (the first
    `depth` static tiles), "ring" (the tiles of matmul `name` of the current layer, each
    followed by the issue of the tile `depth` ahead), "vectors" (the vector block of layer
    `layer` relative to the current one), "experts" (one copy per distinct expert picked) or
    "cache_blocks" (per sequence, ceil(pos / block) copies); waits are recorded as site "wait"
    (name = the copies waited for) so that orderings can be checked."""

    def __init__(self, record: list | None):
        self.record, self.scope, self.when = record, "pre", None

    def note(self, site, layer=None, family=None, name="", nbytes=0, routed=False):
        if self.record is not None:
            self.record.append(dict(site=site, scope=self.scope, when=self.when, layer=layer,
                                    family=family, name=name, bytes=int(nbytes), routed=routed))

    def branch(self, when):
        """Records of `fn` (traced inside a cond branch) are tagged with `when`."""
        def wrap(fn):
            def traced(*a):
                outer, self.when = self.when, when
                try:
                    return fn(*a)
                finally:
                    self.when = outer
            return traced
        return wrap


def _tiled_matmul(x, rows, cols, d_out, tile, xs, ys):
    """x [bp, d_in] f32 @ W -> [bp, d_out] f32, W given tile by tile: tile(k, use) calls
    use(bf16 value [T, T]) on tile k = j*rows + i (column block j outer) and returns its result. The
    input's row tiles go to VMEM scratch xs, the output blocks to ys; both loops are fori_loops
    (the trace does not grow with the matrix)."""
    t = xs.shape[-1]
    pad = -x.shape[1] % t
    if pad:
        x = jnp.concatenate([x, jnp.zeros((x.shape[0], pad), F32)], axis=1)
    for i in range(rows):
        xs[i] = x[:, i * t:(i + 1) * t]

    def col(j, carry):
        def row(i, acc):
            return acc + tile(j * rows + i, lambda w: jnp.dot(
                xs[i].astype(BF16), w, preferred_element_type=F32))
        ys[j] = lax.fori_loop(0, rows, row, jnp.zeros(ys.shape[1:], F32))
        return carry

    lax.fori_loop(0, cols, col, 0)
    return jnp.concatenate([ys[j] for j in range(cols)], axis=1)[:, :d_out]


class _Ring:
    """The static weight stream through `depth` VMEM banks; tile g lives in bank g mod depth
    (g may be a traced index: the loop body computes it from the layer table)."""

    def __init__(self, cfg, n_tiles, hbm, banks, sems, xs, ys, dma):
        self.cfg, self.n, self.hbm, self.banks, self.sems = cfg, n_tiles, hbm, banks, sems
        self.xs, self.ys, self.dma = xs, ys, dma

    def _copy(self, g):
        b = lax.rem(g, self.cfg.depth)
        return pltpu.make_async_copy(self.hbm.at[g], self.banks.at[b], self.sems.at[b])

    def start(self):
        self.dma.note("ring_start")
        for g in range(min(self.cfg.depth, self.n)):
            self._copy(g).start()

    def tile(self, g, use):
        """Wait for tile g, use(its value), then issue tile g + depth into the freed bank."""
        self._copy(g).wait()
        out = use(self.banks[lax.rem(g, self.cfg.depth)])
        nxt = g + self.cfg.depth

        @pl.when(nxt < self.n)
        def _():
            self._copy(nxt).start()
        return out

    def matmul(self, name, g0, x, rows, cols, d_out):
        """x [bp, d_in] @ the matmul whose first tile is g0 -> [bp, d_out] f32."""
        self.dma.note("ring", name=name)
        return _tiled_matmul(x, rows, cols, d_out, lambda k, use: self.tile(g0 + k, use),
                             self.xs, self.ys)

    def matrix(self, name, g0, rows, cols, d_in, d_out, buf):
        """The whole matrix [d_in, d_out] as a bf16 value, its tiles gathered in VMEM buf."""
        self.dma.note("ring", name=name)

        def body(k, carry):
            def use(w):
                buf[k] = w
                return 0
            self.tile(g0 + k, use)
            return carry
        lax.fori_loop(0, rows * cols, body, 0)
        full = jnp.concatenate([jnp.concatenate([buf[j * rows + i] for i in range(rows)], axis=0)
                                for j in range(cols)], axis=1)
        return full[:d_in, :d_out]


def _argmax_first(x, iota):
    """Index of the first maximum along the last axis, [rows, 1] int32."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1, keepdims=True)


def _switch(pred_is_first, kinds, fns, *args):
    """fns[kinds[0]](*args) if only one kind is present, else a cond on the traced predicate."""
    if len(kinds) == 1:
        return fns[kinds[0]](*args)
    return lax.cond(pred_is_first, fns[kinds[0]], fns[kinds[1]], *args)


def _kernel(spec: ModelSpec, cfg: KernelConfig, record, *refs):
    n_kda, n_mla = spec.count(attention="kda"), spec.count(attention="mla")
    n_moe, n_layers = spec.count(ffn="moe"), len(spec.layers)
    refs = list(refs)
    take = lambda k: [refs.pop(0) for _ in range(k)]
    tok_ref, pos_ref, acc_ref, table, me_ref, emb_hbm, static_hbm, exp_hbm, vec_hbm = take(9)
    xfmt = layout.expert_format(spec, cfg) if n_moe else None
    quantised = xfmt is not None and xfmt.name != "bf16"
    (exp_scale_hbm,) = take(1) if quantised else (None,)
    take(2 * bool(n_kda) + bool(n_mla))  # cache inputs: aliased to the cache outputs below
    next_ref, logits_ref = take(2)
    kda_state, kda_conv = take(2) if n_kda else (None, None)
    (mla_cache,) = take(1) if n_mla else (None,)
    (ndist_ref,) = take(1)
    ring_buf, ring_sem, slot_buf, slot_sem, vbuf, vsem, xrows, misc_sem, xs, ys = take(10)
    (scale_buf,) = take(1) if quantised else (None,)
    if n_kda:
        state_buf, conv_buf, kda_sem, kda_flag = take(4)
    if n_mla:
        cache_buf, newrow, kvb_buf, kv_sem = take(4)
    if n_moe:
        mask_v, mask_s, ids_s = take(3)
    tp = layout.tp_of(spec)
    comm = Comm(tp, me_ref, *take(4), hierarchical=cfg.hierarchical) if tp > 1 else \
        Comm(1, me_ref, None, None, None, None)
    assert not refs

    b_real, n_rows, n_real, bp, t = cfg.batch, cfg.rows, cfg.token_rows, cfg.padded_batch, cfg.tile
    h_dim = spec.hidden
    dma = Dma(record)
    stream = layout.static_stream(spec, cfg)
    n_tiles = sum(tm.tiles for tm in stream)
    ring = _Ring(cfg, n_tiles, static_hbm, ring_buf, ring_sem, xs, ys, dma)
    att_kinds = sorted({l.attention for l in spec.layers}, key=layout.ATTENTION_IDS.get)
    ffn_kinds = sorted({l.ffn for l in spec.layers}, key=layout.FFN_IDS.get)
    row = lax.broadcasted_iota(jnp.int32, (bp, 1), 0)
    real = row < n_real  # token rows: row r of sequence b at r * b_real + b, then padding

    def matmuls_of(i, attention=None, ffn=None):
        """matmul(name, x) for layer i's attention (or FFN) part, tiles from the layer table."""
        offs = layout.layer_tiles(spec, cfg, attention, ffn)
        g_first = table[i, layout.FIRST if attention else layout.FFN_FIRST]
        d_out = {mm.name: mm.d_out for mm in (spec.attention_matmuls(attention) if attention
                                              else spec.ffn_matmuls(ffn))}

        def matmul(name, x):
            off, r, c = offs[name]
            y = ring.matmul(name, g_first + off, x, r, c, d_out[name])
            if name in shard.GATHERED:
                return comm.all_gather(y)
            return comm.all_reduce(y) if name in ("o_proj", "down") else y
        matmul.offsets, matmul.first = offs, g_first
        return matmul

    # ----- small vectors: double-buffered, layer i+1's block issued when layer i starts -------
    def vector_copies(entry, attention, with_router):
        """The copies of vector entry `entry` (traced; n_layers = final norm) for a layer kind."""
        layer = None if attention is None else \
            perfmodel_layer(attention, "moe" if with_router else "dense")
        slot = lax.rem(entry, 2)
        return [pltpu.make_async_copy(vec_hbm.at[entry, pl.ds(r, n)],
                                      vbuf.at[slot, pl.ds(r, n)], vsem.at[slot])
                for _, r, n in layout.vector_copies(spec, layer)]

    def for_vector_copies(entry, fn):
        """fn(copy) for each copy of entry's block (entry: an int, or traced in the loop, where
        the copies are chosen by the entry's kinds from the layer table)."""
        def each(attention, with_router):
            for cp in vector_copies(entry, attention, with_router):
                fn(cp)
        if isinstance(entry, int):
            layer = (*spec.layers, None)[entry]
            return each(layer and layer.attention, layer is not None and layer.ffn == "moe")
        last = entry == n_layers
        pl.when(last)(lambda: each(None, False))
        safe = jnp.minimum(entry, n_layers - 1)
        for a in att_kinds:
            for f in ffn_kinds:
                hit = jnp.logical_and(table[safe, layout.ATT] == layout.ATTENTION_IDS[a],
                                      table[safe, layout.FFN] == layout.FFN_IDS[f])
                pl.when(jnp.logical_and(jnp.logical_not(last), hit))(
                    lambda a=a, f=f: each(a, f == "moe"))

    def vectors_of(slot, attention=None, ffn=None):
        """name -> f32 value of the block in vbuf slot, for one attention (or FFN) kind."""
        lay = layout.vector_layout(spec, perfmodel_layer(attention or att_kinds[0],
                                                         ffn or "dense"))
        rows = vbuf[slot]
        keep = ("router_bias",) if ffn else tuple(n for n in lay if n != "router_bias")
        return {name: layout.unpack_vector(rows, lay[name]) for name in keep if name in lay}

    # ----- embedding -----
    with jax.named_scope("embed"):
        ring.start()
        if n_kda:
            kda_flag[0] = 0
        if tp > 1:
            comm.counter[0] = comm.counter[1] = comm.counter[2] = 0
        dma.note("vectors", layer=0)
        for_vector_copies(0, lambda cp: cp.start())
        emb = [pltpu.make_async_copy(emb_hbm.at[tok_ref[b]], xrows.at[b], misc_sem.at[0])
               for b in range(n_real)]
        for cp in emb:
            dma.note("copy", 0, "embedding", "embedding row", h_dim // tp * 2)
            cp.start()
        for cp in emb:
            cp.wait()
        x = comm.all_gather(jnp.where(real, xrows[:, 0, :].astype(F32), 0.0))

    # ----- attention kinds -----
    def kda_writes(o):
        return [pltpu.make_async_copy(state_buf, kda_state.at[o], kda_sem.at[2]),
                pltpu.make_async_copy(conv_buf, kda_conv.at[o], kda_sem.at[3])]

    def accepted():
        """Rows kept per sequence, [b_real, 1] int32 (from SMEM)."""
        seq = lax.broadcasted_iota(jnp.int32, (b_real, 1), 0)
        out = jnp.zeros((b_real, 1), jnp.int32)
        for b in range(b_real):
            out = jnp.where(seq == b, acc_ref[b], out)
        return out

    @dma.branch(("attention", "kda"))
    def kda_attention(i, h):
        o = table[i, layout.ATT_ORD]
        v = vectors_of(lax.rem(i, 2), attention="kda")

        @pl.when(kda_flag[0] == 1)  # the previous KDA layer's write-back
        def _():
            for cp in kda_writes(0):
                cp.wait()
        reads = [pltpu.make_async_copy(kda_state.at[o], state_buf, kda_sem.at[0]),
                 pltpu.make_async_copy(kda_conv.at[o], conv_buf, kda_sem.at[1])]
        sizes = [kda_state.size // kda_state.shape[0] * 4,
                 kda_conv.size // kda_conv.shape[0] * kda_conv.dtype.itemsize]
        for nm, nb, cp in zip(("kda state", "conv window"), sizes, reads):
            dma.note("copy", None, "state", nm, nb)
            cp.start()

        def load_state():
            for cp in reads:
                cp.wait()
            return state_buf[...], conv_buf[...]

        out, st, win = ref.kda_block(spec, matmuls_of(i, attention="kda"), v, load_state, h,
                                     accepted(), n_rows)
        state_buf[...] = st
        conv_buf[...] = win.astype(conv_buf.dtype)
        for nm, nb, cp in zip(("kda state", "conv window"), sizes, kda_writes(o)):
            dma.note("copy", None, "state", nm + " (write back)", nb)
            cp.start()
        kda_flag[0] = 1
        return out

    @dma.branch(("attention", "mla"))
    def mla_attention(i, h):
        m = spec.mla
        o, cb, r = table[i, layout.ATT_ORD], cfg.cache_block, m.kv_lora_rank
        v = vectors_of(lax.rem(i, 2), attention="mla")
        matmul = matmuls_of(i, attention="mla")

        def tile_copy(b, k):  # token tile k of sequence b into buffer k mod 3
            return pltpu.make_async_copy(mla_cache.at[o, b, pl.ds(k * cb, cb)],
                                         cache_buf.at[k % 3], kv_sem.at[k % 3])

        def n_tiles(b):  # tiles holding positions < pos
            return (pos_ref[b] + cb - 1) // cb

        def start_first(b):
            for k in range(min(2, cfg.max_context // cb)):
                pl.when(k < n_tiles(b))(lambda k=k: tile_copy(b, k).start())

        row_bytes = (r + m.qk_rope_dim) * mla_cache.dtype.itemsize
        dma.note("cache_blocks", None, "kv_cache", "latent cache block", cb * row_bytes)
        if b_real:
            start_first(0)  # overlaps the projections
        q_nope, q_rope, c_new = ref.mla_project(spec, matmul, v, h)
        off, kr, kc = matmul.offsets["kv_b"]
        kv_b = ring.matrix("kv_b", matmul.first + off, kr, kc, r,
                           m.heads * (m.qk_nope_dim + m.v_head_dim), kvb_buf)
        # absorbed form, flash-style: the new token first, then the cached tiles of each
        # sequence with an online softmax (3 buffers: tiles k+1, k+2 in flight while k is used)
        w_uk, w_uv = ref.split_kv_b(spec, kv_b)
        c_new = c_new.astype(BF16).astype(F32)
        q_lat = jnp.einsum("bhn,rhn->bhr", q_nope, w_uk)
        scale = (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
        nt = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
        hr = m.heads * n_rows  # query rows of one sequence: (draft row, head)
        # causal within the verify block: query row (rr, head) sees block rows 0..rr
        causal = lax.broadcasted_iota(jnp.int32, (hr, n_rows), 1) <= \
            lax.broadcasted_iota(jnp.int32, (hr, n_rows), 0) // m.heads
        ctxs = []
        for b in range(b_real):
            if b:
                start_first(b)
            mine = [rr * b_real + b for rr in range(n_rows)]  # this sequence's token rows
            ql = jnp.concatenate([q_lat[k] for k in mine])    # [rows * heads, r]
            qr = jnp.concatenate([q_rope[k] for k in mine])
            blk = jnp.concatenate([c_new[k:k + 1] for k in mine])  # [rows, r + rope]
            s_b = (lax.dot_general(ql, blk[:, :r], nt)
                   + lax.dot_general(qr, blk[:, r:], nt)) * scale
            s_b = jnp.where(causal, s_b, -jnp.inf)
            mx0 = jnp.max(s_b, axis=-1, keepdims=True)
            p0 = jnp.exp(s_b - mx0)

            def body(k, carry, b=b, ql=ql, qr=qr):
                mx, den, acc = carry
                tile_copy(b, k).wait()
                pl.when(k + 2 < n_tiles(b))(lambda: tile_copy(b, k + 2).start())
                c = cache_buf[k % 3].astype(F32)
                s = (lax.dot_general(ql, c[:, :r], nt) + lax.dot_general(qr, c[:, r:], nt)) \
                    * scale
                t_pos = k * cb + lax.broadcasted_iota(jnp.int32, s.shape, 1)
                s = jnp.where(t_pos < pos_ref[b], s, -jnp.inf)
                new_mx = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True))
                alpha, p = jnp.exp(mx - new_mx), jnp.exp(s - new_mx)
                return (new_mx, den * alpha + jnp.sum(p, axis=-1, keepdims=True),
                        acc * alpha + jnp.dot(p, c[:, :r]))
            mx, den, acc = lax.fori_loop(
                0, n_tiles(b), body,
                (mx0, jnp.sum(p0, axis=-1, keepdims=True), jnp.dot(p0, blk[:, :r])))
            ctxs.append((acc / den).reshape(n_rows, m.heads, r))
        ctx = jnp.stack([ctxs[b][rr] for rr in range(n_rows) for b in range(b_real)]
                        + [jnp.zeros((m.heads, r), F32)] * (bp - n_real))
        dma.note("wait", name="latent cache block")
        # the new rows are written only now (no write overlaps a tile read of the same range),
        # and only the accepted rows of each sequence
        newrow[:, 0, :] = c_new.astype(BF16)
        writes = [(rr < acc_ref[b], pltpu.make_async_copy(
            newrow.at[rr * b_real + b], mla_cache.at[o, b, pl.ds(pos_ref[b] + rr, 1)],
            misc_sem.at[2])) for b in range(b_real) for rr in range(n_rows)]
        dma.note("cache_rows", None, "kv_cache", "latent cache row (write)", row_bytes)
        for keep, cp in writes:
            pl.when(keep)(cp.start)
        out = ref.mla_output(spec, matmul, jnp.einsum("bhr,rhv->bhv", ctx, w_uv), h)
        dma.note("wait", name="latent cache row (write)")
        for keep, cp in writes:
            pl.when(keep)(cp.wait)
        return out

    # ----- FFN kinds -----
    @dma.branch(("ffn", "dense"))
    def dense_ffn(i, h):
        matmul = matmuls_of(i, ffn="dense")
        return matmul("down", ref.swiglu(matmul("gate_up", h)))

    @dma.branch(("ffn", "moe"))
    def moe(i, h):
        me, e_n = spec.moe, spec.moe.experts
        mo = table[i, layout.MOE_ORD]
        matmul = matmuls_of(i, ffn="moe")
        lane = lax.broadcasted_iota(jnp.int32, (bp, e_n), 1)
        with jax.named_scope("router"):
            logits = matmul("router", h)
            scores = jax.nn.sigmoid(logits)
            sel = scores + vectors_of(lax.rem(i, 2), ffn="moe")["router_bias"]
            picked = jnp.zeros((bp, e_n), jnp.bool_)
            for _ in range(me.top_k):
                hit = lane == _argmax_first(sel, lane)
                picked, sel = picked | hit, jnp.where(hit, -jnp.inf, sel)
            comb = jnp.where(picked, scores, 0.0)
            comb = comb / jnp.sum(comb, axis=-1, keepdims=True)
            own_first = (me_ref[0] // spec.expert_tp) * spec.local_experts if tp > 1 else 0
            n_own = spec.local_experts if tp > 1 else e_n
            own = (lane >= own_first) & (lane < own_first + n_own)
            used = jnp.max(jnp.where(real & picked & own, 1, 0), axis=0, keepdims=True)
            mask_v[...] = used.astype(jnp.int32)
            cp = pltpu.make_async_copy(mask_v, mask_s, misc_sem.at[3])  # VMEM -> SMEM
            cp.start()
            cp.wait()

            def compact(e, n):
                @pl.when(mask_s[0, e] != 0)
                def _():
                    ids_s[n] = e
                return n + mask_s[0, e]
            n_used = lax.fori_loop(0, e_n, compact, jnp.int32(0))
            ndist_ref[mo] = n_used
        with jax.named_scope("experts"):
            z = matmul("latent_down", h) if me.latent_dim else h
            d_lat = me.latent_dim or h_dim
            s_n = cfg.expert_slots
            gu_mm, dn_mm = layout.expert_matmuls(spec)
            gu_r, gu_c = layout.tiles_of(gu_mm, t)
            dn_r, dn_c = layout.tiles_of(dn_mm, t)

            class fetch:  # expert j's codes (and scales) into slot j mod slots
                def __init__(self, j):
                    e, s = ids_s[j] - own_first, j % s_n
                    self.copies = [pltpu.make_async_copy(exp_hbm.at[mo, e], slot_buf.at[s],
                                                         slot_sem.at[s])]
                    if quantised:
                        self.copies.append(pltpu.make_async_copy(
                            exp_scale_hbm.at[mo, e], scale_buf.at[s], slot_sem.at[s]))

                def start(self):
                    for cp in self.copies:
                        cp.start()

                def wait(self):
                    for cp in self.copies:
                        cp.wait()

            dma.note("experts", None, "routed_expert", "expert",
                     sum(layout.expert_bytes(spec, cfg)), routed=True)
            for j in range(s_n):
                pl.when(j < n_used)(lambda j=j: fetch(j).start())

            def apply(j, acc):
                fetch(j).wait()
                e, slot = ids_s[j], j % s_n
                def from_slot(first):
                    if not quantised:
                        return lambda k, use: use(slot_buf[slot, first + k])
                    return lambda k, use: use(quant.dequantize_tile(
                        slot_buf[slot, first + k], scale_buf[slot, first + k], xfmt.name))
                gu = _tiled_matmul(z, gu_r, gu_c, gu_mm.d_out, from_slot(0), xs, ys)
                y = _tiled_matmul(ref.swiglu(gu), dn_r, dn_c, dn_mm.d_out,
                                  from_slot(gu_r * gu_c), xs, ys)
                pl.when(j + s_n < n_used)(lambda: fetch(j + s_n).start())
                w_e = jnp.sum(jnp.where(lane == e, comb, 0.0), axis=1, keepdims=True)
                return acc + w_e * y

            # this device's experts' partial sum; summed over devices below
            routed = lax.fori_loop(0, n_used, apply, jnp.zeros((bp, d_lat), F32))
            out = matmul("latent_up", comm.reduce_scatter(routed)) if me.latent_dim else routed
        if me.shared_width:
            with jax.named_scope("shared"):
                out = out + matmul("shared_down", ref.swiglu(matmul("shared_gate_up", h)))
        return comm.all_reduce(out)

    # ----- the layer loop (one trace of each kind, whatever the layer count) -----
    dma.scope = "loop"

    def layer(i, x):
        with jax.named_scope("layer/attention"):
            for_vector_copies(i, lambda cp: cp.wait())
            dma.note("vectors", layer=1)
            for_vector_copies(i + 1, lambda cp: cp.start())
            common = vectors_of(lax.rem(i, 2), attention=att_kinds[0])
            h = ref.rms_norm(x, common["attn_norm"])
            x = x + _switch(table[i, layout.ATT] == 0, att_kinds,
                            {"kda": kda_attention, "mla": mla_attention}, i, h)
        with jax.named_scope("layer/ffn"):
            h = ref.rms_norm(x, common["ffn_norm"])
            return x + _switch(table[i, layout.FFN] == 0, ffn_kinds,
                               {"dense": dense_ffn, "moe": moe}, i, h)

    x = lax.fori_loop(0, n_layers, layer, x)
    dma.scope = "post"

    # ----- head -----
    with jax.named_scope("head"):
        for_vector_copies(n_layers, lambda cp: cp.wait())
        final = layout.unpack_vector(vbuf[n_layers % 2],
                                     layout.vector_layout(spec, None)["final_norm"])
        h = ref.rms_norm(x, final)
        lm = stream[-1]
        logits = ring.matmul("lm_head", lm.first, h, lm.rows, lm.cols, lm.mm.d_out)
        logits_ref[...] = logits
        lane = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        best = _argmax_first(logits, lane)
        if tp > 1:  # (max, global index) of every vocabulary shard; the first maximum wins
            mx = jnp.max(logits, axis=-1, keepdims=True)
            idx = (best + me_ref[0] * lm.mm.d_out).astype(F32)
            mxs, idxs = comm.all_gather(mx), comm.all_gather(idx)
            best = _argmax_first(mxs, lax.broadcasted_iota(jnp.int32, mxs.shape, 1))
            pick = lax.broadcasted_iota(jnp.int32, mxs.shape, 1) == best
            best = jnp.sum(jnp.where(pick, idxs, 0.0), axis=1, keepdims=True).astype(jnp.int32)
        next_ref[...] = jnp.broadcast_to(best, next_ref.shape)
        if n_kda:
            @pl.when(kda_flag[0] == 1)
            def _():
                for cp in kda_writes(0):
                    cp.wait()


def perfmodel_layer(attention: str, ffn: str) -> Layer:
    """A stand-in layer of the given kinds (layouts depend only on the kinds)."""
    return Layer(1, attention, ffn)


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
    tpe = layout.tiles_per_expert(spec, cfg) if spec.moe else 1
    xfmt = layout.expert_format(spec, cfg) if n_moe else None
    quantised = xfmt is not None and xfmt.name != "bf16"
    rmax, cmax = layout.max_row_col_tiles(spec, cfg)
    scratch = [pltpu.VMEM((cfg.depth, t, t), BF16), pltpu.SemaphoreType.DMA((cfg.depth,)),
               pltpu.VMEM((cfg.expert_slots, tpe, xfmt.code_rows if xfmt else t, t),
                          xfmt.code_dtype if xfmt else BF16),
               pltpu.SemaphoreType.DMA((cfg.expert_slots,)),
               pltpu.VMEM((2, layout.vector_rows(spec), layout.LANES), BF16),
               pltpu.SemaphoreType.DMA((2,)),
               pltpu.VMEM((bp, 1, spec.hidden // tp), BF16), pltpu.SemaphoreType.DMA((4,)),
               pltpu.VMEM((rmax, bp, t), F32), pltpu.VMEM((cmax, bp, t), F32)]
    if quantised:
        scratch.append(pltpu.VMEM((cfg.expert_slots, tpe, t // xfmt.group, t),
                                  xfmt.scale_dtype))
    if "kda_state" in caches:
        scratch += [pltpu.VMEM(caches["kda_state"][0][1:], F32),
                    pltpu.VMEM(caches["kda_conv"][0][1:], caches["kda_conv"][1]),
                    pltpu.SemaphoreType.DMA((4,)), pltpu.SMEM((1,), jnp.int32)]
    if "mla_latent" in caches:
        d = caches["mla_latent"][0][-1]
        kv_b = next(mm for mm in spec.attention_matmuls("mla") if mm.name == "kv_b")
        scratch += [pltpu.VMEM((3, cfg.cache_block, d), BF16), pltpu.VMEM((bp, 1, d), BF16),
                    pltpu.VMEM((math.prod(layout.tiles_of(kv_b, t)), t, t), BF16),
                    pltpu.SemaphoreType.DMA((3,))]
    if n_moe:
        scratch += [pltpu.VMEM((1, e), jnp.int32), pltpu.SMEM((1, e), jnp.int32),
                    pltpu.SMEM((e,), jnp.int32)]
    if tp > 1:
        send, recv = comm.buffer_widths(*collective_widths(spec), tp, cfg.hierarchical)
        scratch += [pltpu.VMEM((bp, send), F32), pltpu.VMEM((6, tp, bp, recv), F32),
                    pltpu.SemaphoreType.DMA((2, 6)), pltpu.SMEM((3,), jnp.int32)]
    return out, scratch


def collective_widths(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """(widths all-gathered, widths all-reduced or reduce-scattered) by the kernel."""
    tp = layout.tp_of(spec)
    gathered = [spec.hidden // tp, 1]
    gathered += [mm.d_out for l in spec.layers for mm in spec.layer_matmuls(l)
                 if mm.name in shard.GATHERED]
    reduced = [spec.hidden] + ([spec.moe.latent_dim] if spec.moe and spec.moe.latent_dim else [])
    return gathered, reduced


def build_call(spec: ModelSpec, cfg: KernelConfig, interpret=None, record: list | None = None,
               vmem_limit_bytes: int | None = None):
    """The pallas_call: (token rows[Bp], positions[B], accepted rows[B], layer table, device
    index, embed, static, experts, vectors, (expert scales,) *caches) -> (next[Bp,128],
    logits[Bp,V], *caches, distinct experts per MoE layer); token row r of sequence b at
    r * B + b (`reference.verify_inputs`)."""
    out_shapes, scratch = _shapes(spec, cfg)
    n_cache = len(out_shapes) - 3
    q = int(bool(spec.count(ffn="moe")) and layout.expert_format(spec, cfg).name != "bf16")
    smem, anyspace = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)
    vmem_block = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        functools.partial(_kernel, spec, cfg, record),
        out_shape=tuple(out_shapes),
        in_specs=[smem] * 5 + [anyspace] * (4 + q + n_cache),
        out_specs=tuple([vmem_block, vmem_block] + [anyspace] * n_cache + [smem]),
        scratch_shapes=scratch,
        input_output_aliases={9 + q + k: 2 + k for k in range(n_cache)},
        compiler_params=None if interpret else pltpu.CompilerParams(
            vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret)


def call_args(spec: ModelSpec, cfg: KernelConfig) -> list[jax.ShapeDtypeStruct]:
    """The pallas_call's arguments as abstract values (for tracing and lowering)."""
    t, bp, n_moe = cfg.tile, cfg.padded_batch, spec.count(ffn="moe")
    e = (spec.local_experts if layout.tp_of(spec) > 1 else spec.moe.experts) if spec.moe else 1
    tpe = layout.tiles_per_expert(spec, cfg) if spec.moe else 1
    xfmt = layout.expert_format(spec, cfg) if n_moe else None
    sds = jax.ShapeDtypeStruct
    args = [sds((bp,), jnp.int32), sds((cfg.batch,), jnp.int32), sds((cfg.batch,), jnp.int32),
            sds(layout.layer_table(spec, cfg).shape, jnp.int32), sds((1,), jnp.int32),
            sds((spec.vocab, 1, spec.hidden // layout.tp_of(spec)), BF16),
            sds((sum(tm.tiles for tm in layout.static_stream(spec, cfg)), t, t), BF16),
            sds((n_moe, e, tpe, xfmt.code_rows, t), xfmt.code_dtype) if n_moe else
            sds((1, 1, tpe, t, t), BF16),
            sds((len(spec.layers) + 1, layout.vector_rows(spec), layout.LANES), BF16)]
    if n_moe and xfmt.name != "bf16":
        args.append(sds((n_moe, e, tpe, t // xfmt.group, t), xfmt.scale_dtype))
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


@functools.partial(jax.jit, static_argnames=("static", "cfg", "interpret", "vmem_limit_bytes"),
                   donate_argnames=("cache",))
def _step(packed, cache, tokens, positions, accepted, *, static, cfg, interpret,
          vmem_limit_bytes=None):
    spec = static.spec
    names = list(ref.cache_shapes(spec, cfg.batch, cfg.max_context))
    outs = build_call(spec, cfg, interpret, vmem_limit_bytes=vmem_limit_bytes)(
        tokens, positions, accepted, jnp.asarray(layout.layer_table(spec, cfg)),
        jnp.zeros(1, jnp.int32), packed.embed, packed.static, packed.experts, packed.vectors,
        *([] if packed.expert_scales is None else [packed.expert_scales]),
        *[cache[k] for k in names])
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
    budget = vmem.check_vmem(spec, cfg)
    run = functools.partial(_step, static=ref.StaticSpec(spec), cfg=cfg, interpret=interpret,
                            vmem_limit_bytes=None if interpret else budget.capacity_bytes)
    return functools.partial(verify_step, run, cfg)


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
