"""Pure-JAX decode step of the Kimi K3 hybrid family (the multi-kernel baseline).

One step: embedding; per layer RMSNorm -> KDA or MLA attention -> residual, RMSNorm -> dense FFN
or latent MoE (sigmoid router with selection bias, top-k, shared experts) -> residual; final norm,
lm_head, greedy sampling. Shapes come only from a `perfmodel.spec.arch.ModelSpec`. A step decodes one
token per sequence or verifies a block of up to `MAX_ROWS` tokens per sequence (row r at
position pos + r, causal within the block; only the first `accepted` rows of each sequence
update the caches: `verify_inputs`).

Numerics (the megakernel follows the same rules): weights are stored in `dtype` (bf16 by
default); a matmul casts its activation input to the weight dtype and accumulates in f32; every
other op (norms, gates, recurrences, softmax) runs in f32. The MLA latent cache and the KDA
short-conv window are stored in the `kv_cache` format (bf16, as `perfmodel.graph.ops` counts them),
the KDA recurrent state in the `state` format (f32).

Model details fixed here (the preset does not state them): RMSNorm eps 1e-6; KDA q/k are
L2-normalised per head, q scaled by head_dim^-1/2, the short conv (width W, depthwise, SiLU)
acts on q|k|v, the decay is g = max(-exp(A_log) * softplus(decay_b(decay_a(x)) + dt_bias), -5)
per channel (the -5 lower bound of docs/sources.md s.3), beta = sigmoid(beta_proj(x)), the delta rule
S' = (I - beta k k^T) diag(exp g) S + beta k v^T, o = S'^T q, per-head RMSNorm, sigmoid output
gate. MLA has no positional encoding (docs/sources.md s.3), so the rope part of the key is a shared
latent without rotation; softmax scale (qk_nope+qk_rope)^-1/2. The router picks top-k of
sigmoid(logits) + bias and weights the picks by sigmoid(logits) normalised to sum 1.

Named scopes: `embed`, `layer_XX/attention`, `layer_XX/ffn` or `layer_XX/moe` (with sub-scopes
`router`, `experts`, `shared`) and `head`; every op of the step lies inside one of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from perfmodel.spec.arch import Layer, ModelSpec
from perfmodel.util.errors import positive_int, require

EPS = 1e-6
DECAY_LOWER_BOUND = -5.0


# ----- weights and cache ----------------------------------------------------------------------

class StaticSpec:
    """A ModelSpec as hashable static data (ModelSpec holds dicts, so it has no hash)."""

    def __init__(self, spec: ModelSpec):
        self.spec, self._key = spec, repr(spec)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, StaticSpec) and other._key == self._key


@dataclass(frozen=True)
class Weights:
    """All weights of a model (a pytree of arrays) with their spec as static data.

    params: {"embed": [V, H], "layers": [per-layer {name: array}], "final_norm": [H],
    "lm_head": [H, V]}; a layer's names are those of `spec.layer_matmuls` (experts stacked on a
    leading axis) and of `small_param_shapes`."""
    params: dict
    static: StaticSpec

    @property
    def spec(self) -> ModelSpec:
        return self.static.spec

    def __getitem__(self, key):
        return self.params[key]


jax.tree_util.register_dataclass(Weights, data_fields=["params"], meta_fields=["static"])


def small_param_shapes(spec: ModelSpec, layer: Layer) -> dict[str, tuple[int, ...]]:
    """Every non-matmul weight of a layer, by name (the two RMSNorms, conv taps, decay constants,
    latent norms, router selection bias)."""
    h = spec.hidden
    out = {"attn_norm": (h,), "ffn_norm": (h,)}
    if layer.attention == "kda":
        a = spec.kda
        out |= {"conv": (a.conv_width, 3 * a.heads * a.head_dim), "A_log": (a.heads,),
                "dt_bias": (a.heads,), "o_norm": (a.head_dim,)}
    elif layer.attention == "mla":
        out |= {"q_norm": (spec.mla.q_lora_rank,), "kv_norm": (spec.mla.kv_lora_rank,)}
    if layer.ffn == "moe":
        out["router_bias"] = (spec.moe.experts,)
    return out


def check_spec(spec: ModelSpec) -> None:
    """Refuse specs outside the hybrid family this step implements."""
    for layer in spec.layers:
        require(layer.attention in ("kda", "mla"), f"layers[{layer.index}].attention",
                layer.attention, "the K3 decode step implements kda and mla attention only")
    if spec.kda and spec.count(attention="kda"):
        require(spec.kda.output_gate_rank == 0, "kda.output_gate_rank", spec.kda.output_gate_rank,
                "only the full-rank output gate (0) is implemented")
        positive_int("kda.conv_width", spec.kda.conv_width)
        positive_int("kda.decay_gate_rank", spec.kda.decay_gate_rank)
    if spec.mla and spec.count(attention="mla"):
        positive_int("mla.q_lora_rank", spec.mla.q_lora_rank)


def init_weights(spec: ModelSpec, seed: int = 0, dtype=jnp.bfloat16) -> Weights:
    """Seeded random weights named and shaped as `spec.layer_matmuls` / `small_param_shapes`,
    drawn on an accelerator by one jitted program per (spec, dtype), where op by op every new
    shape compiles a program of its own (a Kimi K3 slice on a TPU v5e: 56 s op by op, 40 s as
    one program); on a CPU op by op (compiling the one program costs more than it saves)."""
    check_spec(spec)
    static = StaticSpec(spec)
    return Weights(_draw_program(static, jnp.dtype(dtype))(jax.random.key(seed)), static)


@functools.lru_cache(maxsize=8)
def _draw_program(static: StaticSpec, dtype):
    """jit(key -> params) for `init_weights`: one key per tensor, folded in from the seed's."""
    spec = static.spec

    def draw_all(base):
        count = iter(range(1 << 30))

        def draw(shape):
            return jax.random.normal(jax.random.fold_in(base, next(count)), shape, jnp.float32)

        def normal(shape, scale):
            return (draw(shape) * scale).astype(dtype)

        def small(name, shape):
            if name in ("attn_norm", "ffn_norm", "o_norm", "q_norm", "kv_norm"):
                return (1.0 + 0.1 * draw(shape)).astype(dtype)
            if name == "A_log":
                u = jax.random.uniform(jax.random.fold_in(base, next(count)), shape,
                                       jnp.float32, 1.0, 16.0)
                return jnp.log(u).astype(dtype)
            scale = {"conv": 0.5, "dt_bias": 0.5, "router_bias": 0.1}[name]
            return normal(shape, scale)

        layers = []
        for layer in spec.layers:
            lw = {name: small(name, shape)
                  for name, shape in small_param_shapes(spec, layer).items()}
            for mm in spec.layer_matmuls(layer):
                shape = (mm.d_in, mm.d_out) if mm.experts == 1 else (mm.experts, mm.d_in, mm.d_out)
                lw[mm.name] = normal(shape, mm.d_in ** -0.5)
            layers.append(lw)
        return {"embed": normal((spec.vocab, spec.hidden), 1.0), "layers": layers,
                "final_norm": small("attn_norm", (spec.hidden,)),
                "lm_head": normal((spec.hidden, spec.vocab), spec.hidden ** -0.5)}
    return draw_all if jax.default_backend() == "cpu" else jax.jit(draw_all)


