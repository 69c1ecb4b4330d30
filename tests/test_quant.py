"""Quantised routed experts: codes and scales, in-kernel tile dequantisation, the kernel against
the reference on the same dequantised weights, plan bytes, and the TPU7x lowering.

Tolerances per format. The reference multiplies with exactly the bf16 values the kernel's
dequantisation produces (same codes, code * scale in f32 rounded to bf16), so kernel vs
reference uses the bf16 tolerances of tests/test_megakernel.py for every format. The
quantisation error itself (dequantised vs original weights, relative to the largest |w| of the
group) is bounded by: int8 1/254 (half a step), fp8 e4m3 2^-4 of the value (3 mantissa bits),
int4 1/14 (half a step; x 1.01 for the bf16-rounded scale of group 32, x 1.0001 for the f32
scale of group 128), MXFP4 1/3 of the group maximum
(the scale 2^k puts the maximum in [4, 8) units; values above 6 clip to 6, and the e2m1 step
between 4 and 6 is 2).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import layout, megakernel, plan, quant, reference
from perfmodel.graph import ops
from perfmodel.spec.arch import derive
from perfmodel.spec.deployment import Deployment

BOUND = {"int8": 1 / 254, "fp8": 1 / 16, "int4": 1.01 / 14, "int4-g128-f32": 1.0001 / 14,
         "mxfp4": 1 / 3}


@pytest.mark.parametrize("name", quant.QUANTISED)
def test_quantisation_error_and_tile_dequantisation(name):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32) * 0.05
    codes, scales = quant.quantize(w, name, 256)
    deq = quant.dequantize(codes, scales, name, 256)
    g = quant.tile_format(name, 256).group
    g = w.shape[0] if g >= 256 else g
    for r0 in range(0, 300, g):
        block, err = w[r0:r0 + g], np.abs(deq - w)[r0:r0 + g]
        ref = np.abs(block) if name == "fp8" else np.abs(block).max(axis=0)
        assert (err <= BOUND[name] * ref + 1e-7).all(), name
    tiles = quant.tile_codes(codes, name, 256)
    tscales = quant.tile_scales(scales, name, 256, 200)
    want = jnp.asarray(deq, jnp.bfloat16)
    for k in range(tiles.shape[0]):  # column block 0; row tiles 0, 1
        got = quant.dequantize_tile(jnp.asarray(tiles[k]), jnp.asarray(tscales[k]), name)
        rows = want[k * 256:(k + 1) * 256, :200]
        np.testing.assert_array_equal(np.asarray(got)[:rows.shape[0], :200], np.asarray(rows))


def _mini(name):
    return derive("kimi-k3-mini", formats={"routed_expert": name})


@pytest.mark.parametrize("name", [
    "mxfp4", pytest.param("int8", marks=pytest.mark.slow),
    pytest.param("fp8", marks=pytest.mark.slow), pytest.param("int4", marks=pytest.mark.slow),
    pytest.param("int4-g128-f32", marks=pytest.mark.slow)])
def test_quantised_kernel_matches_reference(name):
    from test_megakernel import run_both
    spec = _mini(name)
    w = reference.init_weights(spec, 0)
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, expert_slots=2, cache_block=8)
    run_both(spec, w, cfg, steps=1, reference_weights=quant.dequantized_weights(w, name))


@pytest.mark.parametrize("name", ["mxfp4", "int4-g128-f32"])
def test_4bit_plan_bytes_equal_the_model(name):
    """Codes (4 bits) + e8m0 scales per 32 (MXFP4) or f32 scales per 128 (int4 group 128) are
    exactly the format's 4.25 bits a value: with expert widths that fill whole tiles the routed
    bytes equal the analytic model's."""
    spec = derive("kimi-k3-mini", formats={"routed_expert": name},
                  moe={"expert_width": 256, "latent_dim": 256})
    assert quant.tile_format(name, 256).group == {"mxfp4": 32, "int4-g128-f32": 128}[name]
    cfg = layout.KernelConfig(batch=4, max_context=64, depth=6, cache_block=16)
    g = ops.build(spec, Deployment(devices=1, tp=1, batch=4, context=48))
    distinct = [round(g.distinct_experts)] * spec.count(ffn="moe")
    p = plan.dma_plan(spec, cfg, distinct, [48] * 4)
    routed = sum(c.bytes for c in p if c.routed)
    assert routed == sum(distinct) * sum(mm.params // mm.experts
                                         for mm in layout.expert_matmuls(spec)) * 17 // 32
    assert plan.overhead_bytes(spec, cfg, distinct)["tile_padding"] == sum(
        tm.tiles * cfg.bank_bytes - 2 * tm.mm.params for tm in layout.static_stream(spec, cfg))


@pytest.mark.parametrize("name", ["mxfp4", "int4-g128-f32"])
def test_quantised_kernel_lowers_to_mosaic(name):
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    spec = _mini(name)
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, cache_block=8)
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=tpu)):
        exported = export.export(jax.jit(megakernel.build_call(spec, cfg)), platforms=["tpu"])(
            *megakernel.call_args(spec, cfg))
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert math.prod(megakernel.call_args(spec, cfg)[7].shape[-2:]) == 128 * 256  # packed codes
