"""A ring of one bank on a stream whose MLA `kv_b` matrix (read whole by `PartReader.matrix`)
straddles two banks: the TPU v5e never returned from this at ring depth 1 on the Kimi K3
TP32-core slice (the reader waited for the second bank before releasing the first, and with one
slot the second is issued only when the first is released; interpret mode hung the same way).
Interpret mode, race detection on."""
from perfmodel.spec.arch import derive
from perfmodel_kernels import layout, reference, stream

from test_megakernel import run_both


def test_one_bank_ring_reads_a_matrix_that_straddles_two_banks():
    spec = derive("kimi-k3-mini", mla={"kv_lora_rank": 256})
    cfg = layout.KernelConfig(batch=1, max_context=32, depth=1, expert_slots=1, tile=128,
                              cache_block=16, bank_rows=384, chip="v5e")
    part = stream.part(spec, ("mla", "attention"), cfg.tile, cfg.bank_rows)
    k = part.group_of("kv_b")
    assert any(it.row // cfg.bank_rows != (it.row + it.rows - 1) // cfg.bank_rows
               for it in part.items if it.group == k), "the case must straddle"
    run_both(spec, reference.init_weights(spec, 0), cfg, steps=1)