def cache_shapes(spec: ModelSpec, batch: int, max_context: int) -> dict[str, tuple[tuple, object]]:
    """Per-kind stacked caches: KDA state (f32), KDA conv window and MLA latent cache (bf16)."""
    out = {}
    n_kda, n_mla = spec.count(attention="kda"), spec.count(attention="mla")
    if n_kda:
        a = spec.kda
        out["kda_state"] = ((n_kda, batch, a.heads, a.head_dim, a.head_dim), jnp.float32)
        out["kda_conv"] = ((n_kda, batch, a.conv_width - 1, 3 * a.heads * a.head_dim),
                           jnp.bfloat16)
    if n_mla:
        m = spec.mla
        out["mla_latent"] = ((n_mla, batch, max_context, m.kv_lora_rank + m.qk_rope_dim),
                             jnp.bfloat16)
    return out


def init_cache(spec: ModelSpec, batch: int, max_context: int) -> dict[str, jax.Array]:
    """Zero caches for `batch` sequences of up to `max_context` tokens."""
    check_spec(spec)
    positive_int("batch", batch), positive_int("max_context", max_context)
    return {k: jnp.zeros(s, d) for k, (s, d) in cache_shapes(spec, batch, max_context).items()}


def kind_ordinal(spec: ModelSpec, layer: Layer) -> int:
    """0-based index of `layer` among the layers of its attention kind (its cache slot)."""
    return sum(1 for l in spec.layers[:layer.index - 1] if l.attention == layer.attention)


