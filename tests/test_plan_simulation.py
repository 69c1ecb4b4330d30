"""The schedule simulator run on the megakernel's own DMA plan (perfmodel_kernels.plan)."""
import dataclasses

import pytest

from perfmodel_kernels import layout, plan
from perfmodel.graph.ops import build
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError

SPEC = load_model("kimi-k3-mini")
CTX = 48


def setup(depth=6, slots=2, sharing=None):
    cfg = layout.KernelConfig(batch=4, max_context=64, depth=depth, expert_slots=slots,
                              cache_block=16, bank_rows=256)
    g = build(SPEC, Deployment(devices=1, tp=1, batch=4, context=CTX))
    the_plan = plan.dma_plan(SPEC, cfg, [round(g.distinct_experts)] * SPEC.count(ffn="moe"), [CTX] * 4)
    hw = load_hardware("tpu-v7").replace(dma_tile_bytes=cfg.bank_bytes)
    if sharing:
        hw = hw.replace(dma_sharing=sharing)
    d = Deployment(devices=1, tp=1, batch=4, context=CTX, prefetch_bytes=depth * cfg.bank_bytes, expert_slots=slots)
    return cfg, the_plan, hw, d


def test_plan_simulation_moves_exactly_the_plan_bytes():
    cfg, the_plan, hw, d = setup()
    p = predict(SPEC, hw, d, plan=the_plan)
    assert p.bytes_per_device == sum(c.bytes for c in the_plan)
    own = predict(SPEC, hw, d)  # the model's own uniform stream of the same configuration
    # this small step is bound by compute and op overheads, not bytes: the plan's few large copies
    # (its vectors and scales included) land within 10 % of the model's uniform stream
    assert p.bytes_per_device > own.bytes_per_device
    assert p.step_s == pytest.approx(own.step_s, rel=0.10)
    # with the kernel's settings (its dots among them) the plan predicts as predicted_step does
    kp = plan.as_kernel_plan(SPEC, SPEC, cfg, the_plan, CTX)
    assert plan.predicted_step(SPEC, cfg, the_plan, CTX).step_s == pytest.approx(predict(SPEC, hw, d, plan=kp).step_s)


def test_plan_ring_depth_under_fifo():
    """Under a FIFO DMA engine a deeper ring is never slower while it holds under half a layer's
    banks (MINI: about 13 of 256 rows): each bank more covers more of the engine's first-byte
    latency. Deeper, the routed experts queue behind more prefetched banks: a ring holding the
    whole stream (48 of 52 banks) is slower than 12."""
    step = {k: predict(SPEC, *setup(depth=k, sharing="fifo")[2:], plan=setup(depth=k)[1]).step_s
            for k in (1, 2, 3, 6, 12, 48)}
    up_to = [step[k] for k in (1, 2, 3, 6)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(up_to, up_to[1:])) and up_to[-1] < up_to[0]
    assert step[48] > step[12]


def test_plan_records_every_copy_on_the_dma_lane():
    _, the_plan, hw, d = setup()
    p = predict(SPEC, hw, d, record=True, plan=the_plan)
    dma = [e for e in p.timeline.events if e[0] == "dma"]
    # every ring tile and expert copy, one layer-start copy (KV / state, vectors) per layer and
    # one write-back (KDA state, MLA cache rows) per layer that writes one
    writes = {c.layer for c in the_plan if c.writes_back}
    assert writes == {layer.index for layer in SPEC.layers}
    assert len(dma) == sum(c.ring for c in the_plan) + sum(c.routed for c in the_plan) \
        + len(SPEC.layers) + 2 + len(writes)
    assert sum(e[1] == "kv_writeback" for e in dma) == len(writes)
    assert all(e[4] > e[3] for e in dma)


def test_plan_needs_the_megakernel_engine():
    _, the_plan, hw, d = setup()
    with pytest.raises(SpecError, match="megakernel"):
        predict(SPEC, hw, dataclasses.replace(d, engine="multikernel"), plan=the_plan)


def test_verify_rows_plan_runs_in_the_simulator():
    """A deployment with speculative decoding (3 drafted rows + 1, as cfg.rows = 4) runs on the
    kernel's own plan for 4 rows per sequence: it moves exactly the plan's bytes, and the
    verify step is not faster than a one-row step on the one-row plan (same weights, more rows)."""
    from perfmodel.spec.deployment import SpecDecode
    cfg = layout.KernelConfig(batch=4, max_context=64, depth=6, expert_slots=2,
                              cache_block=16, rows=4, bank_rows=256)
    the_plan = plan.dma_plan(SPEC, cfg, positions=[CTX] * 4, accepted=[4, 2, 0, 1])
    hw = load_hardware("tpu-v7").replace(dma_tile_bytes=cfg.bank_bytes)
    d = Deployment(devices=1, tp=1, batch=4, context=CTX, prefetch_bytes=6 * cfg.bank_bytes,
                   expert_slots=2, spec=SpecDecode(draft_rows=3, acceptance_length=2.0))
    p = predict(SPEC, hw, d, plan=the_plan)
    assert p.bytes_per_device == sum(c.bytes for c in the_plan)
    one = setup()
    assert p.step_s >= predict(SPEC, one[2], one[3], plan=one[1]).step_s
    kp = plan.as_kernel_plan(SPEC, SPEC, cfg, the_plan, CTX)
    assert plan.predicted_step(SPEC, cfg, the_plan, CTX, acceptance_length=2.0).step_s == \
        pytest.approx(predict(SPEC, hw, d, plan=kp).step_s)


