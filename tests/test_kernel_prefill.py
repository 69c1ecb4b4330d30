"""The reference prefill (perfmodel_kernels.prefill): a prompt in one program gives the logits and caches
of feeding it token by token to the reference decode step, so decoding continues alike."""
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel_kernels import reference as R
from perfmodel_kernels.prefill import mla_form, prefill_step
from perfmodel.spec.arch import derive
from perfmodel.util.errors import SpecError


def sequential(weights, tokens, t_max):
    cache = R.init_cache(weights.spec, tokens.shape[0], t_max)
    for t in range(tokens.shape[1]):
        nxt, logits, cache = R.decode_step(weights, cache, tokens[:, t], jnp.full((tokens.shape[0],), t, jnp.int32))
    return nxt, logits, cache


@pytest.mark.parametrize("prompt", [1, 3, 7])
def test_prefill_equals_decoding_the_prompt(spec, prompt):
    """f32 weights; both paths round the conv window and latents to the cache format alike, so
    they differ by f32 summation order only (up to 2e-4 on logits of order 1 with JAX 0.10's
    CPU kernels, 1e-5 with JAX 0.12's)."""
    weights = R.init_weights(spec, seed=1, dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab, (2, prompt)), jnp.int32)
    t_max = prompt + 2
    nxt_s, logits_s, cache_s = sequential(weights, tokens, t_max)
    nxt_p, logits_p, cache_p = prefill_step(weights, tokens, t_max)
    np.testing.assert_allclose(logits_p, logits_s, rtol=1e-3, atol=1e-3)
    assert (nxt_p == nxt_s).all()
    for k in cache_s:
        np.testing.assert_allclose(np.asarray(cache_p[k], np.float32), np.asarray(cache_s[k], np.float32),
                                   rtol=2e-2, atol=2e-3)  # bf16 caches: one rounding of values of order 1
    pos = jnp.full((2,), prompt, jnp.int32)
    _, after_s, _ = R.decode_step(weights, cache_s, nxt_s, pos)
    _, after_p, _ = R.decode_step(weights, cache_p, nxt_p, pos)
    np.testing.assert_allclose(after_p, after_s, rtol=1e-3, atol=1e-3)


def test_both_mla_forms_agree(spec):
    """The absorbed and plain forms are the same attention (kv_b applied before or after)."""
    from perfmodel_kernels.prefill import _prefill_jit
    weights = R.init_weights(spec, seed=2, dtype=jnp.float32)
    tokens = jnp.arange(8, dtype=jnp.int32).reshape(1, 8) % spec.vocab
    a = _prefill_jit(weights, tokens, max_context=8, form="absorbed")[1]
    b = _prefill_jit(weights, tokens, max_context=8, form="plain")[1]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_mla_form_follows_the_flops():
    small = derive("kimi-k3-mini", mla={"kv_lora_rank": 64})
    wide = derive("kimi-k3-mini", mla={"kv_lora_rank": 1024})
    assert mla_form(wide, 256) == "plain" and mla_form(small, 256) == "absorbed"


def test_bad_prompts(spec, weights):
    with pytest.raises(SpecError, match="tokens.shape"):
        prefill_step(weights, jnp.zeros((3,), jnp.int32), 8)
    with pytest.raises(SpecError, match="max_context"):
        prefill_step(weights, jnp.zeros((1, 9), jnp.int32), 8)