# ----- building blocks (shared with the megakernel) ----------------------------------------------

def mm(x, w):
    """x @ w with x cast to the weight dtype and f32 accumulation."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def rms_norm(x, w):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w.astype(jnp.float32)


def silu(x):
    return x * jax.nn.sigmoid(x)


def swiglu(gu):
    """silu(gate) * up for a fused [.., 2w] gate|up activation."""
    w = gu.shape[-1] // 2
    return silu(gu[..., :w]) * gu[..., w:]


def short_conv(window, x_new, taps):
    """Depthwise causal conv of width W + SiLU. window [B, W-1, C] (oldest first), x_new [B, C],
    taps [W, C]. Returns (activation [B, C], new window)."""
    taps = taps.astype(jnp.float32)
    w = taps.shape[0]
    y = x_new * taps[w - 1]
    for j in range(w - 1):
        y = y + window[:, j] * taps[j]
    new_window = jnp.concatenate([window[:, 1:], x_new[:, None]], axis=1) if w > 1 else window
    return silu(y), new_window


def l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + EPS)


def kda_gates(h_dec_b, a_log, dt_bias, beta_logits, heads, dk):
    """Per-channel decay exp(g) [B, heads, dk] and beta [B, heads] from the projections."""
    b = h_dec_b.shape[0]
    pre = h_dec_b.reshape(b, heads, dk) + dt_bias.astype(jnp.float32).reshape(1, heads, 1)
    g = -jnp.exp(a_log.astype(jnp.float32)).reshape(1, heads, 1) * jax.nn.softplus(pre)
    return jnp.exp(jnp.maximum(g, DECAY_LOWER_BOUND)), jax.nn.sigmoid(beta_logits)


def delta_rule(state, q, k, v, decay, beta):
    """One KDA recurrent step for [B, heads, dk(, dv)] operands; returns (o [B, heads, dv], S')."""
    s1 = decay[..., None] * state
    u = v - jnp.sum(k[..., None] * s1, axis=2)
    s2 = s1 + (beta[..., None] * k)[..., None] * u[:, :, None, :]
    return jnp.sum(q[..., None] * s2, axis=2), s2


def route(logits, bias, top_k):
    """Sigmoid router with selection bias: dense combine weights [B, E] (zeros off the top-k)."""
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + bias.astype(jnp.float32), top_k)
    picked = jnp.sum(jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32), axis=1)
    w = scores * picked
    return w / jnp.sum(w, axis=-1, keepdims=True), ids


def router_margin(logits, bias, top_k):
    """The smallest gap over rows between the top_k-th and the next biased router score: near
    zero, a program that rounds the hidden state differently may pick the other expert (the TPU
    check's bound: experiments/tpu_megakernel.py, ROUTER_MARGIN)."""
    top = jax.lax.top_k(jax.nn.sigmoid(logits) + bias.astype(jnp.float32), top_k + 1)[0]
    return jnp.min(top[..., top_k - 1] - top[..., top_k])


# ----- phases ---------------------------------------------------------------------------------

def _scope(layer: Layer, phase: str) -> str:
    return f"layer_{layer.index:02d}/{phase}"


