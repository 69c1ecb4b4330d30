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
Every DMA issue site also records itself (`Dma.note`) so that `kernels.plan` derives the DMA
plan from the kernel's own code. Numerics follow `kernels.reference` (same helpers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from perfmodel.arch import ModelSpec
from perfmodel.errors import require

from . import layout, reference as ref, vmem
from .layout import KernelConfig, Packed

F32, BF16 = jnp.float32, jnp.bfloat16


class Dma:
    """Issues nothing itself; records each DMA issue site (in program order) for the plan.

    A record is a dict(layer, family, name, bytes, routed, ring, repeat); ring marks a static
    weight tile streamed through the ring of banks; repeat is None (one copy),
    ("experts", moe_ordinal) (one copy per distinct expert picked) or ("cache_blocks", block)
    (per sequence, ceil(pos / block) copies)."""

    def __init__(self, record: list | None):
        self.record = record

    def note(self, layer, family, name, nbytes, routed=False, repeat=None, ring=False):
        if self.record is not None:
            self.record.append(dict(layer=layer, family=family, name=name, bytes=int(nbytes),
                                    routed=routed, ring=ring, repeat=repeat))


class _Ring:
    """The static weight stream through `depth` VMEM banks."""

    def __init__(self, spec, cfg, hbm, banks, sems, dma):
        self.cfg, self.hbm, self.banks, self.sems, self.dma = cfg, hbm, banks, sems, dma
        stream = layout.static_stream(spec, cfg)
        self.entries = iter(stream)
        self.owner = [tm for tm in stream for _ in range(tm.tiles)]
        self.g = 0

    def _copy(self, g):
        d = self.cfg.depth
        return pltpu.make_async_copy(self.hbm.at[g], self.banks.at[g % d], self.sems.at[g % d])

    def _issue(self, g):
        if g < len(self.owner):
            tm = self.owner[g]
            self.dma.note(tm.layer, tm.mm.family, f"{tm.mm.name}[tile {g - tm.first}]",
                          self.cfg.bank_bytes, ring=True)
            self._copy(g).start()

    def start(self):
        for g in range(self.cfg.depth):
            self._issue(g)

    def _tiles(self, name):
        """Yields (i, j, bank ref) for each tile of the next matmul, which must be `name`."""
        tm = next(self.entries)
        assert tm.mm.name == name, (tm.mm.name, name)
        for j in range(tm.cols):
            for i in range(tm.rows):
                g = self.g
                self._copy(g).wait()
                yield i, j, self.banks.at[g % self.cfg.depth]
                self._issue(g + self.cfg.depth)
                self.g += 1

    def matmul(self, name, x, d_in, d_out):
        """x [rows, d_in] f32 @ W[name] -> [rows, d_out] f32, tile by tile (bf16 operands)."""
        t = self.cfg.tile
        xb = x.astype(BF16)
        pad = -d_in % t
        if pad:
            xb = jnp.concatenate([xb, jnp.zeros((xb.shape[0], pad), BF16)], axis=1)
        cols = {}
        for i, j, bank in self._tiles(name):
            part = jnp.dot(xb[:, i * t:(i + 1) * t], bank[...], preferred_element_type=F32)
            cols[j] = part if i == 0 else cols[j] + part
        return jnp.concatenate([cols[j] for j in sorted(cols)], axis=1)[:, :d_out]

    def matrix(self, name, d_in, d_out):
        """The whole matrix W[name] [d_in, d_out] as a bf16 value (for the absorbed MLA)."""
        tiles = {}
        for i, j, bank in self._tiles(name):
            tiles[i, j] = bank[...]
        rows = max(i for i, _ in tiles) + 1
        cols = max(j for _, j in tiles) + 1
        full = jnp.concatenate([jnp.concatenate([tiles[i, j] for i in range(rows)], axis=0)
                                for j in range(cols)], axis=1)
        return full[:d_in, :d_out]


