"""Pure-JAX prefill of the Kimi K3 hybrid family: whole prompts in one XLA program (the
reference a host run traces, as `perfmodel_kernels.reference.decode_step` for decode).

`prefill_step(weights, tokens, max_context)`: tokens [B, C] int32, every sequence's prompt of C
tokens from position 0. Per layer, over all B x C rows (row b * C + t): RMSNorm, attention,
residual, the reference's FFN / latent MoE (`reference.ffn`, its loop over the distinct experts
of all rows), residual; then the head on each sequence's last row only. It returns the next
tokens [B], their logits [B, V] and the caches a decode step continues from
(`reference.cache_shapes`): decoding position C after `prefill_step` is decoding it after C
single-token decode steps (tests/test_kernel_prefill.py).

Attention, causal over the prompt:
- KDA: the projections over all rows; the short conv over the sequence, the earlier tokens as
  the cache stores them (the `kv_cache` format), as a decode step reads its window; the delta
  rule token by token (`jax.lax.scan` of `reference.delta_rule` over the C tokens, the state in
  f32); per-head norm and output gate over all rows.
- MLA: the latents of all rows stored in the cache format and read back from it (as decode
  reads them); scores over positions 0..t; the absorbed or plain form, whichever costs fewer
  FLOPs (`perfmodel.graph.ops.mla_prefill_flops`, the choice the model makes).
Named scopes as the decode step (`embed`, `layer_XX/attention`, `layer_XX/ffn|moe`, `head`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from perfmodel_kernels import reference as R
from perfmodel.graph.ops import mla_prefill_flops
from perfmodel.util.errors import positive_int, require


def mla_form(spec, prompt: int) -> str:
    """The form a prompt chunk of `prompt` tokens from position 0 runs MLA in (module doc)."""
    flops = mla_prefill_flops(spec.mla, spec.mla.heads, prompt, 0)
    return "absorbed" if flops["absorbed"] <= flops["plain"] else "plain"


def _shifted(x, s):
    """x [B, C, ..] moved s rows later along the sequence, zeros in front."""
    return jnp.pad(x, [(0, 0), (s, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]


def _kda(spec, lw, h, b, c, conv_dtype):
    """KDA over the prompt (module doc): (output [n, H], state [B, ..], conv window [B, W-1, ..])."""
    a = spec.kda
    hd, n, width = a.heads * a.head_dim, h.shape[0], a.conv_width
    matmul = lambda name, x: R.mm(x, lw[name])
    qkv = jnp.concatenate([matmul("q_proj", h), matmul("k_proj", h), matmul("v_proj", h)], -1)
    decay, beta = R.kda_gates(matmul("decay_b", matmul("decay_a", h)), lw["A_log"], lw["dt_bias"],
                              matmul("beta_proj", h), a.heads, a.head_dim)
    gate = matmul("gate_proj", h)
    x = qkv.reshape(b, c, 3 * hd)
    stored = x.astype(conv_dtype).astype(jnp.float32)  # the earlier tokens as the window keeps them
    taps = lw["conv"].astype(jnp.float32)
    y = x * taps[width - 1]
    for j in range(width - 1):
        y = y + _shifted(stored, width - 1 - j) * taps[j]
    act = R.silu(y)
    window = jnp.concatenate([jnp.zeros((b, width - 1, 3 * hd), jnp.float32), stored], 1)[:, c:]  # last W-1
    split = lambda i: act[..., i * hd:(i + 1) * hd].reshape(b, c, a.heads, a.head_dim)
    q = R.l2_normalize(split(0)) * a.head_dim ** -0.5
    k, v = R.l2_normalize(split(1)), split(2)
    decay, beta = decay.reshape(b, c, a.heads, a.head_dim), beta.reshape(b, c, a.heads)
    seq = lambda z: jnp.swapaxes(z, 0, 1)  # [C, B, ..]: the scan runs over the tokens

    def step(state, inputs):
        o, state = R.delta_rule(state, *inputs)
        return state, o

    state0 = jnp.zeros((b, a.heads, a.head_dim, a.head_dim), jnp.float32)
    state, o = jax.lax.scan(step, state0, (seq(q), seq(k), seq(v), seq(decay), seq(beta)))
    o = jnp.swapaxes(o, 0, 1).reshape(n, a.heads, a.head_dim)
    o = R.rms_norm(o, lw["o_norm"]).reshape(n, hd) * jax.nn.sigmoid(gate)
    return matmul("o_proj", o), state, window


def _mla(spec, lw, h, b, c, cache_dtype, form):
    """MLA over the prompt (module doc): (output [n, H], latents [B, C, width] in the cache format)."""
    m = spec.mla
    matmul = lambda name, x: R.mm(x, lw[name])
    q_nope, q_rope, new = R.mla_project(spec, matmul, lw, h)
    latents = new.astype(cache_dtype)
    cache = latents.astype(jnp.float32).reshape(b, c, -1)
    lat, k_rope = cache[..., :m.kv_lora_rank], cache[..., m.kv_lora_rank:]
    q_nope = q_nope.reshape(b, c, m.heads, m.qk_nope_dim)
    q_rope = q_rope.reshape(b, c, m.heads, m.qk_rope_dim)
    w_uk, w_uv = R.split_kv_b(spec, lw["kv_b"])
    if form == "absorbed":
        scores = jnp.einsum("bthr,bsr->bhts", jnp.einsum("bthn,rhn->bthr", q_nope, w_uk), lat)
    else:
        scores = jnp.einsum("bthn,bshn->bhts", q_nope, jnp.einsum("bsr,rhn->bshn", lat, w_uk))
    scores = (scores + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope)) * (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
    causal = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]
    p = jax.nn.softmax(jnp.where(causal[None, None], scores, -jnp.inf), axis=-1)
    if form == "absorbed":
        o = jnp.einsum("bthr,rhv->bthv", jnp.einsum("bhts,bsr->bthr", p, lat), w_uv)
    else:
        o = jnp.einsum("bhts,bshv->bthv", p, jnp.einsum("bsr,rhv->bshv", lat, w_uv))
    return R.mla_output(spec, matmul, o.reshape(b * c, m.heads, m.v_head_dim), h), latents.reshape(b, c, -1)


@functools.partial(jax.jit, static_argnames=("max_context", "form"))
def _prefill_jit(weights, tokens, *, max_context, form):
    spec = weights.spec
    b, c = tokens.shape
    cache = {k: jnp.zeros(s, d) for k, (s, d) in R.cache_shapes(spec, b, max_context).items()}
    x = R.embed(weights, tokens.reshape(-1))
    for layer, lw in zip(spec.layers, weights["layers"]):
        with jax.named_scope(R._scope(layer, "attention")):
            h = R.rms_norm(x, lw["attn_norm"])
            i = R.kind_ordinal(spec, layer)
            if layer.attention == "kda":
                out, state, window = _kda(spec, lw, h, b, c, cache["kda_conv"].dtype)
                cache["kda_state"] = cache["kda_state"].at[i].set(state)
                cache["kda_conv"] = cache["kda_conv"].at[i].set(window.astype(cache["kda_conv"].dtype))
            else:
                out, latents = _mla(spec, lw, h, b, c, cache["mla_latent"].dtype, form)
                cache["mla_latent"] = cache["mla_latent"].at[i, :, :c].set(latents)
            x = x + out
        x = R.ffn(spec, layer, lw, x)
    nxt, logits = R.head(weights, x.reshape(b, c, -1)[:, -1])
    return nxt, logits, cache


def prefill_step(weights: R.Weights, tokens, max_context: int):
    """Prefill every sequence's prompt (module doc): (next tokens [B], logits [B, V] f32, caches
    for `max_context` tokens)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    require(tokens.ndim == 2, "tokens.shape", tuple(tokens.shape), "expected (batch, prompt)")
    positive_int("prompt", int(tokens.shape[1]))
    require(max_context >= tokens.shape[1], "max_context", max_context, f"must hold the prompt ({tokens.shape[1]})")
    R.check_spec(weights.spec)
    return _prefill_jit(weights, tokens, max_context=max_context, form=mla_form(weights.spec, tokens.shape[1]))


def compiled_prefill(weights: R.Weights, tokens, max_context: int):
    """The compiled XLA program of `prefill_step` for these arguments; compiled, never run: a
    structure to count (perfmodel_jax.capture)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return _prefill_jit.lower(weights, tokens, max_context=max_context,
                              form=mla_form(weights.spec, tokens.shape[1])).compile()
