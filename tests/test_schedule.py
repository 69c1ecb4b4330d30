"""Schedule simulator: invariants, a hand-worked two-layer example, DMA sharing modes."""
import dataclasses
import tomllib

import numpy as np
import pytest

from perfmodel.engine.megakernel import simulate_megakernel
from perfmodel.engine.multikernel import simulate_multikernel
from perfmodel.engine.terms import collective_s, op_compute_s
from perfmodel.graph.ops import OpGraph, build
from perfmodel.spec.deployment import Deployment, SpecDecode
from perfmodel.spec.hardware import PRESET_DIR, from_dict, load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError

K3 = load_model("kimi-k3")
TPU = Deployment(devices=32, tp=32, ep=8, engine="megakernel")


def hw_with(name="tpu-v7", **fields):
    """A preset's spec-sheet figures with `fields` replaced; the fitted components are dropped
    (unless given), so hand-worked cases run on exactly the figures they state."""
    data = tomllib.loads((PRESET_DIR / f"{name}.toml").read_text())
    data["components"] = fields.pop("components", {})
    eff = {**data.get("efficiency", {}), **fields.pop("efficiency", {})}
    return from_dict({**data, **fields, "efficiency": eff})


def graph(rows, distinct=0.0):
    """OpGraph from (layer, name, flops, static, routed, coll_bytes or None) rows."""
    n = len(rows)
    col = lambda i, dt=float: np.array([r[i] or 0 for r in rows], dtype=dt)
    coll = np.array([r[5] is not None for r in rows])
    return OpGraph(col(0, int), ["x"] * n, [r[1] for r in rows], coll, col(2), ["" if c else "bf16" for c in coll],
                   col(3), col(4), np.zeros(n), np.zeros(n), ["all_reduce" if c else "" for c in coll], col(5),
                   np.where(coll, 2, 1), {1: "a", 2: "b"}, 1, distinct)


# 1 byte = 1 ns of DMA, 1 MFLOP = 1 us, 1000-byte tiles, a 2-bank ring, FIFO, no DMA latency,
# collectives cost exactly their 1 us base latency, a kernel launch costs 0.2 us
HAND = dict(cores_per_chip=1, peak_flops_per_s={"bf16": 1e12}, hbm_bandwidth_bytes_per_s=1e9,
            onchip_bytes=4000, dma_tile_bytes=1000, dma_latency_s=0.0, dma_sharing="fifo", dma_concurrent_copies=0,
            collective_base_latency_s=1e-6, link_latency_s=0.0, intra_chip_latency_s=0.0,
            link_bandwidth_bytes_per_s=1e30, intra_chip_bandwidth_bytes_per_s=1e30, launch_overhead_s=0.2e-6,
            collective_algorithm="one_shot",
            efficiency={"hbm": 1.0, "flops": 1.0, "collective_latency_scale": 1.0, "op_overhead_s": 0.0})
TWO_LAYERS = [(1, "w1", 1e6, 2000, 0, None), (1, "ar", 0, 0, 0, 0.0), (2, "w2", 0.5e6, 1000, 0, None)]


def test_hand_worked_two_layers_megakernel():
    # t=0 issue tiles 0,1 (done 1, 2 us). w1: tile 0 at 1 us, half of w1's compute -> 1.5 us, bank
    # freed: tile 2 issued at 1.5, queued behind tile 1 -> done 3 us. tile 1 at 2 us -> w1 ends 2.5.
    # all-reduce 2.5 -> 3.5. w2: tile 2 already there -> 3.5 + 0.5 = 4.0 us.
    hw = hw_with(**HAND)
    tl = simulate_megakernel(graph(TWO_LAYERS), hw, Deployment(devices=1, tp=1, prefetch_bytes=2000), 1, record=True)
    assert tl.end_s == pytest.approx([2.5e-6, 3.5e-6, 4.0e-6])
    assert tl.start_s == pytest.approx([0.0, 2.5e-6, 3.5e-6])
    assert tl.wait_s["weight_streaming"] == pytest.approx([1.5e-6, 0, 0])
    assert tl.step_s == pytest.approx(4.0e-6)
    dma = sorted(t for e in tl.events if e[0] == "dma" and e[4] > e[3] for t in e[3:])
    assert dma == pytest.approx([0, 1e-6, 1e-6, 2e-6, 2e-6, 3e-6])  # FIFO: served back to back


