"""The pure-JAX reference decode step: shapes from the spec, one-program vs op-by-op, MLA forms,
KDA and router invariants, named scopes, caches carried across steps, derived sizes."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from perfmodel_kernels import reference
from perfmodel_kernels.specs import ODD_SIZED
from perfmodel.spec.arch import derive
from perfmodel.util.errors import SpecError


def _inputs(spec, batch, context=16, seed=0):
    rng = np.random.default_rng(seed)
    return (reference.init_cache(spec, batch, context),
            jnp.asarray(rng.integers(0, spec.vocab, batch), jnp.int32),
            jnp.asarray(rng.integers(0, context // 2, batch), jnp.int32))


def test_weights_follow_the_spec(spec, weights):
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(weights))
    assert n == spec.total_params
    for layer, lw in zip(spec.layers, weights["layers"]):
        for mm in spec.layer_matmuls(layer):
            want = (mm.d_in, mm.d_out) if mm.experts == 1 else (mm.experts, mm.d_in, mm.d_out)
            assert lw[mm.name].shape == want and lw[mm.name].dtype == jnp.bfloat16
    f32 = reference.init_weights(spec, seed=0, dtype=jnp.float32)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(f32))


def test_cache_shapes(spec):
    c = reference.init_cache(spec, 3, 16)
    assert c["kda_state"].shape == (3, 3, 2, 128, 128) and c["kda_state"].dtype == jnp.float32
    assert c["kda_conv"].shape == (3, 3, 3, 768)
    assert c["mla_latent"].shape == (1, 3, 16, 256) and c["mla_latent"].dtype == jnp.bfloat16


@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_one_program_equals_op_by_op(spec, weights, batch):
    c1, tok, pos = _inputs(spec, batch)
    c2 = jax.tree.map(jnp.copy, c1)
    for _ in range(3):
        n1, l1, c1 = reference.decode_step(weights, c1, tok, pos)
        _, l2, c2 = reference.decode_step_op_by_op(weights, c2, tok, pos)
        np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=1e-5)
        tok, pos = n1, pos + 1
    for k in c1:
        np.testing.assert_allclose(np.asarray(c1[k], np.float32), np.asarray(c2[k], np.float32),
                                   atol=1e-5)


@pytest.fixture(scope="module")
def weights_f32(spec):
    return reference.init_weights(spec, seed=0, dtype=jnp.float32)


def test_mla_attention_forms_agree_in_f32(spec, weights_f32):
    """One MLA layer's output, absorbed vs plain, f32 weights. The forms only reorder f32
    contractions (kv_lora + rope = 160 terms, then up to 16 cached positions, then 8 x 64 values
    into o_proj): each sum carries a relative rounding error of at most about n x 2^-24 ~ 1e-5 in
    the worst case and ~sqrt(n) x 2^-24 ~ 1e-6 typically, so 1e-5 holds on any CPU's summation
    order (both forms cast the new latent to the same bf16 cache row)."""
    layer = next(l for l in spec.layers if l.attention == "mla")
    lw = weights_f32["layers"][layer.index - 1]
    cache, _, pos = _inputs(spec, 4, seed=1)
    latent = cache["mla_latent"][0]
    rng = np.random.default_rng(5)
    latent = jnp.asarray(rng.standard_normal(latent.shape), latent.dtype)  # a filled cache
    h = jnp.asarray(rng.standard_normal((4, spec.hidden)), jnp.float32)
    accepted = jnp.ones(4, jnp.int32)
    out = {form: reference._mla(spec, lw, latent, h, pos, accepted, 1, form)[0] for form in ("absorbed", "plain")}
    np.testing.assert_allclose(out["absorbed"], out["plain"], rtol=1e-5, atol=1e-5 * float(jnp.abs(out["plain"]).max()))


def test_mla_absorbed_equals_plain(spec, weights_f32):
    """The whole step in both MLA forms, three steps, f32 weights: equal to 1e-5. (With bf16
    weights an activation a rounding step of 2^-8 away from a bf16 boundary flips in o_proj's
    input cast and the logits differ by ~1e-3: that is bf16 storage, not the forms.)"""
    c1, tok, pos = _inputs(spec, 4, seed=1)
    c2 = jax.tree.map(jnp.copy, c1)
    for _ in range(3):
        n1, l1, c1 = reference.decode_step(weights_f32, c1, tok, pos, mla_form="absorbed")
        _, l2, c2 = reference.decode_step(weights_f32, c2, tok, pos, mla_form="plain")
        np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=1e-5)
        tok, pos = n1, pos + 1


def test_sequences_are_independent(spec, weights):
    """A sequence's logits do not depend on the other sequences of the batch."""
    cache, tok, pos = _inputs(spec, 4, seed=2)
    _, logits, _ = reference.decode_step(weights, cache, tok, pos)
    c1 = reference.init_cache(spec, 1, 16)
    _, one, _ = reference.decode_step(weights, c1, tok[2:3], pos[2:3])
    np.testing.assert_allclose(one[0], logits[2], atol=3e-2)  # bf16 rounding noise only


