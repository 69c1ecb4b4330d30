"""experiments/tpu_decode_probe.py in interpret mode on the CPU: the kernel's expert column path
at a K3 slice's widths equals numpy's product with the dequantised weights, and the script
refuses what it cannot probe. (Its chip run is in tests/test_tpu_chip.py.)"""
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