def test_hand_worked_two_layers_multikernel():
    # w1: launch .2 + max(mem 2 + last tile .5, first tile 1 + compute 1) = 2.7 us; all-reduce .2 + 1;
    # w2: .2 + max(1 + .5, 1 + .5) = 1.7 us; total 5.6 us
    tl = simulate_multikernel(graph(TWO_LAYERS), hw_with(**HAND))
    assert np.diff(np.concatenate([[0], tl.end_s])) == pytest.approx([2.7e-6, 1.2e-6, 1.7e-6])
    assert tl.step_s == pytest.approx(5.6e-6)


@pytest.mark.parametrize("engine", ["megakernel", "multikernel"])
@pytest.mark.parametrize("batch", [1, 8])
def test_step_is_at_least_bytes_and_critical_path(engine, batch):
    hw = load_hardware("tpu-v7")
    d = dataclasses.replace(TPU, engine=engine, batch=batch)
    p = predict(K3, hw, d)
    g = build(K3, d)
    bw = hw.core_hbm_bandwidth_bytes_per_s * hw.efficiency.hbm
    critical = op_compute_s(g, hw).sum() + collective_s(g, hw).sum()
    assert p.timeline.step_s >= max(p.bytes_per_device / bw, critical) * (1 - 1e-9)


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("model,hw_name,dev,ep", [("kimi-k3", "tpu-v7", 32, 8), ("deepseek-v3", "h200", 16, 2),
                                                  ("llama-3.1-8b", "h100", 1, None)])
def test_megakernel_never_slower_than_multikernel_under_fifo(batch, model, hw_name, dev, ep):
    # Expert slots as VMEM allows: with one slot each expert copy pays the fitted first-byte
    # latency in turn, and the megakernel can then be slower at batch 8 (physics, not a bug).
    m = load_model(model)
    hw = load_hardware(hw_name).replace(dma_sharing="fifo")
    d = Deployment(devices=dev, tp=dev, ep=ep, batch=batch, engine="megakernel")
    mega = predict(m, hw, d).step_s
    multi = predict(m, hw, dataclasses.replace(d, engine="multikernel")).step_s
    assert mega <= multi


def zero_latency(name):
    return hw_with(name, dma_latency_s=0.0, launch_overhead_s=0.0, link_latency_s=0.0,
                   collective_base_latency_s=0.0, intra_chip_latency_s=0.0, dma_tile_bytes=1,
                   dma_sharing="fifo", efficiency={"op_overhead_s": 0.0})


def test_zero_latency_reduces_multikernel_to_the_roofline():
    hw = zero_latency("gb200")
    d = Deployment(devices=16, tp=16, engine="multikernel", batch=4)
    g = build(K3, d)
    bw = hw.core_hbm_bandwidth_bytes_per_s * hw.efficiency.hbm
    roofline = np.maximum(g.bytes / bw, op_compute_s(g, hw)).sum() + collective_s(g, hw).sum()
    assert predict(K3, hw, d).step_s == pytest.approx(roofline, rel=1e-3)


def test_zero_latency_reduces_megakernel_to_the_roofline():
    hw = zero_latency("tpu-v7").replace(dma_tile_bytes=2**20)
    d = dataclasses.replace(TPU, batch=4, prefetch_bytes=48 * 2**20, expert_slots=2)
    p = predict(K3, hw, d)
    bw = hw.core_hbm_bandwidth_bytes_per_s * hw.efficiency.hbm
    g = build(K3, d)
    # DMA runs on through collectives, so the bound is the larger of the two lanes
    roofline = max(p.bytes_per_device / bw, op_compute_s(g, hw).sum() + collective_s(g, hw).sum())
    assert roofline * (1 - 1e-9) <= p.step_s <= roofline * 1.02


def depth_curve(hw, batch, depths_mib, slots):
    return [predict(K3, hw, dataclasses.replace(TPU, batch=batch, prefetch_bytes=m * 2**20,
                                                 expert_slots=slots)).step_s for m in depths_mib]


def test_fifo_more_depth_is_never_slower():
    # Spec-sheet chip: only weights, experts and KV share the engine. With the fitted components
    # the collectives' remote copies queue on it too, behind the prefetched tiles, so under FIFO a
    # deeper ring can delay them (test_fifo_depth_delays_collective_copies).
    hw = hw_with("tpu-v7", dma_sharing="fifo")
    for batch in (1, 8):
        curve = depth_curve(hw, batch, [4, 8, 16, 24, 32, 40, 48, 56], slots=1)
        assert all(b <= a * (1 + 1e-9) for a, b in zip(curve, curve[1:])), curve