def embed(weights, tokens):
    with jax.named_scope("embed"):
        return jnp.take(weights["embed"], tokens, axis=0).astype(jnp.float32)


def kda_block(spec, matmul, v, load_state, h, accepted, rows=1):
    """KDA attention of the normed input h [n, H]: `rows` verify rows per sequence, row r of
    sequence b at h[r * B + b] (B sequences, the batch of the state), rows past rows * B padding.
    matmul(name, x) applies a layer weight (in spec order), v maps small-vector names to values,
    load_state() returns (state [B, ..], conv window [B, ..]) and is called after the
    projections. The recurrence runs row by row; the returned state and window are those after
    the first accepted[b] rows of each sequence (accepted [B, 1] int32).
    Returns (output [n, H], new state, new window)."""
    a = spec.kda
    n, c = h.shape[0], a.heads * a.head_dim

    def marked(scope, *names):   # h through the weights `names` in turn, under a trace marker
        with jax.named_scope(scope):
            x = h
            for name in names:
                x = matmul(name, x)
            return x

    qkv = jnp.concatenate([marked(p, p) for p in ("q_proj", "k_proj", "v_proj")], -1)
    dec = marked("decay", "decay_a", "decay_b")
    beta_logits, gate = marked("beta_proj", "beta_proj"), marked("gate_proj", "gate_proj")
    state, window = load_state()
    b = state.shape[0]
    with jax.named_scope("recurrence"):  # the model's kda_recurrence op
        decay, beta = kda_gates(dec, v["A_log"], v["dt_bias"], beta_logits, a.heads, a.head_dim)
        kept_state, kept_window, outs = state, window, []
        for r in range(rows):  # the window keeps earlier rows in its storage format, as the cache
            act, window = short_conv(window, qkv[r * b:(r + 1) * b], v["conv"])
            window = window.astype(kept_window.dtype)
            split = lambda i: act[:, i * c:(i + 1) * c].reshape(b, a.heads, a.head_dim)
            q, k, vv = l2_normalize(split(0)) * a.head_dim ** -0.5, l2_normalize(split(1)), split(2)
            o, state = delta_rule(state, q, k, vv, decay[r * b:(r + 1) * b],
                                  beta[r * b:(r + 1) * b])
            outs.append(o)
            ok = r < accepted
            kept_state = jnp.where(ok[:, :, None, None], state, kept_state)
            kept_window = jnp.where(ok[:, :, None], window, kept_window)
        if n > rows * b:
            outs.append(jnp.zeros((n - rows * b,) + outs[0].shape[1:], outs[0].dtype))
        o = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
        o = rms_norm(o, v["o_norm"]).reshape(n, c) * jax.nn.sigmoid(gate)
    with jax.named_scope("o_proj"):
        return matmul("o_proj", o), kept_state, kept_window


def mla_project(spec, matmul, v, h):
    """MLA query (nope, rope parts, [B, heads, .]) and the new latent [B, kv_lora + rope] f32."""
    m = spec.mla
    q = matmul("q_b", rms_norm(matmul("q_a", h), v["q_norm"]))
    q = q.reshape(h.shape[0], m.heads, m.qk_nope_dim + m.qk_rope_dim)
    kv = matmul("kv_a", h)
    new = jnp.concatenate([rms_norm(kv[:, :m.kv_lora_rank], v["kv_norm"]),
                           kv[:, m.kv_lora_rank:]], -1)
    return q[..., :m.qk_nope_dim], q[..., m.qk_nope_dim:], new


def split_kv_b(spec, kv_b):
    """kv_b [kv_lora, heads*(nope+v)] -> (W_uk [r, heads, nope], W_uv [r, heads, v]) f32."""
    m = spec.mla
    w = kv_b.astype(jnp.float32).reshape(m.kv_lora_rank, m.heads, m.qk_nope_dim + m.v_head_dim)
    return w[..., :m.qk_nope_dim], w[..., m.qk_nope_dim:]