class _Vectors:
    """Per-layer small vectors, double-buffered: layer i+1's copy is issued when layer i starts."""

    def __init__(self, spec, hbm, buf, sems, dma):
        self.spec, self.hbm, self.buf, self.sems, self.dma = spec, hbm, buf, sems, dma
        self.layers = (*spec.layers, None)

    def _copies(self, i):
        out = []
        for family, r, n in layout.vector_copies(self.spec, self.layers[i]):
            out.append((family, pltpu.make_async_copy(self.hbm.at[i, pl.ds(r, n)],
                                                      self.buf.at[i % 2, pl.ds(r, n)],
                                                      self.sems.at[i % 2]), n))
        return out

    def _issue(self, i):
        if i < len(self.layers):
            for family, cp, n in self._copies(i):
                self.dma.note(i + 1, family, "vectors", n * layout.LANES * 2)
                cp.start()

    def start(self):
        self._issue(0)

    def begin(self, i):
        """Wait for entry i (0-based layer; n_layers = final norm); returns name -> f32 value."""
        for _, cp, _ in self._copies(i):
            cp.wait()
        rows = self.buf[i % 2]
        self._issue(i + 1)
        lay = layout.vector_layout(self.spec, self.layers[i])
        return {name: layout.unpack_vector(rows, e) for name, e in lay.items()}


