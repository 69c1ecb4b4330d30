"""Quantised routed experts: codes and scales, the MXU feed of each format (4-bit codes as fp8
against a block-diagonal LHS), the kernel against the reference, plan bytes, and the TPU7x
lowering.

Tolerances per format. The kernel multiplies the exact code values (as bf16 or fp8) and applies
the f32 scales to the partial sums; the reference multiplies with code * scale rounded once to
bf16. For mxfp4 and nvfp4 the two are the same numbers (e2m1 x a power of two, and e2m1 x
e4m3 x the f32 global scale, have at most 6 significant bits); for int4 group 32 (bf16 scales)
and int4 group 128 (f32 scales), int8 and fp8 the bf16 rounding differs by at most 2^-9 of
each weight, far below the bf16 tolerances of tests/test_megakernel.py, which are used for
every format. The quantisation error itself (dequantised vs original weights, relative to
the largest |w| of the group) is bounded by: int8 1/254 (half a step), fp8 e4m3 2^-4 of the
value (3 mantissa bits), int4 1/14 (half a step; x 1.01 for the bf16-rounded scale of group
32, x 1.0001 for the f32 scale of group 128), MXFP4 1/3 of the group maximum (the scale 2^k
puts the maximum in [4, 8) units; values above 6 clip to 6, and the e2m1 step between 4 and 6
is 2), NVFP4 1/6 x (1 + 2^-3) (half the largest e2m1 step with the maximum at 6 units, the
e4m3 block scale rounded to 3 mantissa bits).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel_kernels import chip, layout, megakernel, plan, quant, reference
from perfmodel.graph import ops
from perfmodel.spec.arch import derive
from perfmodel.spec.deployment import Deployment

BOUND = {"int8": 1 / 254, "fp8": 1 / 16, "int4": 1.01 / 14, "int4-g128-f32": 1.0001 / 14,
         "mxfp4": 1 / 3, "nvfp4": 1.125 / 6}


@pytest.mark.parametrize("name", quant.QUANTISED)
def test_quantisation_error(name):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32) * 0.05
    codes, scales, glob = quant.quantize(w, name, 256)
    deq = quant.dequantize(codes, scales, name, 256, glob)
    g = quant.tile_format(name, 256).group
    g = w.shape[0] if g >= 256 else g
    for r0 in range(0, 300, g):
        block, err = w[r0:r0 + g], np.abs(deq - w)[r0:r0 + g]
        ref = np.abs(block) if name == "fp8" else np.abs(block).max(axis=0)
        assert (err <= BOUND[name] * ref + 1e-7).all(), name


@pytest.mark.parametrize("name", ("bf16",) + quant.QUANTISED)
def test_tiles_fed_to_the_mxu_give_the_dequantised_product(name):
    """Through the expert layout (codes, aligned scale chunks, one block or two) and the MXU feed
    (`mxu_operand`, `group_dot`), x @ each matrix equals x @ the dequantised matrix (the
    reference's weights before their bf16 rounding) up to the bf16 rounding of x; 4-bit formats
    reach the MXU as fp8 (on TPU7x), int8 as bf16."""
    rng = np.random.default_rng(2)
    mats = [rng.standard_normal((300, 200)).astype(np.float32) * 0.05,
            rng.standard_normal((100, 300)).astype(np.float32) * 0.05]
    lay = quant.expert_layout(name, 256, [m.shape for m in mats])
    f = lay.fmt
    codes, scales, globs = quant.pack_expert(lay, mats)
    assert lay.copies() == (1 if name in ("bf16", "mxfp4", "nvfp4") else 2)
    assert (scales is None) == (lay.copies() == 1)
    src = codes[lay.code_rows:] if f.combined else scales
    want_dtype = jnp.bfloat16 if name in ("bf16", "int8") else jnp.float8_e4m3fn
    for m, (w, (r, c)) in enumerate(zip(mats, lay.shapes)):
        x = rng.standard_normal((8, w.shape[0])).astype(np.float32)
        xp = np.zeros((8, r * 256), np.float32)
        xp[:, :w.shape[0]] = x
        out = np.zeros((8, c * 256))
        k0 = lay.first_tile(m)
        for k in range(r * c):
            j, i = divmod(k, r)
            op = quant.mxu_operand(jnp.asarray(codes[(k0 + k) * f.code_rows:
                                                     (k0 + k + 1) * f.code_rows]), f)
            assert op.dtype == want_dtype
            sc = None
            if f.scale_rows:
                q, u = divmod(k, f.chunk)
                base, sub = lay.scale_first_row(m), f.chunk * f.scale_rows
                chunk = src[base + q * sub:base + (q + 1) * sub]
                assert chunk.shape[0] % chip.tile_rows(chunk.dtype) == 0
                sc = quant.tile_scales(jnp.asarray(chunk), u, f)
            out[:, j * 256:(j + 1) * 256] += np.asarray(quant.group_dot(
                jnp.asarray(xp[:, i * 256:(i + 1) * 256]), op, sc, f))
        got = out[:, :w.shape[1]] * globs[m]
        want = x @ (w if name == "bf16" else quant.round_trip(w, name, 256))
        # x rounded to bf16 (2^-9 relative) over 300 terms of |x w| ~ 0.05
        np.testing.assert_allclose(got, want, atol=0.02, rtol=0.01)


def _mini(name):
    return derive("kimi-k3-mini", formats={"routed_expert": name})


@pytest.mark.parametrize("name,target", [
    ("mxfp4", "7x"), ("mxfp4", "v5e"), pytest.param("nvfp4", "7x", marks=pytest.mark.slow),
    pytest.param("int4-g128-f32", "7x", marks=pytest.mark.slow),
    pytest.param("int8", "7x", marks=pytest.mark.slow), pytest.param("fp8", "7x", marks=pytest.mark.slow),
    pytest.param("int4", "7x", marks=pytest.mark.slow)])
def test_quantised_kernel_matches_reference(name, target):
    """On the TPU7x's shapes (fp8 feeds) and, for mxfp4, the v5e's (128-wide tiles, the
    experts built as bf16 words: `TileFormat.word_decode`)."""
    from test_megakernel import run_both
    spec = _mini(name)
    w = reference.init_weights(spec, 0)
    t = chip.chip(target).mxu
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, expert_slots=2, cache_block=16,
                              bank_rows=256 * 256 // t, tile=t, chip=target)
    run_both(spec, w, cfg, steps=1, reference_weights=quant.dequantized_weights(w, name))


@pytest.mark.parametrize("name", ["mxfp4", "int4-g128-f32", "nvfp4"])
def test_4bit_experts_reach_the_mxu_as_fp8(name):
    """In the kernel's jaxpr the experts' dots take an fp8 weight operand and a bf16 LHS of
    G x 8 rows (the block-diagonal input, G = 256 / group); no expert dot is bf16 x bf16."""
    spec = _mini(name)
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, cache_block=16, bank_rows=256)
    closed = jax.make_jaxpr(megakernel.build_call(spec, cfg))(*megakernel.call_args(spec, cfg))
    dots = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                dots.append(tuple((v.aval.dtype, v.aval.shape) for v in e.invars))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)
    walk(closed.jaxpr)
    fp8 = [d for d in dots if d[1][0] == jnp.float8_e4m3fn]
    g = 256 // quant.tile_format(name, 256).group
    assert fp8 and all(lhs == (jnp.bfloat16, (g * 8, 256)) for lhs, _ in fp8)
    lay = layout.expert_layout(spec, cfg)
    traced = sum((lay.fmt.chunk if r * c >= lay.fmt.chunk else 0) + r * c % lay.fmt.chunk
                 for r, c in lay.shapes)   # a chunk's tiles unrolled, each traced once
    assert len(fp8) == traced


@pytest.mark.parametrize("name", ["mxfp4", "int4-g128-f32"])
def test_4bit_plan_bytes_equal_the_model(name):
    """Codes (4 bits) + e8m0 scales per 32 (MXFP4) or f32 scales per 128 (int4 group 128) are
    exactly the format's 4.25 bits a value: with expert widths that fill whole tiles, the routed
    bytes less their zero scale rows equal the analytic model's."""
    spec = derive("kimi-k3-mini", formats={"routed_expert": name},
                  moe={"expert_width": 256, "latent_dim": 256})
    cfg = layout.KernelConfig(batch=4, max_context=64, depth=6, cache_block=16, bank_rows=256)
    g = ops.build(spec, Deployment(devices=1, tp=1, batch=4, context=48))
    distinct = [round(g.distinct_experts)] * spec.count(ffn="moe")
    p = plan.dma_plan(spec, cfg, distinct, [48] * 4)
    routed = [c for c in p if c.routed]
    per_expert = sum(mm.params // mm.experts for mm in layout.expert_matmuls(spec))
    assert sum(c.bytes - c.padding for c in routed) == sum(distinct) * per_expert * 17 // 32
    assert len(routed) == sum(distinct) * layout.expert_layout(spec, cfg).copies()


@pytest.mark.parametrize("name", ["mxfp4", "int4-g128-f32", "nvfp4"])
def test_quantised_kernel_lowers_to_mosaic(name):
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    spec = _mini(name)
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, cache_block=16, bank_rows=256)
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=tpu)):
        exported = export.export(jax.jit(megakernel.build_call(spec, cfg)), platforms=["tpu"])(
            *megakernel.call_args(spec, cfg))
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert layout.expert_layout(spec, cfg).fmt.code_rows == 128   # two 4-bit codes a byte


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "int4", "int8"])
def test_tiles_decoded_for_a_bf16_feed_are_the_dequantised_weights(name):
    """On a chip whose MXU takes no fp8 (the v5e: 128-wide tiles), each tile the kernel decodes
    (`decoded_tile`: mxfp4 built as bf16 bit patterns two a word, `word_decode`; the others in
    f32) equals the dequantised weights rounded to bf16, zeros and signs included, bit for bit
    for the e2m1 formats (every scaled value exact in bf16)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((260, 140)).astype(np.float32) * np.float32(0.03)
    w[rng.random(w.shape) < 0.1] = 0.0
    w[:32, :7] *= 1e4                     # groups whose scales sit far apart
    lay = quant.expert_layout(name, 128, [w.shape], fp8=False)
    f = lay.fmt
    assert f.word_decode == (name == "mxfp4") and lay.decodes
    codes, scales, globs = quant.pack_expert(lay, [w])
    src = codes[lay.code_rows:] if f.combined else scales
    (r, c), sub = lay.shapes[0], f.chunk * f.scale_rows
    want = np.zeros((r * 128, c * 128), np.float32)
    want[:260, :140] = quant.round_trip(w, name, 128) / globs[0]
    decode = jax.jit(quant.decoded_tile, static_argnums=(2, 3))   # pltpu.bitcast: traced only
    for k in range(r * c):
        j, i = divmod(k, r)
        q, u = divmod(k, f.chunk)
        got = decode(jnp.asarray(codes[k * f.code_rows:(k + 1) * f.code_rows]),
                                 jnp.asarray(src[q * sub:(q + 1) * sub]), u, f)
        assert got.dtype == jnp.bfloat16
        tile = want[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(jnp.bfloat16)
        if name in quant.E2M1_FORMATS:
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16) & 0x7FFF,
                                          np.asarray(tile).view(np.uint16) & 0x7FFF)
            nz = np.asarray(tile, np.float32) != 0
            assert (np.signbit(np.asarray(got, np.float32)) == np.signbit(tile.astype(np.float32)))[nz].all()
        else:
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(tile, np.float32),
                                       rtol=2 ** -8, atol=0)
