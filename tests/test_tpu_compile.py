"""The megakernel compiled for a TPU v5e by libtpu's own compiler (Mosaic) on a machine without
a chip (`perfmodel_kernels.aot`): what interpret mode cannot show, tile-aligned offsets, layouts, the
dtypes the chip's MXU and vector unit take. Marked `aot`: it needs the libtpu package (the
oldest-JAX CI job installs it); without it the tests skip, and under CI=true in that job a skip
fails the run."""
import re

import jax
import pytest
from jax.sharding import SingleDeviceSharding

from perfmodel_kernels import aot, layout, megakernel, quant, tuned
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
    """Both K3 slices at batch 8 with the ring each runs with on one chip (tuned.py)."""
    spec = slice_spec(name, fmt)
    t = tuned.tuned(spec.name, 1)
    cfg = layout.KernelConfig(batch=8, max_context=2048, depth=t.depth, expert_slots=t.expert_slots,
                              cache_block=256, bank_rows=t.bank_rows, chip="v5e")
    assert aot.compile_kernel(spec, cfg)["compile_s"] > 0


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


def test_embedding_table_reaches_the_kernel_without_a_relayout():
    """The table is a 2-D bf16 operand that XLA passes to the kernel as it lies in HBM: as
    [V, 1, H] its default layout differed from the one Mosaic asks for, and XLA copied the
    whole table before every call (349.5 us a call on a v5e for Kimi K3's TP32 slice)."""
    spec = slice_spec("kimi-k3-mini")
    cfg = layout.KernelConfig(batch=2, max_context=256, cache_block=128, chip="v5e")
    sharding = SingleDeviceSharding(aot.device(cfg.chip))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            for a in megakernel.call_args(spec, cfg)]
    k = next(i for i, a in enumerate(args) if a.shape == (layout.embed_rows(spec), spec.hidden))
    with aot._target_chip(cfg.target.info):
        hlo = jax.jit(megakernel.build_call(spec, cfg)).trace(*args).lower(
            lowering_platforms=("tpu",)).compile().as_text()
    name = re.search(rf"%(\S+) = bf16\[{args[k].shape[0]},{spec.hidden}\]\S* parameter\({k}\)",
                     hlo).group(1)
    operands = hlo.split("custom-call(")[1].split(")")[0].split(", ")
    assert f"copy(%{name})" not in hlo and f"%{name}" in operands


def test_the_xla_reference_compiles_ahead_of_time_as_on_the_chip():
    """experiments/xla_reference_hlo.py: the XLA reference's loop for a v5e, compiled here, with the
    instruction names and layer scopes a chip trace of it is read by. The committed HLO is the
    program of the committed XLA traces: the loop as it was before it kept each step's picks
    (fd368e8 wrote it), with the same scopes. The loop now also keeps the picks' buffer, and its
    instructions are named otherwise: a trace taken from now on is read with the HLO the script
    writes at its commit."""
    import gzip
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "experiments"))
    import xla_reference_hlo
    from perfmodel.validate import traces
    from perfmodel_kernels.reference import PICKS_KEPT
    text = xla_reference_hlo.reference_hlo("k3-tp32-core", 8, "v5e")
    committed = gzip.decompress((root / "experiments/results/tpu_v5e/xla_k3-tp32-core_b8.hlo.txt.gz")
                                .read_bytes()).decode()
    count = lambda t: sum(bool(re.match(r"\s*(ROOT )?%", line)) for line in t.splitlines())  # noqa: E731
    assert count(committed) > 1000 and count(text) > 1000
    picks = f"s32[{PICKS_KEPT},3]"   # each step's picks, three MoE layers: the loop's buffer now
    assert picks in text and picks not in committed
    for t in (text, committed):
        assert {s.split("/")[0] for s in traces.hlo_scopes(t).values()} >= {"layer_01", "layer_04", "head"}