# A layer's weights, a 2 us collective, a layer whose 1000-byte KV copy is issued at its start,
# a 10 us collective, then 3 tiles of weights. With a 1 GB/s link, a two-party one-shot
# all-reduce of M bytes takes M ns. (layer, name, flops, static, routed, collective bytes)
BURST = [(1, "w1", 0, 1000, 0, None), (1, "c1", 0, 0, 0, 2000.0), (2, "core", 0, 0, 0, None),
         (2, "c2", 0, 0, 0, 10000.0), (3, "w3", 0, 3000, 0, None)]


def burst_curve(sharing):
    hw = hw_with(**{**HAND, "dma_sharing": sharing, "collective_base_latency_s": 0.0,
                    "link_bandwidth_bytes_per_s": 1e9})
    g = graph(BURST)
    g.kv_bytes[2] = 1000.0
    return [simulate_megakernel(g, hw, Deployment(devices=1, tp=1, prefetch_bytes=banks * 1000), 1).step_s
            for banks in (1, 2, 3, 4)]


def test_shared_dma_can_make_more_depth_slower():
    # Shared: 4 banks issue w1's tile with three w3 tiles at t=0, so w1's tile lands at 4 us, not
    # 1 us, and everything after slips; the w3 tiles would have loaded during c2 anyway.
    # FIFO serves w1's tile first: more depth is never slower.
    assert burst_curve("shared") == pytest.approx([16e-6, 16e-6, 16e-6, 17e-6])
    fifo = burst_curve("fifo")
    assert all(b <= a for a, b in zip(fifo, fifo[1:])) and fifo[-1] == pytest.approx(15e-6)


def slot_curve(sharing, concurrent=0):
    """One MoE layer: four 1000-byte experts (1 us each at 1 GB/s, 0.5 us first-byte latency),
    1 us of matmul per expert, fetched into 1..4 slots; shared service of at most `concurrent`
    copies at once (0: any number)."""
    hw = hw_with(**{**HAND, "dma_sharing": sharing, "dma_latency_s": 0.5e-6, "onchip_bytes": 10000,
                    "dma_concurrent_copies": concurrent, "efficiency": HAND["efficiency"]})
    g = graph([(1, "routed_experts", 4e6, 0, 4000, None)], distinct=4)
    return [simulate_megakernel(g, hw, Deployment(devices=1, tp=1, prefetch_bytes=1000, expert_slots=s),
                                4).step_s for s in (1, 2, 3, 4)]


def test_shared_dma_gives_expert_slots_an_interior_optimum():
    # Shared: 2 slots: e0, e1 land together at 2.5 us; e2 (issued at 3.5) at 5, e3 (at 4.5) at 6
    # -> 7 us. 3 slots: e0..e2 all land at 3.5 (each gets a third of the engine), e3 at 6 -> 7.5.
    # 4 slots: all land at 4.5, then 4 us of matmuls -> 8.5. 1 slot: 4 x (0.5 + 1 + 1) = 10.
    assert slot_curve("shared") == pytest.approx([10e-6, 7e-6, 7.5e-6, 8.5e-6])
    # FIFO lands the first copy first, so more slots are never slower: 10, 6, 5.5, 5.5 us
    assert slot_curve("fifo") == pytest.approx([10e-6, 6e-6, 5.5e-6, 5.5e-6])


def test_at_most_k_copies_in_service_round_robin_the_rest_in_issue_order():
    # K = 2. 4 slots: e0..e3 issued at 0, all started at 0.5 us; e0, e1 in service share the engine
    # and land at 2.5, then e2, e3 at 4.5 (not all four at 4.5 as with no limit); matmuls 2.5 ->
    # 6.5. 3 slots: e0, e1 land at 2.5, e2 (waiting since 0.5) alone at 3.5, e3 (issued when e0's
    # matmul ends at 3.5, started 4.0) at 5.0 -> 6.5. 2 slots never have more than 2 copies out:
    # 7 us as with no limit. 1 slot: 10.
    assert slot_curve("shared", 2) == pytest.approx([10e-6, 7e-6, 6.5e-6, 6.5e-6])
    # K = 1 is FIFO; K at least the copies ever out is the unlimited shared service
    assert slot_curve("shared", 1) == pytest.approx(slot_curve("fifo"))
    assert slot_curve("shared", 4) == pytest.approx(slot_curve("shared"))


def test_one_copy_in_service_is_fifo_on_the_profiled_kernel():
    """The limit's two ends on Muse Spark's timeline: K = 1 is the FIFO engine; a K above every
    copy the kernel ever has out (ring, slots, KV, a collective phase) is the unlimited service."""
    assert profiled(concurrent=1) == pytest.approx(profiled(sharing="fifo"), rel=1e-9)
    assert profiled(concurrent=64) == pytest.approx(profiled(concurrent=0), rel=1e-9)


