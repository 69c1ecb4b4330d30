"""The per-device op graph of one step: FLOPs, bytes by class and collectives per op.

A step is a decode step by default (`batch` sequences, each `rows_per_seq` rows after `context`
cached tokens); `build(..., groups=...)` takes any mix of row groups (`Rows`): decode rows and
causal prompt chunks (prefill, perfmodel.graph.prefill), and `sampled` rows reaching the head.

Parallel layout (documented choices, see README "Model terms"):
- attention, dense FFN, shared experts, latent projections, embedding and lm_head are sharded
  over `tp` devices; the MoE router is replicated (as vLLM's ReplicatedLinear gate);
- routed experts belong to `ep` groups in contiguous blocks, each expert split over the
  devices / ep devices of its group; tokens are replicated, so no dispatch is needed and the
  partial expert outputs are summed by an all-reduce over all devices;
- MLA's latent cache is replicated across TP ranks (each rank reads all of it for its heads), as
  is DeepSeek-V4's shared key = value head and its compressed entries; a grouped output
  projection (DeepSeek-V4 `o_a`) is split by groups over `tp`.
On the megakernel engine the model's own kernel (its `[megakernel]` table, perfmodel.spec.recipe)
sets the collectives' payload (rows padded to whole tiles, one row per (token, expert) pair for
the routed experts' reduction, the wire dtype), the post-expert projection's layout and whether
the embedding lookup runs in XLA glue around the kernel.
The small vectors (norm weights, router bias, conv taps; < 0.01 % of the bytes) are left out.
Byte classes: static (weights known ahead, prefetchable across layers), routed (expert
weights known only after the router), kv (KV cache / recurrent state), act (activations).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from perfmodel.graph.moe import expected_busiest_group
from perfmodel.spec.arch import CSA, GDN, GQA, HC_BYTES, KDA, MLA, Layer, Mamba2, Matmul, ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.formats import Format
from perfmodel.spec.recipe import Megakernel
from perfmodel.util.errors import SpecError

ACT_BYTES = 2  # bf16 activations


@dataclass
class OpGraph:
    """Parallel arrays, one entry per op, in program order."""
    layer: np.ndarray      # 0 embedding, 1..n layers, n+1 head
    phase: list[str]       # embed, attention, ffn, moe, head
    name: list[str]
    is_collective: np.ndarray
    flops: np.ndarray
    dtype: list[str]
    static_bytes: np.ndarray
    routed_bytes: np.ndarray
    kv_bytes: np.ndarray
    act_bytes: np.ndarray
    coll_kind: list[str]
    coll_bytes: np.ndarray
    coll_group: np.ndarray
    layer_kind: dict[int, str]
    tokens: int           # rows processed per replica this step
    distinct_experts: float  # per MoE layer on the busiest expert group
    cache_bytes: dict[int, float] = dataclasses.field(default_factory=dict)  # per layer: the caches
    # (KV / latents / recurrent and conv state) this replica holds for its sequences, bytes
    kernel_all_reduce: str = ""  # the all-reduce algorithm the model's own megakernel runs at these
    # rows ("": none fixed, the fastest per payload); from the model's [megakernel] shard_collective_rows
    fmt: list[Format | None] = dataclasses.field(default_factory=list)  # per op: its weights' format
    recipe: Megakernel = Megakernel()  # the kernel this graph is the program of (megakernel engine)
    sequences: int = 1    # sequences per replica this step
    top_k: int = 0        # experts each row picks (0: no MoE)
    expert_descriptors: int = 1  # DMA descriptors one routed expert's copy takes (each matrix, each scale array)
    head_rows: int | None = None  # rows the lm_head samples (None: every row; a prompt chunk: its last row)
    # per layer ([megakernel] kv_tile_tokens; empty when the kernel moves no tiles): the DMA
    # descriptors of its KV read (a layer not here: one), and (bytes, descriptors) of the cache its
    # attention writes back and waits for before the layer's next collective; one descriptor per
    # sequence, tile and cache array (GQA: K and V)
    kv_copies: dict[int, int] = dataclasses.field(default_factory=dict)
    writeback: dict[int, tuple[float, int]] = dataclasses.field(default_factory=dict)
    # per layer ([megakernel] attention_tile_tokens): the cache tiles its attention core walks, summed
    # over its sequences (components.attention_core_time); a layer not here walks none
    core_tiles: dict[int, int] = dataclasses.field(default_factory=dict)
    # per op ([megakernel] matmul_dots): the MXU dots a streamed matmul issues; None: one a matmul
    dots: np.ndarray | None = None

    @property
    def bytes(self) -> np.ndarray:
        return self.static_bytes + self.routed_bytes + self.kv_bytes + self.act_bytes

    def experts_read(self) -> np.ndarray:
        """Per op, the distinct routed experts it reads (0 for ops without routed weights): one
        expert's bytes are alike in every MoE layer, so an op's count is its routed bytes over the
        busiest layer's, times `distinct_experts`."""
        top = self.routed_bytes.max(initial=0.0)
        return self.distinct_experts * self.routed_bytes / top if top > 0 else np.zeros(len(self.routed_bytes))

    def __len__(self) -> int:
        return len(self.name)