def test_a_plan_computes_the_experts_it_fetched():
    """The graph's MoE layers hold the analytic expectation of distinct experts; a measured run's
    plan holds the experts its router picked, and the step computes those (not only copies them)."""
    import numpy as np
    from perfmodel.graph import ops
    cfg, _, hw, d = setup()
    g = build(SPEC, Deployment(devices=1, tp=1, batch=4, context=CTX))
    n_moe = SPEC.count(ffn="moe")
    picked = [1] + [round(g.distinct_experts)] * (n_moe - 1)   # the first MoE layer picked one
    few = plan.dma_plan(SPEC, cfg, picked, [CTX] * 4)
    assert ops.planned_experts(g, few) == pytest.approx(picked)
    scaled = ops.with_experts(g, ops.planned_experts(g, few))
    per_layer = np.bincount(scaled.layer, weights=scaled.routed_bytes)
    first = int(np.flatnonzero(per_layer)[0])
    assert per_layer[first] == pytest.approx(np.bincount(g.layer, weights=g.routed_bytes)[first]
                                             / g.distinct_experts)
    full = plan.dma_plan(SPEC, cfg, [round(g.distinct_experts)] * n_moe, [CTX] * 4)
    # fewer experts: less compute in that layer as well as fewer bytes
    assert predict(SPEC, hw, d, plan=few).layers[first].time_s < \
        predict(SPEC, hw, d, plan=full).layers[first].time_s


def test_measured_experts_for_any_engine():
    from perfmodel.spec.deployment import Deployment as D
    hw = load_hardware("tpu-v5e")
    d = D(devices=1, tp=1, batch=4, context=CTX, engine="multikernel")
    n_moe = SPEC.count(ffn="moe")
    base = predict(SPEC, hw, d)
    assert predict(SPEC, hw, d, experts=[1] * n_moe).step_s < base.step_s
    with pytest.raises(SpecError, match="distinct_experts"):
        predict(SPEC, hw, d, experts=[1] * (n_moe + 1))
    cfg, the_plan, hw7, dm = setup()
    with pytest.raises(SpecError, match="experts"):
        predict(SPEC, hw7, dm, plan=the_plan, experts=[1] * n_moe)


def test_an_mla_attention_ends_once_its_cache_rows_are_written():
    """The K3 TP32-core slice's plan on a v5e (FIFO engine, the tuned ring): the MLA layer's
    cache-row write, issued by the op that reads the cache, queues behind the ring banks issued
    before it and is awaited as the attention ends (megakernel.mla_attention), so its last op
    ends when the write lands, well after its own work; a KDA layer's state write-back is awaited
    by the next KDA layer, so its attention ends first."""
    from perfmodel_kernels import tuned
    from perfmodel_kernels.specs import slice_spec
    from perfmodel.step.predict import plan_deployment
    spec = slice_spec("k3-tp32-core", "mxfp4")
    t = tuned.tuned("kimi-k3-tp32-core", 1)
    cfg = layout.KernelConfig(batch=1, max_context=2048, depth=t.depth, expert_slots=t.expert_slots,
                              cache_block=256, bank_rows=t.bank_rows, tile=128, chip="v5e")
    kp = plan.as_kernel_plan(spec, spec, cfg, plan.dma_plan(spec, cfg, [4, 4, 4], [1028]), 1028)
    events = predict(spec, load_hardware("tpu-v5e"), plan_deployment(kp), plan=kp,
                     record=True).timeline.events
    ops = {(e[1], e[2]): (e[3], e[4]) for e in events if e[0] == "compute"}
    lands = {e[2]: e[4] for e in events if e[0] == "dma" and e[1] == "kv_writeback"}
    mla = next(layer.index for layer in spec.layers if layer.attention == "mla")
    start, end = ops[("o_proj", mla)]
    assert end == pytest.approx(lands[mla]) and end - start > 2 * (ops[("o_proj", 1)][1] - ops[("o_proj", 1)][0])
    kda = [layer.index for layer in spec.layers if layer.attention == "kda"]
    assert kda and all(ops[("o_proj", k)][1] < lands[k] for k in kda)


def test_the_model_own_stream_carries_its_vectors_and_write_backs():
    """The model's own stream (no plan) of a kernel that copies each layer's vectors and writes
    its KV tiles back (Muse Spark's preset) carries both, and awaits no write-back at an
    attention's end (its next collective does)."""
    from perfmodel.engine.megakernel import uniform_stream, vector_copies
    model = load_model("muse-spark")
    g = build(model, Deployment(devices=32, tp=32, batch=1, context=4096))
    st = uniform_stream(g, 2 ** 21)
    assert st.vectors == vector_copies(g) and st.vectors
    assert st.writeback == g.writeback and st.writeback and not st.writeback_awaited