def test_concurrent_copies_must_be_a_whole_number():
    for bad in (-1, 2.5, True):
        with pytest.raises(SpecError) as e:
            hw_with(**{**HAND, "dma_concurrent_copies": bad})
        assert e.value.field == "dma_concurrent_copies"


def test_kimi_k3_expert_slots_have_an_interior_optimum_at_batch_1():
    """More slots than the optimum put more expert copies in service beside the ring's: 6 slots are
    slower than the best count by over 1 % (a deterministic timeline: no noise to exceed)."""
    hw = load_hardware("tpu-v7")
    steps = [predict(K3, hw, dataclasses.replace(TPU, prefetch_bytes=32 * 2**20, expert_slots=s)).step_s
             for s in (1, 2, 3, 4, 6)]
    best = steps.index(min(steps))
    assert 0 < best < len(steps) - 1 and steps[-1] > steps[best] * 1.01


def test_shared_dma_on_kimi_k3_depth_curve_flattens():
    hw = load_hardware("tpu-v7")
    assert hw.dma_sharing == "shared"
    curve = depth_curve(hw, 1, [4, 16, 32, 48], slots=1)
    assert curve[0] > curve[1] > curve[2] and abs(curve[3] / curve[2] - 1) < 0.01


def test_ring_and_slots_must_fit_in_vmem():
    hw = load_hardware("tpu-v7")
    with pytest.raises(SpecError, match="prefetch_bytes") as e:
        predict(K3, hw, dataclasses.replace(TPU, prefetch_bytes=80 * 2**20))
    assert "by" in str(e.value)
    with pytest.raises(SpecError, match="expert_slots"):
        predict(K3, hw, dataclasses.replace(TPU, prefetch_bytes=32 * 2**20, expert_slots=16))


def test_slots_that_fit_only_split_experts_name_the_expert_split():
    """Muse Spark's kernel splits every expert over its 8 tp ranks; at the default ep (one group
    per device) each core would hold whole experts, of which one fits beside the kernel's ring:
    the error says how ep splits them, and --ep 1 predicts."""
    ms, hw = load_model("muse-spark"), load_hardware("tpu-v7")
    with pytest.raises(SpecError, match=r"at most 1 fit \(ep = 8 splits each expert over 1 of the 8 devices"):
        predict(ms, hw, Deployment(devices=8, tp=8))
    assert predict(ms, hw, Deployment(devices=8, tp=8, ep=1)).step_s > 0


def test_speculative_decoding_tokens_per_step():
    assert SpecDecode(7, acceptance_prob=0.8).tokens_per_step == pytest.approx((1 - 0.8 ** 8) / 0.2)
    assert SpecDecode(7, acceptance_length=6).tokens_per_step == 6
    with pytest.raises(SpecError):
        SpecDecode(7, acceptance_length=9)
    with pytest.raises(SpecError):
        SpecDecode(7)


def test_spec_decode_verifies_rows_of_one_sequence():
    hw = load_hardware("tpu-v7")
    spec = SpecDecode(7, acceptance_length=6, draft_cost_fraction=0.0)
    p1 = predict(K3, hw, TPU)
    ps = predict(K3, hw, dataclasses.replace(TPU, spec=spec))
    p8 = predict(K3, hw, dataclasses.replace(TPU, batch=8))
    # 8 rows of one sequence: weights and experts as for 8 tokens, but one KV / state read
    assert p1.step_s < ps.step_s <= p8.step_s
    assert ps.tokens_per_s == pytest.approx(6 / ps.step_s)
    g8, gs = build(K3, dataclasses.replace(TPU, batch=8)), build(K3, dataclasses.replace(TPU, spec=spec))
    assert gs.routed_bytes.sum() == pytest.approx(g8.routed_bytes.sum())
    assert gs.kv_bytes.sum() < g8.kv_bytes.sum()


