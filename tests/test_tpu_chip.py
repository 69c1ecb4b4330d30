"""On a real TPU (`pytest -m tpu`, run through the device machine; skipped without a chip): the
megakernel compiles with Mosaic for the attached chip and its greedy tokens equal the pure-JAX
reference's on the same chip and weights, for MINI in each routed-expert format the chip feeds,
at batch 1 and 8; the Kimi K3 TP32-core slice at batch 1. As in tests/test_megakernel.py (whose
tolerance analysis holds here too), tokens must agree wherever the reference's top-2 logit
margin exceeds `MARGIN`: below it a bf16 rounding flip may pick the other token."""
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from perfmodel_kernels import layout, megakernel, quant, reference, tuned
from perfmodel_kernels.specs import slice_spec

MARGIN = 0.1

pytestmark = [pytest.mark.tpu,
              pytest.mark.skipif(not pltpu.is_tpu_device(), reason="no TPU attached")]


def greedy_both(spec, cfg, steps=3):
    """(kernel tokens, reference tokens, whether the reference's top-2 margin is clear) over
    `steps` greedy steps, teacher-forced by the reference; the reference runs the dequantised
    experts."""
    w = reference.init_weights(spec, 0)
    packed = layout.pack_weights(w, cfg)
    fmt = spec.formats["routed_expert"].name
    ref_w = w if fmt == "bf16" else quant.dequantized_weights(w, fmt, cfg.tile)
    step = megakernel.make_step(spec, cfg)
    kc = reference.init_cache(spec, cfg.batch, cfg.max_context)
    rc = reference.init_cache(spec, cfg.batch, cfg.max_context)
    tok = jnp.arange(cfg.batch, dtype=jnp.int32)
    pos = jnp.full((cfg.batch,), 5, jnp.int32)
    ks, rs, clear = [], [], []
    for _ in range(steps):
        kt, _, kc, _ = step(packed, kc, tok, pos)
        rt, rlog, rc = reference.decode_step(ref_w, rc, tok, pos)
        top2 = np.sort(np.asarray(rlog), axis=-1)[..., -2:]
        ks.append(np.asarray(kt))
        rs.append(np.asarray(rt))
        clear.append(top2[..., 1] - top2[..., 0] > MARGIN)
        tok, pos = rt, pos + 1
    return np.stack(ks), np.stack(rs), np.stack(clear)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_mini_tokens_equal_the_reference_on_the_chip(fmt, batch):
    spec = slice_spec("kimi-k3-mini", fmt)
    cfg = layout.KernelConfig(batch=batch, max_context=64, depth=4, cache_block=16,
                              bank_rows=1024)
    k, r, clear = greedy_both(spec, cfg)
    assert clear.mean() > 0.5 and (k == r)[clear].all()


def test_kimi_k3_slice_tokens_equal_the_reference_on_the_chip():
    spec = slice_spec("k3-tp32-core", "mxfp4")
    t = tuned.tuned("kimi-k3-tp32-core", 1)  # the ring the slice runs with on one chip
    cfg = layout.KernelConfig(batch=1, max_context=512, depth=t.depth, expert_slots=t.expert_slots,
                              cache_block=256, bank_rows=t.bank_rows)
    k, r, clear = greedy_both(spec, cfg, steps=2)
    assert (k == r)[clear].all()


@pytest.mark.parametrize("fmt", ["int4", "int8", "mxfp4"])
def test_k3_expert_columns_packed_on_the_chip_equal_their_dequantised_product(fmt):
    """The kernel's expert column path at the TP32-core widths (6-28 row tiles a column), the
    weights quantised and packed on the chip: on the v5e int4 was 2 % off when XLA there took
    the codes from the unrounded group scale (experiments/tpu_decode_probe.py)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import tpu_decode_probe
    recs = tpu_decode_probe.probe(fmt, "k3-tp32-core", interpret=False)
    assert max(r["error"] for r in recs) < 1e-5