def test_mla_ignores_cache_beyond_position(spec, weights):
    cache, tok, pos = _inputs(spec, 2, seed=3)
    pos = jnp.array([3, 5], jnp.int32)
    noisy = dict(cache)
    noisy["mla_latent"] = cache["mla_latent"].at[:, :, 6:].set(7.0)
    _, l1, _ = reference.decode_step(weights, jax.tree.map(jnp.copy, cache), tok, pos)
    _, l2, _ = reference.decode_step(weights, noisy, tok, pos)
    np.testing.assert_allclose(l1, l2, atol=1e-6)


def test_cache_is_updated_in_place_positions(spec, weights):
    cache, tok, _ = _inputs(spec, 2, seed=4)
    pos = jnp.array([0, 4], jnp.int32)
    _, _, new = reference.decode_step(weights, cache, tok, pos)
    lat = np.asarray(new["mla_latent"], np.float32)
    assert np.abs(lat[0, 0, 0]).sum() > 0 and np.abs(lat[0, 1, 4]).sum() > 0
    assert np.abs(lat[0, 0, 1:]).sum() == 0 and np.abs(lat[0, 1, :4]).sum() == 0
    assert np.abs(np.asarray(new["kda_state"])).sum() > 0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_delta_rule_writes_value_at_key(seed):
    """With beta = 1 and no decay, reading the new state at a unit key returns its value."""
    r = np.random.default_rng(seed)
    s = jnp.asarray(r.standard_normal((2, 3, 8, 5)), jnp.float32)
    k = reference.l2_normalize(jnp.asarray(r.standard_normal((2, 3, 8)), jnp.float32))
    v = jnp.asarray(r.standard_normal((2, 3, 5)), jnp.float32)
    o, _ = reference.delta_rule(s, k, k, v, jnp.ones((2, 3, 8)), jnp.ones((2, 3)))
    np.testing.assert_allclose(o, v, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_router_picks_top_k_with_bias(seed):
    r = np.random.default_rng(seed)
    logits = jnp.asarray(r.standard_normal((4, 16)), jnp.float32)
    bias = jnp.asarray(r.standard_normal(16), jnp.float32)
    comb, ids = reference.route(logits, bias, 4)
    assert ((np.asarray(comb) > 0).sum(axis=1) == 4).all()
    np.testing.assert_allclose(np.asarray(comb).sum(axis=1), 1.0, rtol=1e-5)
    sel = np.asarray(jax.nn.sigmoid(logits) + bias)
    for b in range(4):
        assert set(np.asarray(ids[b])) == set(np.argsort(-sel[b], kind="stable")[:4])
        w = np.asarray(jax.nn.sigmoid(logits[b]))[np.asarray(ids[b])]
        np.testing.assert_allclose(np.asarray(comb[b])[np.asarray(ids[b])], w / w.sum(),
                                   rtol=1e-5)


def test_router_margin_is_the_gap_below_the_last_pick():
    """The smallest over rows of (k-th - (k+1)-th) biased score; the row where the last pick and
    the first one left out are nearly tied sets it."""
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0], [3.0, 0.5, 0.49, -2.0]], jnp.float32)
    bias = jnp.zeros(4, jnp.float32)
    s = np.asarray(jax.nn.sigmoid(logits))
    want = min(s[0, 1] - s[0, 2], s[1, 1] - s[1, 2])
    np.testing.assert_allclose(float(reference.router_margin(logits, bias, 2)), want, rtol=1e-6)
    assert float(reference.router_margin(logits, bias, 2)) < 0.003   # row 1: 0.5 against 0.49


def test_router_margins_one_per_moe_layer(spec, weights):
    cache = reference.init_cache(spec, 2, 32)
    tok, pos = jnp.arange(2, dtype=jnp.int32), jnp.full((2,), 3, jnp.int32)
    m = np.asarray(reference.router_margins(weights, cache, tok, pos))
    assert m.shape == (spec.count(ffn="moe"),) and (m >= 0).all() and (m < 1).all()
    # the cache is not donated: decode_step on a copy, then router_margins on it again, the same
    t1, _, _ = reference.decode_step(weights, {k: v.copy() for k, v in cache.items()}, tok, pos)
    m2 = np.asarray(reference.router_margins(weights, cache, tok, pos))
    np.testing.assert_array_equal(m, m2)
    assert t1.shape == (2,)


