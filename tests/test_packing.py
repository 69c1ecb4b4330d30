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
    megakernel.weight_args(packed, SPEC, a)
    with pytest.raises(SpecError, match=r"\(128, 384\)"):
        megakernel.weight_args(packed, SPEC, b)
    repacked = layout.with_banks(packed, w, b)
    megakernel.weight_args(repacked, SPEC, b)
    assert repacked.experts is packed.experts
    fresh = layout.pack_weights(w, b)
    assert np.array_equal(np.asarray(repacked.static), np.asarray(fresh.static))
    assert not np.array_equal(np.asarray(repacked.static), np.asarray(packed.static))
    with pytest.raises(SpecError, match="tile"):
        layout.with_banks(packed, w, dataclasses.replace(b, tile=256))