def test_kernel_all_reduce_is_one_shot_in_the_megakernel_only():
    """Kimi K3 at batch 4 (4 rows, not among its shard-collective rows): in the megakernel each
    all-reduce costs the one-shot algorithm's time, in a multi-kernel engine the fastest's; the
    all-gathers are the same in both. A model that fixes nothing gets the fastest at any rows."""
    from perfmodel.cost import components as cm
    from perfmodel.engine.terms import collective_terms
    hw = load_hardware("tpu-v7")
    g = build(load_model("kimi-k3"), Deployment(devices=32, tp=32, ep=8, batch=4))
    assert g.kernel_all_reduce == "one_shot"
    kernel, fastest = collective_terms(g, hw, megakernel=True)[0], collective_terms(g, hw)[0]
    for j in np.flatnonzero(g.is_collective):
        k, m, p = g.coll_kind[j], g.coll_bytes[j], int(g.coll_group[j])
        want = cm.collective_time(hw.components, k, m, p, 2, "one_shot" if k == "all_reduce" else None)[0]
        assert kernel[j] == pytest.approx(want) and fastest[j] <= kernel[j] + 1e-15
    assert (kernel > fastest + 1e-7).any()  # the 57 KB hidden-state all-reduces
    assert build(load_model("kimi-k3"), Deployment(devices=32, tp=32, ep=8, batch=8)).kernel_all_reduce == ""
    assert build(load_model("qwen3-235b-a22b"), Deployment(devices=8, tp=8, batch=4)).kernel_all_reduce == ""


@pytest.mark.parametrize("engine", ["megakernel", "multikernel"])
def test_steps_per_call_share_the_host_dispatch(engine):
    """A device call that runs 64 decode steps pays its host dispatch once: each step is the
    dispatch x 63/64 shorter, nothing else moves (the whole timeline starts that much earlier)."""
    hw = load_hardware("tpu-v7")
    one = dataclasses.replace(TPU, engine=engine)
    many = dataclasses.replace(one, steps_per_call=64)
    dispatch = hw.components["host_dispatch_s"]
    assert predict(K3, hw, one).step_s - predict(K3, hw, many).step_s == pytest.approx(dispatch * 63 / 64, rel=1e-6)
    with pytest.raises(SpecError) as e:
        predict(K3, hw, dataclasses.replace(one, steps_per_call=0))
    assert e.value.field == "steps_per_call"


def profiled(slots=None, banks=None, sharing="shared", concurrent=None):
    """Muse Spark on its profiled deployment (TP8, batch 1) with `slots` expert buffers and a ring
    of `banks` 2 MiB banks (None: the kernel's own 4 and 12), at most `concurrent` copies in
    service (None: tpu-v7's dma_concurrent_copies)."""
    from perfmodel.step.phases import load_profile, profile_deployment
    d = profile_deployment(load_profile("musespark"))
    d = dataclasses.replace(d, expert_slots=slots, prefetch_bytes=None if banks is None else banks * 2**21)
    hw = load_hardware("tpu-v7").replace(dma_sharing=sharing)
    hw = hw if concurrent is None else hw.replace(dma_concurrent_copies=concurrent)
    return predict(load_model("muse-spark"), hw, d).step_s


def test_profiled_kernel_slots_have_the_optimum_the_dma_engine_puts():
    """One slot exposes each expert's first-byte latency; from 2 slots the latency is hidden; past
    about 4 the copies issued together delay each other, so the optimum is 3-4 slots. With at most
    K copies in service the copies past K wait in issue order instead of sharing (the first lands
    first), so 8 slots cost less over the optimum than with no limit, where all 8 land together
    (slot_curve); FIFO: the ring's refills queue behind them."""
    steps = {s: profiled(s) for s in (1, 2, 3, 4, 6, 8)}
    best = min(steps, key=steps.get)
    assert best in (3, 4) and steps[1] > 1.2 * steps[best] and steps[8] > steps[best]
    unlimited = {s: profiled(s, concurrent=0) for s in (3, 4, 8)}
    assert steps[8] / steps[best] < unlimited[8] / min(unlimited.values())
    fifo = {s: profiled(s, sharing="fifo") for s in (2, 4, 8)}
    assert fifo[8] > fifo[4] < fifo[2]


def test_profiled_kernel_deeper_ring_streams_more_under_the_collectives():
    """At the kernel's 4 slots: 4 banks cannot cover the engine's first-byte latency, so 8 are
    faster. With no limit on the copies in service every bank more is in flight when a collective
    starts: a deeper ring never costs, down to the deepest ring VMEM holds beside the slots (24
    banks). With at most K in service the banks past K wait in issue order and add no service
    under a collective: from 12 banks on the ring gains under 1 %."""
    depths = (4, 8, 12, 16, 20, 24)
    curve = [profiled(4, b) for b in depths]
    assert curve[1] < 0.95 * curve[0] and max(curve[2:]) < 1.01 * min(curve[2:])
    unlimited = [profiled(4, b, concurrent=0) for b in depths]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(unlimited, unlimited[1:])) and unlimited[-1] < 0.9 * unlimited[0]
    with pytest.raises(SpecError, match="expert_slots"):
        profiled(8, 24)
