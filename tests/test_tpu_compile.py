"""The megakernel compiled for a TPU v5e by libtpu's own compiler (Mosaic) on a machine without
a chip (`perfmodel_kernels.aot`): what interpret mode cannot show, tile-aligned offsets, layouts, the
dtypes the chip's MXU and vector unit take. Marked `aot`: it needs the libtpu package (the
oldest-JAX CI job installs it); without it the tests skip, and under CI=true in that job a skip
fails the run."""
import pytest

from perfmodel_kernels import aot, layout, quant
from perfmodel_kernels.specs import slice_spec

pytestmark = [pytest.mark.aot,
              pytest.mark.skipif(not aot.available(), reason="libtpu is not installed")]


@pytest.mark.parametrize("fmt", ("bf16",) + quant.QUANTISED)
@pytest.mark.parametrize("batch,rows", [(1, 1), (8, 1), (2, 4)])
def test_mini_compiles_for_v5e(fmt, batch, rows):
    spec = slice_spec("kimi-k3-mini", fmt)
    cfg = layout.KernelConfig(batch=batch, rows=rows, max_context=256, depth=4, bank_rows=1024,
                              expert_slots=2, cache_block=128, chip="v5e")
    out = aot.compile_kernel(spec, cfg)
    assert out["compile_s"] > 0 and out["vmem_bytes"] > 0


@pytest.mark.parametrize("name,fmt", [("k3-tp32-core", "mxfp4"), ("k3-tp8-core", "int4")])
def test_kimi_k3_slices_compile_for_v5e(name, fmt):
    cfg = layout.KernelConfig(batch=8, max_context=2048, depth=8, expert_slots=2,
                              cache_block=256, bank_rows=8192, chip="v5e")
    assert aot.compile_kernel(slice_spec(name, fmt), cfg)["compile_s"] > 0


def test_a_misaligned_copy_is_refused_as_mosaic_would():
    """The check has teeth: a ring bank copy whose first row Mosaic cannot prove tile-aligned
    (the stream offset hint removed) is refused with Mosaic's own message."""
    from perfmodel_kernels import ring
    spec = slice_spec("kimi-k3-mini")
    cfg = layout.KernelConfig(batch=1, max_context=256, depth=4, bank_rows=1024,
                              cache_block=128, chip="v5e")
    saved = ring.ROW_TILE
    ring.ROW_TILE = 1   # pl.multiple_of(row0, 1): no alignment promised
    try:
        with pytest.raises(aot.MosaicRefusal, match="aligned"):
            aot.compile_kernel(spec, cfg)
    finally:
        ring.ROW_TILE = saved