@dataclass(frozen=True)
class Rows:
    """Sequences a step processes alike: `seqs` sequences of `rows` new tokens each after
    `context` cached ones. Decode / verify rows attend the cache (`causal` False); a prompt chunk
    (`causal` True) is `rows` prompt tokens attending the cache and each other causally."""
    seqs: int
    rows: int
    context: int
    causal: bool = False

    @property
    def tokens(self) -> int:
        return self.seqs * self.rows


class _Builder:
    def __init__(self):
        self.rows: list[tuple] = []

    def compute(self, layer, phase, name, flops=0.0, dtype="bf16", static=0.0, routed=0.0, kv=0.0, act=0.0,
                fmt=None, dots=1):
        self.rows.append((layer, phase, name, False, flops, dtype, static, routed, kv, act, "", 0.0, 1, fmt, dots))

    def collective(self, layer, phase, name, kind, nbytes, group):
        if group > 1:
            self.rows.append((layer, phase, name, True, 0.0, "", 0.0, 0.0, 0.0, 0.0, kind, nbytes, group, None, 0))


def build(model: ModelSpec, d: Deployment, groups: tuple[Rows, ...] | None = None,
          sampled: int | None = None) -> OpGraph:
    """The op graph; cached per model object and the deployment fields it depends on (sweeps over
    prefetch depth, slots, engine or hardware reuse it). Callers must not mutate it.

    `groups`: the step's row groups on one attention replica (default: the deployment's decode
    step, ceil(batch / dp) sequences of rows_per_seq rows at `context`); their attention cores
    are one op per kind, the rest of the graph runs over all their rows. `sampled`: rows the
    lm_head computes (default: every row; 0: no head)."""
    key = (d.devices, d.tp, d.expert_groups, d.batch, d.context, d.rows_per_seq, d.routing_skew,
           d.routing_correlation, d.pp, d.engine, groups, sampled)
    if id(model) not in _CACHE and len(_CACHE) >= 16:
        _CACHE.clear()
    cache = _CACHE.setdefault(id(model), (model, {}))[1]
    if key not in cache:
        if len(cache) > 256:
            cache.clear()
        cache[key] = _build(model, d, groups, sampled)
    return cache[key]


_CACHE: dict[int, tuple[ModelSpec, dict]] = {}  # id(model) -> (model kept alive, graphs)


def with_experts(g: OpGraph, picked: list[float]) -> OpGraph:
    """`g` with its MoE layers' routed ops (in layer order) at `picked` distinct experts each
    instead of the analytic expectation (graph.moe): a measured step's routing. Their weight and
    FLOPs scale alike, so the rows of each dot do not change; `distinct_experts` becomes the
    busiest layer's. Kept per graph and counts (so the engines' caches by graph hold)."""
    key = (id(g), tuple(float(x) for x in picked))
    if key not in _WITH_EXPERTS:
        if len(_WITH_EXPERTS) >= 64:
            _WITH_EXPERTS.clear()
        _WITH_EXPERTS[key] = (g, _with_experts(g, picked))   # g kept alive: its id stays its own
    return _WITH_EXPERTS[key][1]


def _with_experts(g: OpGraph, picked: list[float]) -> OpGraph:
    moe = np.flatnonzero(np.bincount(g.layer, weights=g.routed_bytes) > 0)
    if len(picked) != len(moe):
        raise SpecError("distinct_experts", list(picked), f"one count per MoE layer ({len(moe)})")
    if len(moe) == 0:
        return g
    scale = np.ones(int(g.layer.max(initial=0)) + 1)
    scale[moe] = np.asarray(picked, float) / g.distinct_experts
    per_op = np.where(g.routed_bytes > 0, scale[g.layer], 1.0)
    return dataclasses.replace(g, routed_bytes=g.routed_bytes * per_op, flops=g.flops * per_op,
                               distinct_experts=float(max(picked)))