def _argmax_first(x, iota):
    """Index of the first maximum along the last axis, [rows, 1] int32."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1, keepdims=True)


def _kernel(spec: ModelSpec, cfg: KernelConfig, record, *refs):
    n_kda, n_mla = spec.count(attention="kda"), spec.count(attention="mla")
    n_moe = spec.count(ffn="moe")
    refs = list(refs)
    take = lambda k: [refs.pop(0) for _ in range(k)]
    tok_ref, pos_ref, emb_hbm, static_hbm, exp_hbm, vec_hbm = take(6)
    take(2 * bool(n_kda) + bool(n_mla))  # cache inputs: aliased to the cache outputs below
    next_ref, logits_ref = take(2)
    kda_state, kda_conv = take(2) if n_kda else (None, None)
    (mla_cache,) = take(1) if n_mla else (None,)
    (ndist_ref,) = take(1)
    ring_buf, ring_sem, slot_buf, slot_sem, vbuf, vsem, xrows, misc_sem = take(8)
    if n_kda:
        state_buf, conv_buf, kda_sem = take(3)
    if n_mla:
        cache_buf, newrow = take(2)
    if n_moe:
        mask_v, mask_s, ids_s = take(3)
    assert not refs

    b_real, bp, t = cfg.batch, cfg.padded_batch, cfg.tile
    h_dim = spec.hidden
    dma = Dma(record)
    ring = _Ring(spec, cfg, static_hbm, ring_buf, ring_sem, dma)
    vecs = _Vectors(spec, vec_hbm, vbuf, vsem, dma)
    mms = {(l.index, mm.name): mm for l in spec.layers for mm in spec.layer_matmuls(l)}
    row = lax.broadcasted_iota(jnp.int32, (bp, 1), 0)
    real = row < b_real

    def matmul(layer, name, x):
        mm = mms[layer.index, name]
        return ring.matmul(name, x, mm.d_in, mm.d_out)

    # ----- embedding -----
    with jax.named_scope("embed"):
        ring.start()
        vecs.start()
        emb = [pltpu.make_async_copy(emb_hbm.at[tok_ref[b]], xrows.at[b], misc_sem.at[0])
               for b in range(b_real)]
        for cp in emb:
            dma.note(0, "embedding", "embedding row", h_dim * 2)
            cp.start()
        for cp in emb:
            cp.wait()
        x = jnp.where(real, xrows[:, 0, :].astype(F32), 0.0)

    pending = []  # KDA write-backs in flight (waited before the buffers are reused)

    def kda_attention(layer, v, h):
        o = ref.kind_ordinal(spec, layer)
        for cp in pending:
            cp.wait()
        pending.clear()
        dst = (lambda buf: buf.at[pl.ds(0, b_real)]) if b_real < bp else (lambda buf: buf)
        reads = [pltpu.make_async_copy(kda_state.at[o], dst(state_buf), kda_sem.at[0]),
                 pltpu.make_async_copy(kda_conv.at[o], dst(conv_buf), kda_sem.at[1])]
        for (nm, arr), cp in zip((("kda state", kda_state), ("conv window", kda_conv)), reads):
            dma.note(layer.index, "state", nm, arr.size // arr.shape[0] * arr.dtype.itemsize)
            cp.start()

        def load_state():
            for cp in reads:
                cp.wait()
            return (jnp.where(real[:, :, None, None], state_buf[...], 0.0),
                    jnp.where(real[:, :, None], conv_buf[...], 0.0))

        out, st, win = ref.kda_block(spec, functools.partial(matmul, layer), v, load_state, h)
        state_buf[...] = st
        conv_buf[...] = win.astype(conv_buf.dtype)
        writes = [pltpu.make_async_copy(dst(state_buf), kda_state.at[o], kda_sem.at[2]),
                  pltpu.make_async_copy(dst(conv_buf), kda_conv.at[o], kda_sem.at[3])]
        for (nm, arr), cp in zip((("kda state", kda_state), ("conv window", kda_conv)), writes):
            dma.note(layer.index, "state", nm + " (write back)",
                     arr.size // arr.shape[0] * arr.dtype.itemsize)
            cp.start()
        pending.extend(writes)
        return out

    def mla_attention(layer, v, h):
        m = spec.mla
        o, cb, r = ref.kind_ordinal(spec, layer), cfg.cache_block, m.kv_lora_rank
        d = r + m.qk_rope_dim

        def block_copy(b, k):
            return pltpu.make_async_copy(mla_cache.at[o, b, pl.ds(k * cb, cb)],
                                         cache_buf.at[b, pl.ds(k * cb, cb)], misc_sem.at[1])

        def for_blocks(fn):  # blocks holding positions < pos, for each real sequence
            for b in range(b_real):
                def body(k, carry, b=b):
                    fn(block_copy(b, k))
                    return carry
                lax.fori_loop(0, (pos_ref[b] + cb - 1) // cb, body, 0)

        row_bytes = d * mla_cache.dtype.itemsize
        dma.note(layer.index, "kv_cache", "latent cache block", cb * row_bytes,
                 repeat=("cache_blocks", cb))
        for_blocks(lambda cp: cp.start())
        q_nope, q_rope, c_new = ref.mla_project(spec, functools.partial(matmul, layer), v, h)
        c_new = c_new.astype(BF16)
        newrow[:, 0, :] = c_new
        writes = [pltpu.make_async_copy(newrow.at[b], mla_cache.at[o, b, pl.ds(pos_ref[b], 1)],
                                        misc_sem.at[2]) for b in range(b_real)]
        for cp in writes:
            dma.note(layer.index, "kv_cache", "latent cache row (write)", row_bytes)
            cp.start()
        kv_b = ring.matrix("kv_b", r, m.heads * (m.qk_nope_dim + m.v_head_dim))
        for_blocks(lambda cp: cp.wait())
        tpos = lax.broadcasted_iota(jnp.int32, (bp, cfg.max_context), 1)
        pos = jnp.concatenate([jnp.full((1, 1), pos_ref[b], jnp.int32) for b in range(bp)])
        valid = tpos < pos
        cache = jnp.where(valid[:, :, None], cache_buf[...].astype(F32), 0.0)
        # absorbed form over the cached positions < pos plus the new token (kept in VMEM)
        w_uk, w_uv = ref.split_kv_b(spec, kv_b)
        c_new = c_new.astype(F32)
        q_lat = jnp.einsum("bhn,rhn->bhr", q_nope, w_uk)
        scale = (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
        s_c = (jnp.einsum("bhr,btr->bht", q_lat, cache[..., :r])
               + jnp.einsum("bhp,btp->bht", q_rope, cache[..., r:])) * scale
        s_c = jnp.where(valid[:, None, :], s_c, -jnp.inf)
        s_n = (jnp.einsum("bhr,br->bh", q_lat, c_new[:, :r])
               + jnp.einsum("bhp,bp->bh", q_rope, c_new[:, r:]))[..., None] * scale
        mx = jnp.maximum(jnp.max(s_c, axis=-1, keepdims=True), s_n)
        p_c, p_n = jnp.exp(s_c - mx), jnp.exp(s_n - mx)
        den = jnp.sum(p_c, axis=-1, keepdims=True) + p_n
        ctx = (jnp.einsum("bht,btr->bhr", p_c, cache[..., :r]) + p_n * c_new[:, None, :r]) / den
        out = ref.mla_output(spec, functools.partial(matmul, layer),
                             jnp.einsum("bhr,rhv->bhv", ctx, w_uv), h)
        for cp in writes:
            cp.wait()
        return out

    def moe(layer, v, h):
        me, e_n = spec.moe, spec.moe.experts
        mo = sum(1 for l in spec.layers[:layer.index - 1] if l.ffn == "moe")
        lane = lax.broadcasted_iota(jnp.int32, (bp, e_n), 1)
        with jax.named_scope("router"):
            logits = matmul(layer, "router", h)
            scores = jax.nn.sigmoid(logits)
            sel = scores + v["router_bias"]
            picked = jnp.zeros((bp, e_n), jnp.bool_)
            for _ in range(me.top_k):
                hit = lane == _argmax_first(sel, lane)
                picked, sel = picked | hit, jnp.where(hit, -jnp.inf, sel)
            comb = jnp.where(picked, scores, 0.0)
            comb = comb / jnp.sum(comb, axis=-1, keepdims=True)
            used = jnp.max(jnp.where(real & picked, 1, 0), axis=0, keepdims=True)
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
            z = matmul(layer, "latent_down", h) if me.latent_dim else h
            d_lat = me.latent_dim or h_dim
            s_n = cfg.expert_slots
            gu_mm, dn_mm = layout.expert_matmuls(spec)
            gu_r, gu_c = layout.tiles_of(gu_mm, t)
            dn_r, dn_c = layout.tiles_of(dn_mm, t)

            def fetch(j):
                return pltpu.make_async_copy(exp_hbm.at[mo, ids_s[j]], slot_buf.at[j % s_n],
                                             slot_sem.at[j % s_n])

            dma.note(layer.index, "routed_expert", "expert",
                     layout.tiles_per_expert(spec, cfg) * cfg.bank_bytes, routed=True,
                     repeat=("experts", mo))
            for j in range(s_n):
                pl.when(j < n_used)(lambda j=j: fetch(j).start())

            def tiled(x, first, rows, cols, slot, d_in, d_out):
                xb = x.astype(BF16)
                if -d_in % t:
                    xb = jnp.concatenate([xb, jnp.zeros((bp, -d_in % t), BF16)], axis=1)
                outs = []
                for jj in range(cols):
                    acc = 0.0
                    for ii in range(rows):
                        w = slot_buf[slot, first + jj * rows + ii]
                        acc = acc + jnp.dot(xb[:, ii * t:(ii + 1) * t], w,
                                            preferred_element_type=F32)
                    outs.append(acc)
                return jnp.concatenate(outs, axis=1)[:, :d_out]

            def apply(j, acc):
                fetch(j).wait()
                e, slot = ids_s[j], j % s_n
                gu = tiled(z, 0, gu_r, gu_c, slot, gu_mm.d_in, gu_mm.d_out)
                y = tiled(ref.swiglu(gu), gu_r * gu_c, dn_r, dn_c, slot, dn_mm.d_in, dn_mm.d_out)
                pl.when(j + s_n < n_used)(lambda: fetch(j + s_n).start())
                w_e = jnp.sum(jnp.where(lane == e, comb, 0.0), axis=1, keepdims=True)
                return acc + w_e * y

            routed = lax.fori_loop(0, n_used, apply, jnp.zeros((bp, d_lat), F32))
            out = matmul(layer, "latent_up", routed) if me.latent_dim else routed
        if me.shared_width:
            with jax.named_scope("shared"):
                out = out + matmul(layer, "shared_down",
                                   ref.swiglu(matmul(layer, "shared_gate_up", h)))
        return out

    # ----- layers -----
    for i, layer in enumerate(spec.layers):
        with jax.named_scope(f"layer_{layer.index:02d}/attention"):
            v = vecs.begin(i)
            h = ref.rms_norm(x, v["attn_norm"])
            attn = kda_attention if layer.attention == "kda" else mla_attention
            x = x + attn(layer, v, h)
        phase = "ffn" if layer.ffn == "dense" else "moe"
        with jax.named_scope(f"layer_{layer.index:02d}/{phase}"):
            h = ref.rms_norm(x, v["ffn_norm"])
            if layer.ffn == "dense":
                x = x + matmul(layer, "down", ref.swiglu(matmul(layer, "gate_up", h)))
            else:
                x = x + moe(layer, v, h)

    # ----- head -----
    with jax.named_scope("head"):
        v = vecs.begin(len(spec.layers))
        h = ref.rms_norm(x, v["final_norm"])
        logits = ring.matmul("lm_head", h, spec.hidden, spec.vocab)
        logits_ref[...] = logits
        lane = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        next_ref[...] = jnp.broadcast_to(_argmax_first(logits, lane), next_ref.shape)
        for cp in pending:
            cp.wait()


def _shapes(spec: ModelSpec, cfg: KernelConfig):
    """(output shapes, scratch shapes) of the pallas_call."""
    bp, t, e = cfg.padded_batch, cfg.tile, spec.moe.experts if spec.moe else 1
    caches = ref.cache_shapes(spec, cfg.batch, cfg.max_context)
    n_moe = spec.count(ffn="moe")
    out = [jax.ShapeDtypeStruct((bp, layout.LANES), jnp.int32),
           jax.ShapeDtypeStruct((bp, spec.vocab), F32)]
    out += [jax.ShapeDtypeStruct(s, d) for s, d in caches.values()]
    out.append(jax.ShapeDtypeStruct((max(n_moe, 1),), jnp.int32))
    tpe = layout.tiles_per_expert(spec, cfg) if spec.moe else 1
    scratch = [pltpu.VMEM((cfg.depth, t, t), BF16), pltpu.SemaphoreType.DMA((cfg.depth,)),
               pltpu.VMEM((cfg.expert_slots, tpe, t, t), BF16),
               pltpu.SemaphoreType.DMA((cfg.expert_slots,)),
               pltpu.VMEM((2, layout.vector_rows(spec), layout.LANES), BF16),
               pltpu.SemaphoreType.DMA((2,)),
               pltpu.VMEM((bp, 1, spec.hidden), BF16), pltpu.SemaphoreType.DMA((4,))]
    if "kda_state" in caches:
        scratch += [pltpu.VMEM((bp,) + caches["kda_state"][0][2:], F32),
                    pltpu.VMEM((bp,) + caches["kda_conv"][0][2:], caches["kda_conv"][1]),
                    pltpu.SemaphoreType.DMA((4,))]
    if "mla_latent" in caches:
        d = caches["mla_latent"][0][-1]
        scratch += [pltpu.VMEM((bp, cfg.max_context, d), BF16), pltpu.VMEM((bp, 1, d), BF16)]
    if n_moe:
        scratch += [pltpu.VMEM((1, e), jnp.int32), pltpu.SMEM((1, e), jnp.int32),
                    pltpu.SMEM((e,), jnp.int32)]
    return out, scratch


def build_call(spec: ModelSpec, cfg: KernelConfig, interpret=None, record: list | None = None,
               vmem_limit_bytes: int | None = None):
    """The pallas_call: (tokens[Bp], positions[Bp], embed, static, experts, vectors, *caches) ->
    (next[Bp,128], logits[Bp,V], *caches, distinct experts per MoE layer)."""
    out_shapes, scratch = _shapes(spec, cfg)
    n_cache = len(out_shapes) - 3
    smem, anyspace = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)
    vmem_block = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        functools.partial(_kernel, spec, cfg, record),
        out_shape=tuple(out_shapes),
        in_specs=[smem, smem] + [anyspace] * (4 + n_cache),
        out_specs=tuple([vmem_block, vmem_block] + [anyspace] * n_cache + [smem]),
        scratch_shapes=scratch,
        input_output_aliases={6 + k: 2 + k for k in range(n_cache)},
        compiler_params=None if interpret else pltpu.CompilerParams(
            vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("static", "cfg", "interpret", "vmem_limit_bytes"),
                   donate_argnames=("cache",))
def _step(packed, cache, tokens, positions, *, static, cfg, interpret, vmem_limit_bytes=None):
    spec = static.spec
    pad = cfg.padded_batch - cfg.batch
    tokens = jnp.pad(tokens.astype(jnp.int32), (0, pad))
    positions = jnp.pad(positions.astype(jnp.int32), (0, pad))
    names = list(ref.cache_shapes(spec, cfg.batch, cfg.max_context))
    outs = build_call(spec, cfg, interpret, vmem_limit_bytes=vmem_limit_bytes)(
        tokens, positions, packed.embed, packed.static, packed.experts, packed.vectors,
        *[cache[k] for k in names])
    nxt, logits, *caches, ndist = outs
    return (nxt[:cfg.batch, 0], logits[:cfg.batch], dict(zip(names, caches)),
            ndist[:spec.count(ffn="moe")])


def make_step(spec: ModelSpec, cfg: KernelConfig, interpret=None):
    """Validate once (spec, config, VMEM budget: SpecError if it does not fit) and return
    step(packed, cache, tokens, positions) -> (next tokens [B], logits [B, V] f32, new cache,
    distinct experts fetched per MoE layer [n_moe]), with no per-call host work (for timing).
    The cache (as `reference.init_cache`) is donated and updated in place. interpret: None on a
    TPU, or a `pltpu.InterpretParams`."""
    budget = vmem.check_vmem(spec, cfg)
    return functools.partial(_step, static=ref.StaticSpec(spec), cfg=cfg, interpret=interpret,
                             vmem_limit_bytes=None if interpret else budget.capacity_bytes)


def decode_step(spec: ModelSpec, cfg: KernelConfig, packed: Packed, cache, tokens, positions,
                interpret=None):
    """One decode step in one pallas_call (see `make_step`), checking the inputs' shapes and
    ranges first (positions in [0, max_context), tokens in [0, vocab))."""
    require(tuple(tokens.shape) == (cfg.batch,), "tokens.shape", tuple(tokens.shape),
            f"expected ({cfg.batch},) = (cfg.batch,)")
    require(tuple(positions.shape) == (cfg.batch,), "positions.shape", tuple(positions.shape),
            f"expected ({cfg.batch},) = (cfg.batch,)")
    pos, tok = np.asarray(positions), np.asarray(tokens)
    require(bool(((pos >= 0) & (pos < cfg.max_context)).all()), "positions", pos.tolist(),
            f"must lie in [0, max_context={cfg.max_context}) (the cache is written in place)")
    require(bool(((tok >= 0) & (tok < spec.vocab)).all()), "tokens", tok.tolist(),
            f"must lie in [0, vocab={spec.vocab})")
    return make_step(spec, cfg, interpret)(packed, cache, jnp.asarray(tokens),
                                           jnp.asarray(positions))