def mla_output(spec, matmul, o, h):
    """Output gate (if any) and o_proj of the attention values o [B, heads, v]."""
    m = spec.mla
    o = o.reshape(o.shape[0], m.heads * m.v_head_dim)
    if m.output_gate:
        o = o * jax.nn.sigmoid(matmul("gate_proj", h))
    return matmul("o_proj", o)


def row_layout(positions, rows):
    """(sequence, draft row, position) of every token row r * B + b of a verify block."""
    b = positions.shape[0]
    seq = jnp.tile(jnp.arange(b), rows)
    r = jnp.repeat(jnp.arange(rows), b)
    return seq, r, positions[seq] + r


def latent_write(latent_cache, new, seq, r, pos, accepted):
    """(the cache with every row of the block written, for this step's attention; the cache with
    only the accepted rows written, kept for the next step). Two updates of one array: XLA
    writes at least one of them into a copy of the cache (tpu_microbench.py times it)."""
    new = new.astype(latent_cache.dtype)
    # every row of the block attends the cache and rows 0..r of its own block; only the
    # accepted rows are written to the cache
    block = latent_cache.at[seq, pos].set(new)
    kept = latent_cache.at[seq, jnp.where(r < accepted[seq], pos, latent_cache.shape[1])].set(new, mode="drop")
    return block, kept


