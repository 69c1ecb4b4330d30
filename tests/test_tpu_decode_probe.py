"""experiments/tpu_decode_probe.py in interpret mode on the CPU: the kernel's expert column path
at a K3 slice's widths equals numpy's product with the dequantised weights, packed int4 experts
read back equal the reference's, and the script refuses what it cannot probe. (Its chip run is
in tests/test_tpu_chip.py.)"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import tpu_decode_probe  # noqa: E402

from perfmodel_kernels import quant  # noqa: E402


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_expert_columns_at_k3_widths_equal_numpy(fmt):
    recs = tpu_decode_probe.probe(fmt, "k3-tp32-core", interpret=True)
    assert {r["matrix"] for r in recs} == {0, 1} and {r["turn"] for r in recs} == {0, 1}
    assert max(r["tiles"][0] for r in recs) == 28     # the loop over whole scale chunks ran
    assert max(r["error"] for r in recs) < 1e-5 and not any(r["bad_columns"] for r in recs)


def test_probe_refuses_a_dense_slice_and_an_unknown_format(capsys):
    with pytest.raises(SystemExit):
        tpu_decode_probe.main(["--interpret", "--slices", "k3-tp8-dense"])
    assert "'k3-tp8-dense' is not a MoE slice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu_decode_probe.main(["--interpret", "--formats", "fp4"])
    assert "unknown format 'fp4'" in capsys.readouterr().err


def test_int4_codes_come_from_the_stored_bf16_scale():
    """The codes are taken from the scale as stored (bf16), by an explicit reduce_precision that
    XLA cannot elide as excess precision (a plain cast was, on the TPU v5e); on the CPU: every
    code equals rint(w / stored scale)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (256, 128), jnp.float32) * 0.02
    assert "reduce_precision" in str(jax.make_jaxpr(
        lambda w: quant.quantize_jax(w, "int4", 128))(w))
    codes, s, _ = quant.quantize_jax(w, "int4", 128)
    scale = np.repeat(np.asarray(s, np.float32), 32, axis=0)
    want = np.clip(np.rint(np.asarray(w) / scale), -8, 7).astype(np.int32) & 0xF
    np.testing.assert_array_equal(np.asarray(codes), want)


def test_unpacked_int4_inverts_the_kernels_packing():
    """`unpacked_int4` reads matrix m of packed int4 experts back as the weights they stand for:
    equal to the reference's dequantised values at a K3 slice's expert shapes (two experts, both
    matrices), and off once one code byte is changed (so --slice-weights can find a packing
    fault)."""
    mats = tpu_decode_probe.matrices("k3-tp32-core")
    lay = quant.expert_layout("int4", tpu_decode_probe.T, mats, fp8=False)
    ws = [jax.random.normal(jax.random.PRNGKey(i), (2, d_in, d_out), jnp.float32) * 0.02
          for i, (d_in, d_out) in enumerate(mats)]
    codes, scales, _ = quant.pack_experts(lay, ws)
    for m, ((d_in, d_out), w) in enumerate(zip(mats, ws)):
        got = tpu_decode_probe.unpacked_int4(lay, codes, scales, m, d_in, d_out)
        want = np.asarray(quant.round_trip_jax(w, "int4", tpu_decode_probe.T))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    bad = codes.at[1, lay.first_tile(1) * lay.fmt.code_rows, 0].add(1)
    got = tpu_decode_probe.unpacked_int4(lay, bad, scales, 1, *mats[1])
    assert not np.allclose(got, np.asarray(quant.round_trip_jax(ws[1], "int4", tpu_decode_probe.T)))


def test_slice_weights_refuses_other_formats():
    with pytest.raises(ValueError, match="int4 only"):
        tpu_decode_probe.slice_weights("k3-tp32-core", "mxfp4")