_WITH_EXPERTS: dict[tuple, tuple[OpGraph, OpGraph]] = {}


def planned_experts(g: OpGraph, copies) -> list[float]:
    """Per MoE layer of `g` (in layer order), the distinct experts a kernel's DMA plan fetched:
    its routed copies' bytes less padding over one expert's bytes in `g`."""
    fetched = np.zeros(int(g.layer.max(initial=0)) + 1)
    for c in copies:
        if c.routed:
            fetched[c.layer] += c.bytes - c.padding
    expected = np.bincount(g.layer, weights=g.routed_bytes, minlength=len(fetched))
    per_expert = expected / g.distinct_experts if g.distinct_experts else expected
    return [float(fetched[l] / per_expert[l]) for l in np.flatnonzero(expected > 0)]


def _build(model: ModelSpec, d: Deployment, groups: tuple[Rows, ...] | None = None,
           sampled: int | None = None) -> OpGraph:
    if groups is None:  # the decode step: its sequences per attention replica (per micro-batch)
        groups = (Rows(-(-d.batch // (d.dp * d.pp)), d.rows_per_seq, d.context),)
    b = sum(g.seqs for g in groups)      # sequences per replica
    t = sum(g.tokens for g in groups)    # rows (tokens) processed per replica
    sampled = t if sampled is None else sampled
    h, f = model.hidden, model.formats
    ops = _Builder()
    rc = model.megakernel if d.engine == "megakernel" else Megakernel()
    wire = lambda rows, width: rc.wire_bytes * max(rows, rc.collective_rows) * width  # a collective's payload

    dots = dict(rc.matmul_dots)

    def matmul(layer: int, phase: str, mm: Matmul, shards: int, rows: int = t, kind: str = "head"):
        fmt = model.matmul_format(mm)
        d_in = mm.d_in if mm.experts == 1 else mm.d_in * mm.experts / shards  # grouped: inputs split too
        ops.compute(layer, phase, mm.name, 2.0 * rows * mm.params / shards, fmt.compute_dtype,
                    static=model.matmul_bytes(mm) / shards,
                    act=ACT_BYTES * rows * (d_in + mm.d_out * mm.experts / shards), fmt=fmt,
                    dots=dots.get(f"{kind}/{mm.name}", 1))

    n_hc = model.residual_streams

    def hc_pre(layer: int, phase: str):
        """Hyper-connections before a sublayer: (2 + n) n mixing weights from the normalised n x h
        residual, then its weighted sum to one stream (the n x n Sinkhorn steps, under 0.1 %, are
        left out)."""
        if n_hc > 1:
            mix = (2 + n_hc) * n_hc
            ops.compute(layer, phase, "hc_pre", t * (2.0 * n_hc * h * mix + 5.0 * n_hc * h), "f32",
                        static=mix * n_hc * h * HC_BYTES, act=ACT_BYTES * t * (n_hc * h + h))

    def hc_post(layer: int, phase: str):
        """The sublayer output spread over the n streams plus the n x n mix of the residual."""
        if n_hc > 1:
            ops.compute(layer, phase, "hc_post", t * (2.0 * n_hc * h + 2.0 * n_hc * n_hc * h),
                        act=ACT_BYTES * t * (h + 2 * n_hc * h))

    if rc.embedding == "xla":  # looked up and summed by XLA ops around the kernel (engine: their cost)
        ops.compute(0, "embed", "xla_embedding", act=t * h * f["embedding"].bytes_per_value / d.tp)
    else:
        ops.compute(0, "embed", "embedding_gather", static=t * h * f["embedding"].bytes_per_value / d.tp)
        ops.collective(0, "embed", "embedding_all_reduce", "all_reduce", wire(t, h), d.tp)
    ops.collective(0, "embed", "entry_barrier", "barrier", 0.0, d.devices if d.engine == "megakernel" else 1)
    distinct = 0.0
    done: dict[Layer, tuple[int, int]] = {}  # a layer kind's rows, built once and renumbered after
    for layer in model.layers:
        i, same = layer.index, dataclasses.replace(layer, index=0)
        if same in done:
            a, z = done[same]
            ops.rows.extend((i,) + r[1:] for r in ops.rows[a:z])
            continue
        a = len(ops.rows)
        mms = model.attention_matmuls(layer.attention)
        if mms:
            hc_pre(i, "attention")
            ops.compute(i, "attention", "attn_norm", 4.0 * t * h, act=2 * ACT_BYTES * t * h)
            for mm in mms[:-1]:
                matmul(i, "attention", mm, d.tp, kind=layer.attention)
            first = len(ops.rows)
            for g in groups:
                (_causal_core if g.causal else _attention_core)(ops, model, layer, d, g)
            if len(groups) > 1:
                _merge_by_name(ops.rows, first)
            matmul(i, "attention", mms[-1], d.tp, kind=layer.attention)
            ops.collective(i, "attention", "attn_all_reduce", "all_reduce", wire(t, h), d.tp)
            hc_post(i, "attention")
        if layer.ffn != "none":
            hc_pre(i, layer.ffn)
            ops.compute(i, layer.ffn, "ffn_norm", 4.0 * t * h, act=2 * ACT_BYTES * t * h)
        if layer.ffn == "dense":
            for mm in model.ffn_matmuls("dense"):
                matmul(i, "ffn", mm, d.tp, kind="dense")
            ops.collective(i, "ffn", "ffn_all_reduce", "all_reduce", wire(t, h), d.tp)
        elif layer.ffn == "moe":
            distinct = _moe(ops, model, i, d, t, rc, wire, dots)
        if layer.ffn != "none":
            hc_post(i, layer.ffn)
        done[same] = (a, len(ops.rows))
    n1 = len(model.layers) + 1
    if n_hc > 1:  # the head's own weighted sum of the streams
        ops.compute(n1, "head", "hc_head", t * (2.0 * n_hc * h * n_hc + 5.0 * n_hc * h), "f32",
                    static=n_hc * n_hc * h * HC_BYTES, act=ACT_BYTES * t * (n_hc * h + h))
    ops.compute(n1, "head", "final_norm", 4.0 * t * h, act=2 * ACT_BYTES * t * h)
    lm = Matmul("lm_head", "lm_head" if not model.tie_embeddings else "embedding", h, model.vocab)
    if sampled:
        matmul(n1, "head", lm, d.tp, sampled)
        if rc.sampling == "xla":  # picked by XLA ops after the kernel, from the logits it wrote (engine: their cost)
            ops.compute(n1, "head", "xla_sampling", act=4.0 * sampled * model.vocab / d.tp)
        else:
            ops.compute(n1, "head", "argmax", 2.0 * sampled * model.vocab / d.tp,
                        act=4.0 * sampled * model.vocab / d.tp)
            ops.collective(n1, "head", "argmax_all_gather", "all_gather", 8.0 * max(sampled, rc.collective_rows),
                           d.tp)

    cols = list(zip(*ops.rows))
    arr = lambda k, dt=float: np.asarray(cols[k], dtype=dt)
    kinds = {l.index: model.layer_kind(l) for l in model.layers}
    kinds.update({0: "embed", n1: "head"})
    return OpGraph(arr(0, int), list(cols[1]), list(cols[2]), arr(3, bool), arr(4), list(cols[5]),
                   arr(6), arr(7), arr(8), arr(9), list(cols[10]), arr(11), arr(12, int), kinds, t,
                   distinct, {l.index: sum(g.seqs * model.cache_bytes(l.attention, g.context, d.tp) for g in groups)
                              for l in model.layers},
                   kernel_all_reduce(model, t), list(cols[13]), rc, b, model.moe.top_k if model.moe else 0,
                   expert_descriptors(model), None if sampled == t else sampled,
                   *_kv_tiles(model, d, groups, rc.kv_tile_tokens),
                   _core_tiles(model, groups, rc.attention_tile_tokens or rc.kv_tile_tokens),
                   dots=arr(14) if rc.matmul_dots else None)


def _kv_tiles(model: ModelSpec, d: Deployment, groups: tuple[Rows, ...], tile: int):
    """(OpGraph.kv_copies, OpGraph.writeback) of a kernel that moves GQA caches in `tile`-token tiles:
    each sequence reads the tiles holding its cached tokens and its new rows (K and V one copy each
    per tile, as _gqa_core counts their bytes) and writes one tile back; a recurrent state is
    written back whole (one copy a sequence)."""
    if not tile:
        return {}, {}
    reads, back, seqs = {}, {}, sum(g.seqs for g in groups)
    for l in model.layers:
        a = model.attn(l.attention)
        if isinstance(a, GQA) and not a.index_topk:
            reads[l.index] = sum(2 * g.seqs * _tiles(_cached(a, g.context) + g.rows, tile) for g in groups)
        back[l.index] = (seqs * model.cache_bytes(l.attention, tile, d.tp), seqs * (2 if isinstance(a, GQA) else 1))
    return reads, back


def _core_tiles(model: ModelSpec, groups: tuple[Rows, ...], tile: int) -> dict[int, int]:
    """OpGraph.core_tiles: per GQA or MLA layer, the `tile`-token cache tiles its core walks over its
    sequences: a GQA core the tiles holding the cached tokens and the new rows (as _kv_tiles reads
    them), an MLA core those holding the cached tokens (the new rows scored apart, as
    perfmodel_kernels.megakernel does)."""
    out = {}
    for l in (model.layers if tile else ()):
        a = model.attn(l.attention)
        if isinstance(a, GQA) and not a.index_topk:
            out[l.index] = sum(g.seqs * _tiles(_cached(a, g.context) + g.rows, tile) for g in groups)
        elif isinstance(a, MLA) and not a.index_topk:
            out[l.index] = sum(g.seqs * _tiles(g.context, tile) for g in groups)
    return out


def _cached(a: GQA, context: int) -> int:
    """The cached tokens a GQA layer reads: its window's worth at most."""
    return min(context, a.window) if a.window else context


def _tiles(tokens: float, tile: int) -> int:
    """The `tile`-token tiles that hold `tokens` tokens of one sequence's cache."""
    return math.ceil(tokens / tile)


def expert_descriptors(model: ModelSpec) -> int:
    """A routed expert's copy as the kernel issues it: one descriptor per matrix (gate_up, down),
    one per scale array beside it (int4 / MXFP4: 4) and one for the expert's global scales (NVFP4:
    5, Inferact's musespark/fp4.py COPIES)."""
    fmt = model.formats["routed_expert"]
    return 2 * (1 + bool(fmt.scale_dtype)) + bool(fmt.global_scale_dtype) if model.moe else 1


def kernel_all_reduce(model: ModelSpec, rows: int) -> str:
    """The all-reduce algorithm the model's megakernel runs at `rows` rows: its fixed one
    ([megakernel] all_reduce); else one-shot where it has no shard-based collectives at these rows
    (the public Kimi K3 kernel: reduce-scatter and token scatter only at 8 rows); "" where it does
    or the model does not say (the fastest algorithm per payload)."""
    mk = model.megakernel
    if mk.all_reduce:
        return mk.all_reduce
    return "one_shot" if mk.shard_collective_rows is not None and rows not in mk.shard_collective_rows else ""


def _merge_by_name(rows: list[tuple], first: int) -> None:
    """The attention cores of several row groups (rows[first:]) as one op per name (one kernel
    over every group's rows): FLOPs and bytes summed, in order of first appearance."""
    merged: dict[str, list] = {}
    for r in rows[first:]:
        if r[2] in merged:
            m = merged[r[2]]
            for k in (4, 6, 7, 8, 9):
                m[k] += r[k]
        else:
            merged[r[2]] = list(r)
    rows[first:] = [tuple(m) for m in merged.values()]


def _attention_core(ops: _Builder, model: ModelSpec, layer: Layer, d: Deployment, g: Rows):
    """The attention itself (scores, state update), between its projections. Caches are read
    per sequence (`g.seqs` on this replica); a recurrent state is read and written back."""
    i, L, rows, b, t = layer.index, g.context, g.rows, g.seqs, g.tokens
    kvb, stb = model.formats["kv_cache"].bytes_per_value, model.formats["state"].bytes_per_value
    a = model.attn(layer.attention)
    if isinstance(a, KDA):
        hl = a.heads // d.tp
        ops.compute(i, "attention", "kda_recurrence", kda_flops(t, hl, a.head_dim, a.conv_width), "f32",
                    kv=2 * b * model.cache_bytes(layer.attention, L, d.tp),
                    act=ACT_BYTES * t * 4 * hl * a.head_dim)
    elif isinstance(a, GDN):
        vl, kl = a.value_heads // d.tp, max(1, a.key_heads // d.tp)
        conv_ch = 2 * kl * a.key_head_dim + vl * a.value_head_dim
        # per value head and token, as KDA: gate, k^T S, rank-1 delta update, S^T q = 7 dk dv
        flops = t * (7.0 * vl * a.key_head_dim * a.value_head_dim + 2.0 * conv_ch * a.conv_width)
        ops.compute(i, "attention", "gdn_recurrence", flops, "f32",
                    kv=2 * b * model.cache_bytes(layer.attention, L, d.tp),
                    act=ACT_BYTES * t * (conv_ch + 2 * vl * a.value_head_dim))
    elif isinstance(a, Mamba2):
        hl = a.heads // d.tp
        inner, conv_ch = hl * a.head_dim, hl * a.head_dim + 2 * a.groups * a.state_dim
        # per state element and token: h = exp(dt A) h + dt B x (3 FLOPs), y = C h (2 FLOPs)
        flops = t * (5.0 * inner * a.state_dim + 2.0 * conv_ch * a.conv_width)
        ops.compute(i, "attention", "mamba2_scan", flops, "f32",
                    kv=2 * b * model.cache_bytes(layer.attention, L, d.tp),
                    act=ACT_BYTES * t * (conv_ch + 2 * inner))
    elif isinstance(a, MLA):
        hl = a.heads // d.tp
        width = a.kv_lora_rank + a.qk_rope_dim
        span = L
        if a.index_topk:  # the indexer scores every cached token, MLA then reads the top-k
            il = max(1, a.index_heads // d.tp)
            ops.compute(i, "attention", "dsa_indexer", 2.0 * t * il * a.index_head_dim * (L + rows) + 2.0 * t * il * L,
                        "fp8", kv=b * (L + rows) * a.index_head_dim * kvb,
                        act=ACT_BYTES * t * il * a.index_head_dim + 4.0 * t * L)
            span = min(L, a.index_topk)
        flops = t * hl * span * (4.0 * a.kv_lora_rank + 2.0 * a.qk_rope_dim)
        ops.compute(i, "attention", "mla_attention", flops, "bf16",
                    kv=b * (span + rows) * width * kvb,
                    act=ACT_BYTES * t * hl * (2 * width + a.kv_lora_rank))
    elif isinstance(a, CSA):
        _csa_core(ops, model, a, i, d, g)
    elif isinstance(a, GQA):
        span = _cached(a, L)
        _gqa_core(ops, model, a, i, d, g, (L + rows, L), span, span)


def kda_flops(tokens: float, heads: int, head_dim: int, conv_width: int) -> float:
    """A KDA step's FLOPs for `tokens` token rows over `heads` heads: per head and token the decay,
    k^T S, the rank-1 delta update and S^T q (7 dk dv), and the short conv of q|k|v (2 x width a
    channel)."""
    return tokens * (7.0 * heads * head_dim * head_dim + 2.0 * 3 * heads * head_dim * conv_width)


def _csa_core(ops: _Builder, model: ModelSpec, a: CSA, i: int, d: Deployment, g: Rows):
    """DeepSeek-V4: the compressor writes each new token's projected values and gate scores into
    its running block (the state) and, once every `compress_ratio` tokens, reads the block back
    and writes one entry (softmax-gated sum: about 4 FLOPs a state value); CSA's indexer scores
    every compressed index key; the heads then read the raw window and the selected (CSA) or all
    (HCA) entries, the shared key serving as value (2 x 2 x head_dim FLOPs an entry)."""
    L, rows, b, t = g.context, g.rows, g.seqs, g.tokens
    kvb, stb = model.formats["kv_cache"].bytes_per_value, model.formats["state"].bytes_per_value
    raw, comp = a.entries(L)
    if a.compress_ratio:
        dims = a.head_dim + (a.index_head_dim if a.index_topk else 0)
        state, r = model.csa_state_values(a), a.compress_ratio
        ops.compute(i, "attention", "compressor", 4.0 * t * state / r, "f32",
                    kv=b * rows * (2 * a.coff * dims * stb + (state * stb + dims * kvb) / r),
                    act=ACT_BYTES * t * 2 * a.coff * dims)
    span = raw + comp
    if a.index_topk:
        il = max(1, a.index_heads // d.tp)
        ops.compute(i, "attention", "csa_indexer", 2.0 * t * il * a.index_head_dim * comp + 2.0 * t * il * comp,
                    "fp8", kv=b * comp * a.index_head_dim * kvb,
                    act=ACT_BYTES * t * il * a.index_head_dim + 4.0 * t * comp)
        span = raw + min(comp, a.index_topk)
    hl = a.heads // d.tp
    ops.compute(i, "attention", "csa_attention", 4.0 * t * hl * span * a.head_dim, "bf16",
                kv=b * (span + rows) * a.head_dim * kvb, act=ACT_BYTES * t * hl * 2 * a.head_dim)


def attended(context: int, rows: int, window: int = 0) -> float:
    """Mean tokens a row of a causal prompt chunk attends: row r (0-based) of `rows` after
    `context` cached tokens attends context + r + 1 of them, at most `window` (0: no window)."""
    if not window:
        return context + (rows + 1) / 2
    k = min(rows, max(0, window - context))  # rows whose span is still inside the window
    return (k * context + k * (k + 1) / 2 + (rows - k) * window) / rows


def mla_prefill_flops(a: MLA, heads: int, rows: int, context: int, span: float | None = None) -> dict[str, float]:
    """FLOPs of one sequence's prompt chunk of `rows` tokens after `context` cached, over `heads`
    heads, each row attending `span` tokens (default: the causal mean), in either form:
    "absorbed" (queries into the latent space: 2 (kv_lora + rope) + 2 kv_lora per token pair)
    or "plain" (the cached latents up-projected to per-head keys and values by kv_b, then
    2 (qk_nope + qk_rope) + 2 v_head per pair; the chunk's own rows go through kv_b as its op).
    A prefill runs the cheaper (`min`; perfmodel_kernels.prefill runs the same choice)."""
    span = attended(context, rows) if span is None else span
    return {"absorbed": rows * heads * span * (4.0 * a.kv_lora_rank + 2.0 * a.qk_rope_dim),
            "plain": (2.0 * rows * heads * span * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)
                      + 2.0 * context * a.kv_lora_rank * heads * (a.qk_nope_dim + a.v_head_dim))}


def _causal_core(ops: _Builder, model: ModelSpec, layer: Layer, d: Deployment, g: Rows):
    """The attention core of prompt chunks (prefill): every row attends the cache and the rows
    before it (`attended`: on average context + (rows + 1) / 2 tokens, at most the window). KV
    bytes: the cached tokens read once, the chunk's entries written. MLA runs the cheaper of the
    absorbed form (as in decode) and the expanded one (the cached latents up-projected to per-head
    keys and values by kv_b, then attention at qk_nope + qk_rope / v_head per token pair), as
    serving engines do for prefill. Recurrent kinds (KDA, GDN, Mamba-2) cost what a decode row
    costs per token, the state read and written once per chunk (chunked-scan algorithms' extra
    intra-chunk products are not counted); DeepSeek-V4's compressed attention takes the chunk's
    mean span as its context."""
    i, L, rows, b, t = layer.index, g.context, g.rows, g.seqs, g.tokens
    kvb = model.formats["kv_cache"].bytes_per_value
    a = model.attn(layer.attention)
    if isinstance(a, (KDA, GDN, Mamba2)):
        return _attention_core(ops, model, layer, d, g)
    if isinstance(a, CSA):
        return _csa_core(ops, model, a, i, d, Rows(b, rows, int(round(attended(L, rows)))))
    seen = attended(L, rows)
    if isinstance(a, MLA):
        hl = a.heads // d.tp
        width = a.kv_lora_rank + a.qk_rope_dim
        span = seen
        if a.index_topk:  # each row's indexer scores every token it may attend, MLA reads the top-k
            il = max(1, a.index_heads // d.tp)
            ops.compute(i, "attention", "dsa_indexer", 2.0 * t * il * a.index_head_dim * seen + 2.0 * t * il * seen,
                        "fp8", kv=b * (L + rows) * a.index_head_dim * kvb,
                        act=ACT_BYTES * t * il * a.index_head_dim + 4.0 * t * seen)
            span = min(seen, a.index_topk)
        ops.compute(i, "attention", "mla_attention", min(mla_prefill_flops(a, hl, rows, L, span).values()) * b,
                    "bf16",
                    kv=b * (L + rows) * width * kvb,
                    act=ACT_BYTES * t * hl * (2 * width + a.kv_lora_rank))
    elif isinstance(a, GQA):
        _gqa_core(ops, model, a, i, d, g, (seen, seen), attended(L, rows, a.window),
                  _cached(a, L))


def _gqa_core(ops: _Builder, model: ModelSpec, a: GQA, i: int, d: Deployment, g: Rows,
              scored: tuple[float, float], span: float, cached: float):
    """GQA's scores and values: each row attends `span` tokens (at most the window) and the
    group reads `cached` cached entries (and writes its rows'). Block-sparse (`index_topk`): each
    index head scores `scored[0]` index keys and takes a max per block over `scored[1]`, then its
    KV head's group attends and reads the top-k tokens."""
    b, t, rows = g.seqs, g.tokens, g.rows
    kvb = model.formats["kv_cache"].bytes_per_value
    hl, kvl, vd = a.heads // d.tp, -(-a.kv_heads // d.tp), a.v_head_dim or a.head_dim
    if a.index_topk:
        il = max(1, a.index_heads // d.tp)
        ops.compute(i, "attention", "msa_indexer", 2.0 * t * il * a.index_head_dim * scored[0] + t * il * scored[1],
                    "bf16", kv=b * (g.context + rows) * a.index_head_dim * kvb,
                    act=ACT_BYTES * t * il * a.index_head_dim + 4.0 * t * il * scored[1])
        span, cached = min(scored[1], a.index_topk), min(cached, a.index_topk)
    tile = model.megakernel.kv_tile_tokens if d.engine == "megakernel" and not a.index_topk else 0
    read = _tiles(cached + rows, tile) * tile if tile else cached + rows  # whole tiles (_kv_tiles)
    ops.compute(i, "attention", "gqa_attention", 2.0 * t * hl * (a.head_dim + vd) * span, "bf16",
                kv=b * read * kvl * (a.head_dim + vd) * kvb,
                act=ACT_BYTES * t * hl * (a.head_dim + vd))


def _moe(ops: _Builder, model: ModelSpec, i: int, d: Deployment, t: int, rc: Megakernel, wire,
         dots: dict[str, int]) -> float:
    m, f, h = model.moe, model.formats, model.hidden
    mms = {mm.name: mm for mm in model.ffn_matmuls("moe")}

    def matmul(mm: Matmul, shards: int, copies: int = 1):
        fmt = f[mm.family]
        ops.compute(i, "moe", mm.name, 2.0 * t * mm.params / shards * copies, fmt.compute_dtype,
                    static=model.matmul_bytes(mm) / shards * copies,
                    act=ACT_BYTES * t * (mm.d_in + mm.d_out / shards), fmt=fmt,
                    dots=dots.get(f"moe/{mm.name}", 1) * copies)

    def shared_expert(where: str):
        if m.shared_width and rc.shared_expert == where:
            matmul(mms["shared_gate_up"], d.tp)
            matmul(mms["shared_down"], d.tp)

    matmul(mms["router"], 1, m.router_copies)  # replicated; a hi/lo pair is applied twice
    ops.compute(i, "moe", "top_k", 4.0 * t * m.experts, act=4.0 * t * m.experts)
    d_exp = m.latent_dim or h
    if m.latent_dim:
        matmul(mms["latent_down"], d.tp)
        ops.collective(i, "moe", "latent_all_gather", "all_gather", wire(t, d_exp), d.tp)
    shared_expert("with_copies")
    groups = d.expert_groups
    expert_tp = d.devices // groups
    skew = m.routing_skew if d.routing_skew is None else d.routing_skew
    corr = m.routing_correlation if d.routing_correlation is None else d.routing_correlation
    distinct, pairs = expected_busiest_group(m.experts, m.top_k, t * d.dp, groups, skew, corr)
    fmt = f["routed_expert"]
    per_expert = mms["expert_gate_up"].params // m.experts + mms["expert_down"].params // m.experts
    expert_bytes = sum(model.matmul_bytes(mms[k]) for k in ("expert_gate_up", "expert_down")) / m.experts
    ops.compute(i, "moe", "routed_experts", 2.0 * pairs * per_expert / expert_tp, fmt.compute_dtype,
                routed=distinct * expert_bytes / expert_tp,
                act=ACT_BYTES * pairs * (2 * d_exp + (2 + model.ffn_gated) * m.expert_width / expert_tp), fmt=fmt)
    reduce_rows = t * m.top_k if rc.expert_reduce_rows == "pairs" else t
    ops.collective(i, "moe", "expert_all_reduce", "all_reduce", wire(reduce_rows, d_exp), d.devices)
    if m.latent_dim:
        matmul(mms["latent_up"], d.tp)
    shared_expert("last")
    if m.latent_dim and rc.post_expert_projection == "output_sharded":  # each device a slice of h
        ops.collective(i, "moe", "moe_all_gather", "all_gather", wire(t, h), d.tp)
    else:
        ops.collective(i, "moe", "moe_all_reduce", "all_reduce", wire(t, h), d.tp)
    return distinct