def _mla(spec, lw, latent_cache, h, positions, accepted, rows, form):
    m = spec.mla
    matmul = lambda name, x: mm(x, lw[name])
    t_max = latent_cache.shape[1]
    q_nope, q_rope, new = mla_project(spec, matmul, lw, h)
    seq, r, pos = row_layout(positions, rows)
    block, kept = latent_write(latent_cache, new, seq, r, pos, accepted)
    cache = (block if rows == 1 else block[seq]).astype(jnp.float32)  # one row: seq is arange(B)
    c, k_rope = cache[..., :m.kv_lora_rank], cache[..., m.kv_lora_rank:]
    w_uk, w_uv = split_kv_b(spec, lw["kv_b"])
    if form == "absorbed":
        q_lat = jnp.einsum("bhn,rhn->bhr", q_nope, w_uk)
        scores = jnp.einsum("bhr,btr->bht", q_lat, c)
    else:
        scores = jnp.einsum("bhn,bthn->bht", q_nope, jnp.einsum("btr,rhn->bthn", c, w_uk))
    scores = (scores + jnp.einsum("bhp,btp->bht", q_rope, k_rope)) \
        * (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
    valid = jnp.arange(t_max)[None, None, :] <= pos[:, None, None]
    p = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    if form == "absorbed":
        o = jnp.einsum("bhr,rhv->bhv", jnp.einsum("bht,btr->bhr", p, c), w_uv)
    else:
        o = jnp.einsum("bht,bthv->bhv", p, jnp.einsum("btr,rhv->bthv", c, w_uv))
    return mla_output(spec, matmul, o, h), kept


def attention(spec, layer, lw, cache, x, positions, accepted, rows=1, mla_form="absorbed"):
    """x + attention(rms_norm(x)) for `rows` verify rows per sequence (x [rows * B, H], row r
    of sequence b at r * B + b); updates this layer's slot of the stacked cache with the first
    accepted[b] rows of each sequence."""
    with jax.named_scope(_scope(layer, "attention")):
        h = rms_norm(x, lw["attn_norm"])
        i, cache = kind_ordinal(spec, layer), dict(cache)
        if layer.attention == "kda":
            matmul = lambda name, x: mm(x, lw[name])
            load = lambda: (cache["kda_state"][i], cache["kda_conv"][i])
            out, st, win = kda_block(spec, matmul, lw, load, h, accepted[:, None], rows)
            cache["kda_state"] = cache["kda_state"].at[i].set(st)
            cache["kda_conv"] = cache["kda_conv"].at[i].set(win.astype(cache["kda_conv"].dtype))
        else:
            out, lat = _mla(spec, lw, cache["mla_latent"][i], h, positions, accepted, rows,
                            mla_form)
            cache["mla_latent"] = cache["mla_latent"].at[i].set(lat)
        return x + out, cache


def distinct_experts(ids, n_experts, size):
    """Sorted distinct expert ids of a batch's picks, padded to `size` with `n_experts`."""
    return jnp.unique(ids.reshape(-1), size=size, fill_value=n_experts)


def expert_loop(z, comb, uniq, n, gate_up, down):
    """sum over j < n of comb[:, e] * swiglu(z @ gate_up[e]) @ down[e], e = uniq[j] (f32): one XLA
    loop trip per expert, each reading that expert's weights in place from the stacked [E, ...]
    arrays. (tpu_microbench.py times this loop alone.)"""
    def apply(j, acc):
        e = uniq[j]
        y = mm(swiglu(mm(z, gate_up[e])), down[e])
        return acc + jax.lax.dynamic_index_in_dim(comb, e, axis=1) * y
    return jax.lax.fori_loop(0, n, apply, jnp.zeros(z.shape, jnp.float32))


def ffn(spec, layer, lw, x, picked: list | None = None, margins: list | None = None):
    """x + dense FFN or latent MoE of rms_norm(x); a MoE layer appends to `picked` (when given)
    the count of distinct experts its rows picked (traced int32), to `margins` its
    `router_margin`."""
    phase = "ffn" if layer.ffn == "dense" else "moe"
    with jax.named_scope(_scope(layer, phase)):
        h = rms_norm(x, lw["ffn_norm"])
        if layer.ffn == "dense":
            return x + mm(swiglu(mm(h, lw["gate_up"])), lw["down"])
        m = spec.moe
        with jax.named_scope("router"):
            logits = mm(h, lw["router"])
            comb, ids = route(logits, lw["router_bias"], m.top_k)
            if margins is not None:
                margins.append(router_margin(logits, lw["router_bias"], m.top_k))
        with jax.named_scope("experts"):
            z = mm(h, lw["latent_down"]) if m.latent_dim else h
            # Loop over the batch's distinct experts (ascending ids, as the megakernel), reading
            # each expert's weights in place: only the picked experts are read, once.
            uniq = distinct_experts(ids, m.experts, min(m.experts, ids.size))
            n = jnp.sum(uniq < m.experts)
            if picked is not None:
                picked.append(n)
            routed = expert_loop(z, comb, uniq, n, lw["expert_gate_up"], lw["expert_down"])
            out = mm(routed, lw["latent_up"]) if m.latent_dim else routed
        if m.shared_width:
            with jax.named_scope("shared"):
                out = out + mm(swiglu(mm(h, lw["shared_gate_up"])), lw["shared_down"])
        return x + out


def head(weights, x):
    """Final norm, lm_head, greedy sampling: (next tokens [B] int32, logits [B, V] f32)."""
    with jax.named_scope("head"):
        logits = mm(rms_norm(x, weights["final_norm"]), weights["lm_head"])
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits


# ----- the step -------------------------------------------------------------------------------

MAX_ROWS = 8  # verify rows per sequence (a draft block)


def verify_inputs(batch, tokens, positions, accepted):
    """Check a step's inputs and put them in the engines' layout: (token rows [rows * B] with
    row r of sequence b at r * B + b, positions [B], accepted [B], rows). tokens [B] (one row
    per sequence) or [B, rows] (a verify block, rows <= MAX_ROWS); positions [B] the position of
    each sequence's row 0 (row r sits at position + r); accepted [B] in [0, rows]: the rows whose
    cache / state updates are kept (default: all)."""
    tokens, positions = jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
    require(tokens.ndim in (1, 2) and tokens.shape[0] == batch, "tokens.shape",
            tuple(tokens.shape), f"expected ({batch},) or ({batch}, rows) to match the batch")
    rows = tokens.shape[1] if tokens.ndim == 2 else 1
    require(1 <= rows <= MAX_ROWS, "rows", rows, f"must be in [1, {MAX_ROWS}]")
    require(positions.shape == (batch,), "positions.shape", tuple(positions.shape),
            f"expected ({batch},) to match the batch")
    if accepted is None:
        accepted = np.full((batch,), rows, np.int32)
    require(np.shape(accepted) == (batch,), "accepted", np.shape(accepted),
            f"expected {batch} counts")
    if not isinstance(accepted, jax.core.Tracer):  # values are checked where they are known
        acc = np.asarray(accepted)
        require(bool(((acc >= 0) & (acc <= rows)).all()), "accepted", acc.tolist(),
                f"expected counts in [0, rows={rows}]")
        accepted = acc.astype(np.int32)  # host data: the jitted step takes it with its call
    flat = tokens if tokens.ndim == 1 else tokens.reshape(batch, rows).T.reshape(-1)
    return flat, positions, accepted, rows


def verify_outputs(nxt, logits, batch, rows, block: bool):
    """Token rows back to [B] / [B, V] (one row per sequence) or [B, rows] / [B, rows, V]."""
    if not block and nxt.shape[0] == batch:  # one unpadded row per sequence: already in place (no
        return nxt, logits                   # copy of the logits outside the traced step)
    nxt = nxt[:rows * batch].reshape(rows, batch).T
    logits = logits[:rows * batch].reshape(rows, batch, -1).transpose(1, 0, 2)
    return (nxt, logits) if block else (nxt[:, 0], logits[:, 0])


def _forward(weights, cache, tokens, positions, accepted, rows, mla_form, margins=None):
    """(next tokens, logits, new cache, distinct experts picked per MoE layer [n_moe] int32);
    each MoE layer's `router_margin` appended to `margins` when given."""
    spec, picked = weights.spec, []
    x = embed(weights, tokens)
    for layer, lw in zip(spec.layers, weights["layers"]):
        x, cache = attention(spec, layer, lw, cache, x, positions, accepted, rows, mla_form)
        x = ffn(spec, layer, lw, x, picked, margins)
    nxt, logits = head(weights, x)
    return nxt, logits, cache, jnp.array(picked, jnp.int32).reshape(len(picked))


@functools.partial(jax.jit, static_argnames=("rows", "mla_form"), donate_argnames=("cache",))
def _decode_step_jit(weights, cache, tokens, positions, accepted, *, rows, mla_form):
    return _forward(weights, cache, tokens, positions, accepted, rows, mla_form)[:3]


@jax.jit
def router_margins(weights, cache, tokens, positions):
    """Each MoE layer's `router_margin` [n_moe] f32 in the decode step `decode_step` would run
    on these arguments (the cache is not donated; a dense model gives an empty array)."""
    margins = []
    _forward(weights, cache, tokens, positions, jnp.ones_like(positions), 1, "absorbed", margins)
    return jnp.stack(margins) if margins else jnp.zeros((0,), jnp.float32)


PICKS_KEPT = 64   # the steps of a decode loop (`make_loop`) whose distinct experts it returns


def make_loop():
    """loop(weights, cache, tokens [B], positions [B], steps) -> (tokens after `steps` (a traced
    int32) greedy decode steps of `decode_step`'s XLA program in one jitted call (one host
    dispatch), new cache, the distinct experts each MoE layer picked in each step, [PICKS_KEPT,
    MoE layers] int32 (row i step i; rows from `steps` on zero)): the program's time per step is
    the slope of a call's time over `steps`, and one compile serves every count."""
    @functools.partial(jax.jit, donate_argnames=("cache",))
    def loop(weights, cache, tokens, positions, steps):
        ones = jnp.ones_like(positions)
        n_moe = weights.spec.count(ffn="moe")

        def body(i, carry):
            tok, pos, cache, picks = carry
            nxt, _, cache, picked = _forward(weights, cache, tok, pos, ones, 1, "absorbed")
            return nxt, pos + 1, cache, picks.at[i].set(picked, mode="drop")
        tok, _, cache, picks = lax.fori_loop(
            0, steps, body, (tokens, positions, cache, jnp.zeros((PICKS_KEPT, n_moe), jnp.int32)))
        return tok, cache, picks
    return loop


def _batch(cache):
    return next(iter(cache.values())).shape[1]


def decode_step(weights: Weights, cache, tokens, positions, accepted=None,
                mla_form: str = "absorbed"):
    """One decode (or verify) step as one XLA program: (next tokens, logits f32, new cache).

    tokens [B] int32 are the current tokens, positions [B] int32 their 0-based positions (the
    MLA cache holds positions 0..pos-1 and gets entry pos): next tokens [B], logits [B, V]. A
    verify block: tokens [B, rows], row r at position pos + r, causal within the block (row r
    attends the cache and rows 0..r), only the first accepted[b] rows written to the caches
    (`verify_inputs`): next tokens [B, rows], logits [B, rows, V]. The cache is donated.
    """
    require(mla_form in ("absorbed", "plain"), "mla_form", mla_form, "absorbed or plain")
    b = _batch(cache)
    flat, positions, accepted, rows = verify_inputs(b, tokens, positions, accepted)
    nxt, logits, cache = _decode_step_jit(weights, cache, flat, positions, accepted,
                                          rows=rows, mla_form=mla_form)
    return (*verify_outputs(nxt, logits, b, rows, jnp.ndim(tokens) == 2), cache)


def compiled_step(weights: Weights, cache, tokens, positions, accepted=None, mla_form: str = "absorbed"):
    """The compiled XLA program of `decode_step` for these arguments; compiled, never run: a
    structure to count (HLO text, `memory_analysis`), e.g. by perfmodel_jax.hostbench."""
    require(mla_form in ("absorbed", "plain"), "mla_form", mla_form, "absorbed or plain")
    flat, positions, accepted, rows = verify_inputs(_batch(cache), tokens, positions, accepted)
    return _decode_step_jit.lower(weights, cache, flat, positions, accepted, rows=rows,
                                  mla_form=mla_form).compile()


def compiled_attention_phases(weights: Weights, cache, tokens, positions, accepted=None,
                              mla_form: str = "absorbed") -> dict:
    """`decode_step_op_by_op`'s attention programs (layer index -> compiled program) for these
    arguments; compiled, never run, as `compiled_step`."""
    require(mla_form in ("absorbed", "plain"), "mla_form", mla_form, "absorbed or plain")
    flat, positions, accepted, rows = verify_inputs(_batch(cache), tokens, positions, accepted)
    _, attn, _, _ = _phase_fns(weights.static, rows, mla_form)
    x = jnp.zeros((flat.shape[0], weights.spec.hidden), jnp.float32)
    return {l.index: attn[l.index].lower(lw, cache, x, positions, accepted).compile()
            for l, lw in zip(weights.spec.layers, weights["layers"])}


@functools.lru_cache(maxsize=None)
def _phase_fns(static: StaticSpec, rows: int, mla_form: str):
    spec, jit = static.spec, jax.jit
    attn = {l.index: jit(functools.partial(attention, spec, l, rows=rows, mla_form=mla_form),
                         donate_argnums=(1,)) for l in spec.layers}
    ffns = {l.index: jit(functools.partial(ffn, spec, l)) for l in spec.layers}
    return jit(embed), attn, ffns, jit(head)


def decode_step_op_by_op(weights: Weights, cache, tokens, positions, accepted=None,
                         mla_form: str = "absorbed"):
    """Same step, dispatching embed, each layer's attention and FFN/MoE, and head as separate
    jitted calls (a multi-kernel engine)."""
    require(mla_form in ("absorbed", "plain"), "mla_form", mla_form, "absorbed or plain")
    b = _batch(cache)
    flat, positions, accepted, rows = verify_inputs(b, tokens, positions, accepted)
    emb, attn, ffns, hd = _phase_fns(weights.static, rows, mla_form)
    x = emb(weights, flat)
    for layer, lw in zip(weights.spec.layers, weights["layers"]):
        x, cache = attn[layer.index](lw, cache, x, positions, accepted)
        x = ffns[layer.index](lw, x)
    nxt, logits = hd(weights, x)
    return (*verify_outputs(nxt, logits, b, rows, jnp.ndim(tokens) == 2), cache)