def test_every_op_is_in_one_named_scope(spec, weights):
    cache, tok, pos = _inputs(spec, 2)
    acc = jnp.ones_like(pos)
    hlo = reference._decode_step_jit.lower(weights, cache, tok, pos, acc, rows=1,
                                           mla_form="absorbed").compile().as_text()
    prefix = "jit(_decode_step_jit)/"
    names = [n for n in re.findall(r'op_name="([^"]*)"', hlo) if n.startswith(prefix)]
    scope = re.compile(r"^(embed|head|layer_\d\d/(attention|ffn|moe))(/|$)")
    args = ("weights", "cache", "tokens", "positions", "accepted")
    bad = [n for n in names if not scope.match(n[len(prefix):])
           and not n[len(prefix):].startswith(args)]
    assert not bad, collections.Counter(bad).most_common(5)
    seen = {m.group(1) for n in names if (m := scope.match(n[len(prefix):]))}
    want = {"embed", "head"} | {f"layer_{l.index:02d}/{'ffn' if l.ffn == 'dense' else 'moe'}"
                                for l in spec.layers} \
        | {f"layer_{l.index:02d}/attention" for l in spec.layers}
    assert want <= seen
    assert any("/moe/router/" in n for n in names) and any("/moe/experts/" in n for n in names)


def test_bad_inputs(spec, weights):
    cache, tok, pos = _inputs(spec, 2)
    with pytest.raises(SpecError, match="tokens.shape"):
        reference.decode_step(weights, cache, tok[:1], pos)
    with pytest.raises(SpecError, match="mla_form"):
        reference.decode_step(weights, cache, tok, pos, mla_form="rope")
    with pytest.raises(SpecError, match="rows"):
        reference.decode_step(weights, cache, jnp.zeros((2, 9), jnp.int32), pos)
    with pytest.raises(SpecError, match="accepted"):
        reference.decode_step(weights, cache, jnp.zeros((2, 3), jnp.int32), pos, [1, 4])
    with pytest.raises(SpecError, match="batch"):
        reference.init_cache(spec, 0, 16)


@pytest.mark.slow
def test_derived_spec_runs_in_f32():
    """Any size derived from the kimi-k3 preset (widths not multiples of 128), f32 weights."""
    spec = derive("kimi-k3", **ODD_SIZED)
    w = reference.init_weights(spec, seed=1, dtype=jnp.float32)
    cache, tok, pos = _inputs(spec, 3)
    c2 = jax.tree.map(jnp.copy, cache)
    nxt, logits, cache = reference.decode_step(w, cache, tok, pos)
    assert logits.shape == (3, spec.vocab) and np.isfinite(np.asarray(logits)).all()
    assert cache["mla_latent"].shape == (2, 3, 16, 192)
    _, l2, _ = reference.decode_step_op_by_op(w, c2, tok, pos, mla_form="plain")
    np.testing.assert_allclose(l2, logits, atol=1e-4, rtol=1e-4)


def test_derived_spec_overrides_and_errors():
    spec = derive("kimi-k3", hidden=512, moe={"experts": 64})
    assert spec.hidden == 512 and spec.moe.experts == 64 and spec.moe.top_k == 16
    with pytest.raises(SpecError, match="model"):
        derive("no-such-preset")
    with pytest.raises(SpecError, match="gqa"):
        reference.init_weights(derive("llama-3.2-1b"), 0)


def test_verify_block_equals_sequential_steps(spec, weights):
    """A verify block of 4 rows (causal within the block) gives each row the logits of decoding
    the rows one step at a time, and leaves the caches of the first `accepted` steps (rows past
    it change nothing). Same engine both ways; only XLA's summation order per shape differs, so
    the bf16 tolerances of the kernel tests apply."""
    batch, rows, accepted = 3, 4, np.array([2, 0, 4])
    cache, _, pos = _inputs(spec, batch, seed=4)
    block = jnp.asarray(np.random.default_rng(4).integers(0, spec.vocab, (batch, rows)),
                        jnp.int32)
    nxt, logits, after = reference.decode_step(weights, jax.tree.map(jnp.copy, cache), block,
                                               pos, accepted)
    assert nxt.shape == (batch, rows) and logits.shape == (batch, rows, spec.vocab)
    seq, kept = jax.tree.map(jnp.copy, cache), {}
    for r in range(rows):
        _, l1, seq = reference.decode_step(weights, seq, block[:, r], pos + r)
        np.testing.assert_allclose(logits[:, r], l1, atol=5e-2, rtol=2e-2)
        for b in np.flatnonzero(accepted == r + 1):
            kept[b] = jax.tree.map(lambda c: np.asarray(c[:, b], np.float32), seq)
    for b in range(batch):
        want = kept.get(b, jax.tree.map(lambda c: np.asarray(c[:, b], np.float32), cache))
        for name, c in after.items():
            np.testing.assert_allclose(np.asarray(c[:, b], np.float32), want[name],
                                       atol=5e-2, rtol=2e-2, err_msg=f"{name} seq {b}")
    # rows past `accepted` leave the MLA cache bit-identical to its old contents
    lat = np.asarray(after["mla_latent"], np.float32)
    for b in range(batch):
        np.testing.assert_array_equal(lat[:, b, int(pos[b]) + accepted[b]:],
                                      np.asarray(cache["mla_latent"][:, b, int(pos[b]) +
                                                                     accepted[b]:], np.float32))
    one = reference.decode_step_op_by_op(weights, jax.tree.map(jnp.copy, cache), block, pos,
                                         accepted)
    np.testing.assert_allclose(one[1], logits, atol=1e-4, rtol=1e-4)
