"""The static stream packed per bank size: a kernel of another bank size refuses weights packed
for this one (on the TPU v5e a ring of 4096-row banks read weights packed in 8192-row banks past
the stream's end: the chip halted on a DMA bounds check)."""
import dataclasses

import numpy as np
import pytest

from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError
from perfmodel_kernels import layout, megakernel, reference

SPEC = load_model("kimi-k3-mini")


def cfg(bank_rows):
    return layout.KernelConfig(batch=1, max_context=32, depth=4, expert_slots=2, tile=128,
                               cache_block=16, bank_rows=bank_rows, chip="v5e")


def test_weights_packed_for_another_bank_size_are_refused():
    a, b = cfg(256), cfg(384)
    w = reference.init_weights(SPEC, 0)
    packed = layout.pack_weights(w, a)
    megakernel.weight_args(packed, a)
    with pytest.raises(SpecError, match=r"\(128, 384\)"):
        megakernel.weight_args(packed, b)
    repacked = layout.with_banks(packed, w, b)
    megakernel.weight_args(repacked, b)
    assert repacked.experts is packed.experts
    fresh = layout.pack_weights(w, b)
    assert np.array_equal(np.asarray(repacked.static), np.asarray(fresh.static))
    assert not np.array_equal(np.asarray(repacked.static), np.asarray(packed.static))
    with pytest.raises(SpecError, match="tile"):
        layout.with_banks(packed, w, dataclasses.replace(b, tile=256))


def test_experts_packed_a_few_at_a_time_pack_alike(monkeypatch):
    """Experts are quantised and packed in chunks whose f32 temporaries stay under
    layout.PACK_BYTES (a TP8 chip's whole experts: 3 at a time); one expert a chunk packs the
    same bytes as the whole layer at once."""
    from perfmodel_kernels.specs import slice_spec
    w = reference.init_weights(slice_spec("kimi-k3-mini", "mxfp4"), 0)
    whole = layout.pack_weights(w, cfg(256))
    monkeypatch.setattr(layout, "PACK_BYTES", 1)
    one = layout.pack_weights(w, cfg(256))
    for part in ("experts", "expert_scales", "expert_global"):
        a, b = getattr(one, part), getattr(whole, part)
        assert (a is None and b is None) or np.array_equal(np.asarray(a), np.asarray(b)), part
