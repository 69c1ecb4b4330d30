"""Component layer: each mechanism against its own micro-benchmarks, and `perfmodel calibrate`."""
import json
import math

import pytest

from perfmodel.cli.main import main
from perfmodel.cost import components as cm
from perfmodel.fit.microbench import calibrated, load, residual_table
from perfmodel.spec.hardware import load_hardware

@pytest.fixture(scope="module")
def tpu():
    data = load("tpu7x.json")
    return data, calibrated(data, load_hardware("tpu-v7"), "tpu7x.json")


def test_every_tpu7x_micro_benchmark_within_10_percent(tpu):
    data, hw = tpu
    rows = [r for r in residual_table(data, hw) if r["within_target"] is not None]
    assert len(rows) >= 30
    assert [r["id"] for r in rows if not r["within_target"]] == []


def test_preset_holds_the_calibrated_components(tpu):
    """The tpu-v7 preset is `perfmodel calibrate --microbench tpu7x.json --out` output: refitting
    from it predicts every micro-benchmark the same (flat directions may drift)."""
    data, hw = tpu
    again = {r["id"]: r["predicted"] for r in residual_table(data, hw)}
    for r in residual_table(data, load_hardware("tpu-v7")):
        if r["predicted"] is not None:
            assert r["predicted"] == pytest.approx(again[r["id"]], rel=0.01), r["id"]


def test_stream_benchmarks_are_read_as_the_test_timed_them():
    """Inferact's stream test times one call of 16 layers and divides by 16 (its dispatch and the
    ring's first byte included), and the lm_head as the difference of two calls (neither). By hand,
    DMA-only banks of 1 us each (1 MB at 1 TB/s, no descriptor cost), 2 banks a layer, 4 us of
    first-byte latency, 100 us of dispatch: a cold layer 4 + 2 = 6 us; per layer of a 16-layer
    call (4 + 32 + 100) / 16 = 8.5 us; after other banks in the same call, 2 us."""
    from perfmodel.fit.microbench import weight_stream_time
    c = {"dma_bandwidth_bytes_per_s": 1e12, "dma_descriptor_s": 0.0, "dma_latency_s": 4e-6,
         "host_dispatch_s": 100e-6}
    layer = {"bytes": 2e6, "bank_bytes": 1e6, "dtype": "bf16", "rows": 8, "dots_per_bank": 0}
    assert weight_stream_time(c, layer) == pytest.approx(6e-6)
    assert weight_stream_time(c, {**layer, "layers_per_call": 16}) == pytest.approx(8.5e-6)
    assert weight_stream_time(c, {**layer, "difference_of_calls": True}) == pytest.approx(2e-6)
    timed = {e["id"]: e["inputs"] for e in load("tpu7x.json")["entries"]}
    assert timed["ms-stream-bf16"]["layers_per_call"] == 16 and timed["ms-stream-lmhead-bf16"]["difference_of_calls"]


def test_kernel_picks_the_measured_fastest_algorithm(tpu):
    c = tpu[1].components
    pick = lambda kind, payload: cm.collective_time(c, kind, payload, 8, 2)[1]
    assert pick("all_reduce", 8 * 8192 * 2) == "rs_ag"            # B=1 default: RS+AG bf16
    assert pick("all_reduce", 64 * 4096 * 2) == "hierarchical"    # B=8 default
    # all-gathers of [R, n] bf16 shards into [R, 8n]: direct wins for every payload measured
    assert all(pick("all_gather", 8 * r * n * 2) == "direct" for r, n in ((8, 512), (8, 1024), (16, 1024)))


def test_hierarchical_all_gather_crosses_the_links_once_per_core():
    """Hand-worked, 8 devices on 4 chips, payload P (the gathered result), shard s = P/8: direct
    sends s to 7 peers (6 s cross-chip); hierarchical sends s to the same core of the 3 other
    chips (3 s cross-chip), then its 4 shards to the sibling (4 s)."""
    p = 8 * 1024.0
    (one,) = cm.collective_phases("all_gather", "direct", p, 8, 2)
    assert (one.copies, one.sibling_bytes, one.cross_bytes) == (7, 1024, 6 * 1024)
    cross, sib = cm.collective_phases("all_gather", "hierarchical", p, 8, 2)
    assert (cross.copies, cross.sibling_bytes, cross.cross_bytes) == (3, 0, 3 * 1024)
    assert (sib.copies, sib.sibling_bytes, sib.cross_bytes) == (1, 4 * 1024, 0)


def test_one_shot_all_reduce_sums_within_each_host_then_across_hosts():
    """Hand-worked, payload P: on one host of 8 devices every core sends P to its sibling and to
    the 6 cores of the other chips (one phase); 32 devices on 4 hosts add a second phase, P to
    the same core of each of the 3 other hosts."""
    p = 14336.0
    (one,) = cm.collective_phases("all_reduce", "one_shot", p, 8, 2)
    assert (one.copies, one.sibling_bytes, one.cross_bytes) == (7, p, 6 * p)
    host, hosts = cm.collective_phases("all_reduce", "one_shot", p, 32, 2, host_devices=8)
    assert (host.copies, host.sibling_bytes, host.cross_bytes) == (7, p, 6 * p)
    assert (hosts.copies, hosts.sibling_bytes, hosts.cross_bytes) == (3, 0, 3 * p)


def test_one_shot_wins_only_for_small_payloads(tpu):
    """Fewer semaphore rounds against whole payloads on the wire: one-shot for a batch-1 hidden
    state (14 KB), a shard-based algorithm once the payload is a few tens of KB."""
    c = tpu[1].components
    pick = lambda payload, devices: cm.collective_time(c, "all_reduce", payload, devices, 2)[1]
    assert pick(14336, 8) == pick(14336, 32) == "one_shot"
    assert pick(8 * 14336, 8) == "rs_ag" and pick(16 * 16384, 32) == "hierarchical"


def test_sibling_core_is_about_10x_a_cross_chip_link(tpu):
    c = tpu[1].components
    big = 16 * 2**20
    ratio = cm.remote_copy_time(c, big, "cross_chip") / cm.remote_copy_time(c, big, "sibling")
    assert 10 < ratio < 16  # 367 us vs 27.5 us measured


def test_matmul_is_flat_in_the_rows_until_the_lhs_stream_dominates(tpu):
    c = tpu[1].components
    t = [cm.matmul_time(c, 4096 * 1024, "fp8", rows) for rows in (1, 8, 32, 256)]
    assert t[0] == t[1] == t[2] < t[3]
    assert cm.matmul_time(c, 2**20, "bf16", 8, dots=0) == pytest.approx(
        2 * cm.matmul_time(c, 2**20, "fp8", 8, dots=0), rel=0.1)  # bf16 push is 2x the fp8 time




def test_dequant_dot_by_hand(tpu):
    """A 4-bit matrix dequantised on the vector unit, then a bf16 dot: 64 tiles of 256 x 256 at the
    bf16 push, one dot issued, and the vector unit's fixed work (Muse Spark's NVFP4 gate_up slice,
    4096 x 1024: 1.5 us measured)."""
    c = tpu[1].components
    by_hand = 64 * c["mxu_push_bf16_s"] + c["mxu_dot_issue_s"] + c["vpu_dequant_s"]
    assert cm.dequant_matmul_time(c, 4096 * 1024, 8) == pytest.approx(by_hand)
    assert cm.dequant_matmul_time(c, 2 * 4096 * 1024, 8, matrices=2) == pytest.approx(2 * by_hand)
    assert 1.35e-6 < by_hand < 1.65e-6
def test_missing_component_names_the_parameter():
    with pytest.raises(Exception, match="components.dma_latency_s"):
        cm.dma_stream_time({}, 1.0)


def test_calibrate_cli_writes_a_loadable_hardware_file(tmp_path, capsys):
    out = tmp_path / "tpu.toml"
    assert main(["calibrate", "--microbench", "tpu7x.json", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["id"] for r in report["residuals"]} >= {"ms-copy-sibling-256k", "ms-ar-8x8192-rsag-bf16"}
    hw = load_hardware(str(out))
    assert hw.components["link_bandwidth_bytes_per_s"] == pytest.approx(45e9, rel=0.05)
    assert "fitted by perfmodel calibrate" in hw.sources["components.collective_phase_s"]
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind


def test_calibrate_cli_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["calibrate", "--microbench", str(bad)]) == 2
    assert "entries" in capsys.readouterr().err
    assert main(["calibrate", "--microbench", str(tmp_path / "none.json")]) == 2


def test_gb200_all_reduce_within_10_percent():
    data = load("gpu.json")
    hw = calibrated(data, load_hardware("gb200"), "gpu.json")
    rows = [r for r in residual_table(data, hw) if r["group"] == "gpu_all_reduce" and r["id"].startswith("gb200-")]
    assert len(rows) == 4 and all(r["within_target"] for r in rows)


def test_gb200_graph_overlap_is_the_kernel_pairs_geometric_mean():
    """One number for every kernel: the log least squares of the eight PDL kernel pairs is their
    geometric mean (hand-worked from the savings, 0.44 to 0.84 us); the preset holds it."""
    data = load("gpu.json")
    pairs = [e for e in data["entries"] if e["mechanism"] == "pdl_kernel_pair"]
    assert len(pairs) == 8 and all(e["value"] == pytest.approx(e["inputs"]["without_pdl_us"] - e["inputs"]["with_pdl_us"],
                                                               abs=1e-3) for e in pairs)
    mean = math.exp(sum(math.log(e["value"]) for e in pairs) / len(pairs)) * 1e-6
    hw = calibrated(data, load_hardware("gb200").with_components(graph_kernel_overlap_s=1e-6), "gpu.json")
    assert hw.components["graph_kernel_overlap_s"] == pytest.approx(mean, rel=1e-4)
    assert load_hardware("gb200").components["graph_kernel_overlap_s"] == pytest.approx(mean, rel=1e-4)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_graph_mode_all_reduce_presets_fit_the_decode_payloads(gpu):
    """Each preset holds its own fit to the all-reduces measured inside a CUDA graph: within 16 %
    up to 128 KiB (1-8 tokens of a hidden state); the eager-mode figures are reported only."""
    data = load("gpu.json")
    rows = [r for r in residual_table(data, load_hardware(gpu)) if "-vllm-graph-ar-" in r["id"]]
    assert len(rows) == 15
    small = [r for r in rows if not r["id"].endswith("-512k")]
    assert all(abs(r["error"]) <= 0.16 for r in small), [(r["id"], r["error"]) for r in small]
    assert all(r["within_target"] is None for r in residual_table(data, load_hardware("h100"))
               if r["id"].startswith("h100-custom-ar-"))


def test_no_fitted_value_reaches_the_host_presets():
    """The seed-table fit refits only a gb200 component, in its report (nothing is fitted on whole
    steps for tpu-v7); the host presets keep uniform routing and physical-default efficiency."""
    from perfmodel.fit.seed import fit_params
    from perfmodel.spec.loaders import load_model
    assert [p.key for p in fit_params(["gb200", "tpu-v7"])] == ["gb200.graph_kernel_overlap_s"]
    assert all(load_model(m).moe.routing_skew == 0 for m in ("kimi-k3-host-small", "kimi-k3-host-large"))




def test_host_expert_loop_by_hand():
    c = {"host_expert_fixed_s": 2e-6, "host_expert_bandwidth_bytes_per_s": 1e10,
         "host_expert_row_s_per_byte": 1e-12}
    # 4 experts, 40 MB, 8 rows: 4 x 2 us + 40e6 x (1e-10 + 8e-12) s = 8 us + 4.32 ms
    assert cm.host_expert_time(c, 40e6, 8, 4) == pytest.approx(8e-6 + 4.32e-3)
    assert cm.host_expert_time(c, 40e6, 8, 4) > cm.host_expert_time(c, 40e6, 1, 4)


def test_host_cache_widening_by_hand():
    c = {"host_convert_values_per_s": 5e8, "host_convert_reused_values_per_s": 4e9,
         "host_mmap_threshold_bytes": 32 * 2**20}
    assert cm.host_convert_time(c, 1e8, 4e8) == pytest.approx(0.2)  # 400 MB allocated: fresh pages
    assert cm.host_convert_time(c, 4e6, 16e6) == pytest.approx(1e-3)  # 16 MB: reused memory
    assert cm.host_convert_time(c, 4e6, 40e6) == pytest.approx(8e-3)  # same values, 40 MB allocated


def test_host_dot_by_hand():
    c = {"dot_gemv_bandwidth_bytes_per_s": 4e10, "dot_gemm_bandwidth_bytes_per_s": 2e10,
         "dot_gemm_row_s_per_byte": 1e-12, "dot_fixed_s": 8e-6}
    # 4 MB at one row: 8 us + 100 us; at 8 rows: 8 us + 4e6 x (5e-11 + 8e-12) s = 8 us + 232 us
    assert cm.host_dot_time(c, 4e6, 1) == pytest.approx(108e-6)
    assert cm.host_dot_time(c, 4e6, 8) == pytest.approx(240e-6)


def test_host_absorbed_kv_b_by_hand():
    c = {"host_absorb_fixed_s": 1e-5, "host_absorb_bytes_per_s": 2e9}
    assert cm.host_absorbed_kv_b_time(c, 2e6) == pytest.approx(1.01e-3)  # 10 us + 2 MB at 2 GB/s


def test_host_program_by_hand():
    c = {"host_call_s": 4e-6, "host_thunk_s": 3e-7}
    # one call of 100 thunks: 4 us + 100 x 0.3 us = 34 us; a share of a program: thunks only
    assert cm.host_program_time(c, 100) == pytest.approx(34e-6)
    assert cm.host_program_time(c, 10, calls=0) == pytest.approx(3e-6)


def test_host_argmax_by_hand():
    # 8 rows x 32768 logits at 2.5e8 values/s: 1.048576 ms
    assert cm.host_argmax_time({"host_argmax_values_per_s": 2.5e8}, 8 * 32768) == pytest.approx(1.048576e-3)


def test_host_engine_charges_each_phase_its_counted_thunks_and_one_call():
    """kimi-k3-host-small (layer 1 KDA + dense FFN, 2-3 KDA + MoE, 4 MLA + MoE): with the thunk
    counts per phase kind, the step gains one call + (3 kda + 1 mla attention + 1 ffn + 3 moe +
    head) thunks + 1 for the embedding (no count: one per op) at host_thunk_s each."""
    import dataclasses
    from perfmodel.engine.multikernel import simulate_multikernel
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.loaders import load_model
    from perfmodel.validate.host import host_hardware
    base = {"dot_gemv_bandwidth_bytes_per_s": 3e10, "dot_gemm_bandwidth_bytes_per_s": 3e10,
            "dot_gemm_row_s_per_byte": 1e-12, "dot_fixed_s": 1e-5}
    counts = {"host_thunks_attention_kda": 40.0, "host_thunks_attention_mla": 50.0,
              "host_thunks_ffn": 8.0, "host_thunks_moe": 30.0, "host_thunks_head": 7.0}
    hw = host_hardware(load_hardware("h200"), "compiled")
    g = build(load_model("kimi-k3-host-small"), Deployment(devices=1, tp=1, engine="multikernel", batch=4))
    step = lambda comp: simulate_multikernel(g, dataclasses.replace(hw, components=comp)).step_s
    with_thunks = step(base | counts | {"host_call_s": 5e-6, "host_thunk_s": 1e-6})
    thunks = 3 * 40 + 50 + 8 + 3 * 30 + 7 + 1
    assert with_thunks - step(base) == pytest.approx(5e-6 + thunks * 1e-6)


def test_all_gather_benchmarks_carry_the_gathered_result():
    """The report's all-gather shapes are each rank's [R, w] bf16 shard; the collective model
    takes the gathered [R, 8w] result, as the simulator passes it."""
    import re
    gathers = [e for e in load("tpu7x.json")["entries"] if e["inputs"].get("kind") == "all_gather"]
    assert len(gathers) == 6
    for e in gathers:
        rows, width = map(int, re.search(r"\[(\d+), (\d+)\] bf16 per rank", e["inputs"]["shard"]).groups())
        assert e["inputs"]["payload_bytes"] == e["inputs"]["devices"] * rows * width * 2


def test_xla_expert_loop_prices_a_trip_per_distinct_expert():
    """On a TPU whose hardware file has the XLA expert-loop component (tpu-v5e), the multi-kernel
    engine prices each MoE layer's routed experts as XLA's loop over them: one more distinct expert
    in a layer costs one trip (fixed cost + its bytes at the loop's rate + rows x bytes); without
    XLA's components the same graph streams the bytes at the engine's bandwidth with no trip cost."""
    import dataclasses
    from perfmodel.cost import components as cm
    from perfmodel.engine.multikernel import simulate_multikernel
    from perfmodel.graph.ops import build, with_experts
    from perfmodel.spec.deployment import Deployment
    from perfmodel_kernels.specs import slice_spec
    hw = load_hardware("tpu-v5e")
    c = hw.components
    g = build(slice_spec("k3-tp32-core", "bf16"), Deployment(devices=1, tp=1, engine="multikernel", batch=8))
    few, more = with_experts(g, [20, 20, 20]), with_experts(g, [20, 21, 20])
    assert list(more.experts_read()[more.routed_bytes > 0]) == pytest.approx([20, 21, 20])
    one = more.routed_bytes.max() / 21       # one expert's bf16 bytes
    trip = cm.xla_expert_time(c, one, g.tokens, 1)
    assert trip == pytest.approx(c["xla_expert_trip_s"] + one / c["xla_expert_bandwidth_bytes_per_s"]
                                 + g.tokens * one * c["xla_expert_row_s_per_byte"])
    step = lambda gr, h: simulate_multikernel(gr, h).step_s   # noqa: E731
    assert step(more, hw) - step(few, hw) == pytest.approx(trip, rel=1e-3)  # (+ the last tile's drain)
    plain = dataclasses.replace(hw, components={k: v for k, v in c.items() if not k.startswith(("xla_dot", "xla_expert"))})
    assert step(more, plain) - step(few, plain) < trip - 0.9 * c["xla_expert_trip_s"]


def test_xla_dots_on_a_tpu_take_their_measured_time_without_fill():
    """With XLA's dot component (tpu-v5e), a static dot's op lasts xla_dot_time of its weights plus
    its activations at the stream rate: no launch gap, first-byte latency or pipeline fill of its
    own (XLA copies its weights in behind the ops before it); an op without weights keeps them."""
    from perfmodel.cost import components as cm
    from perfmodel.engine.multikernel import simulate_multikernel
    from perfmodel.engine.terms import launch_s
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    from perfmodel_kernels.specs import slice_spec
    hw = load_hardware("tpu-v5e")
    c = hw.components
    g = build(slice_spec("k3-tp8-dense", "bf16"), Deployment(devices=1, tp=1, engine="multikernel", batch=1))
    tl = simulate_multikernel(g, hw)
    dur = tl.end_s - tl.start_s
    j = g.name.index("gate_up")
    other = g.bytes[j] - g.static_bytes[j]
    assert dur[j] == pytest.approx(cm.xla_dot_time(c, g.static_bytes[j]) + other / c["dma_bandwidth_bytes_per_s"])
    k = g.name.index("attn_norm", 1)
    assert dur[k] >= launch_s(hw) + c["dma_latency_s"]


def test_xla_copies_an_mla_cache_through_hbm_once_it_outgrows_vmem():
    """XLA's two copies of an MLA latent cache a step: none through HBM while both fit on chip, one
    when only one does, both beyond (each reading and writing the whole cache at XLA's copy
    rate); in the multi-kernel engine on a TPU with XLA's components they lengthen the MLA attention
    op by exactly that, and a batch's larger cache crosses from VMEM into HBM."""
    import dataclasses
    from perfmodel.cost import components as cm
    from perfmodel.engine.multikernel import simulate_multikernel
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    from perfmodel_kernels.specs import slice_spec
    hw = load_hardware("tpu-v5e")
    c, vmem = hw.components, hw.onchip_bytes
    copy = lambda b: 2 * b / c["xla_copy_bandwidth_bytes_per_s"]   # noqa: E731
    assert cm.xla_cache_copy_time(c, 0.3 * vmem, vmem) == 0.0
    assert cm.xla_cache_copy_time(c, 0.6 * vmem, vmem) == pytest.approx(copy(0.6 * vmem))
    assert cm.xla_cache_copy_time(c, 1.2 * vmem, vmem) == pytest.approx(2 * copy(1.2 * vmem))
    spec = slice_spec("k3-tp32-core", "bf16")
    for batch, copies in ((8, 0), (64, 2)):   # a 19 MB cache, a 151 MB one (context 2048)
        g = build(spec, Deployment(devices=1, tp=1, engine="multikernel", batch=batch, context=2048))
        j = g.name.index("mla_attention")
        cache = g.cache_bytes[int(g.layer[j])]
        assert cache == pytest.approx(batch * 2048 * 576 * 2, rel=0.01)
        tl = simulate_multikernel(g, hw)
        plain = simulate_multikernel(g, dataclasses.replace(hw, onchip_bytes=10 * cache))  # both on chip
        extra = (tl.end_s - tl.start_s)[j] - (plain.end_s - plain.start_s)[j]
        assert extra == pytest.approx(copies * copy(cache), rel=1e-6, abs=1e-12)


def test_the_kernels_embed_pick_is_charged_on_its_embedding_op():
    """The megakernel's pick of each sequence's embedding row out of its copied tile: the values its
    plan says it selects through (one select a bf16 tile row over [padded rows, hidden] f32) at the
    v5e's measured cost a value, on the embedding op alone; nothing where the plan has no pick or the
    hardware file never measured one."""
    import dataclasses
    from perfmodel.cost import components as cm
    from perfmodel.engine.megakernel import kernel_terms
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    from perfmodel_kernels import layout, plan, stream
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec("k3-tp32-core", "mxfp4")
    cfg = layout.KernelConfig(batch=3, max_context=256, tile=128, chip="v5e")
    values = plan.settings(spec, cfg)["embedding_pick_values"]
    assert values == 8 * stream.ROW_TILE * spec.hidden   # 3 sequences in one 8-row f32 tile
    g = build(spec, Deployment(devices=1, tp=1, engine="megakernel", batch=3, context=256))
    v5e, v7 = load_hardware("tpu-v5e"), load_hardware("tpu-v7")
    assert "embed_pick" not in kernel_terms(g, v5e)
    g.recipe = dataclasses.replace(g.recipe, embedding_pick_values=values)
    t = kernel_terms(g, v5e)["embed_pick"]
    j = g.name.index("embedding_gather")
    assert t[j] == pytest.approx(values * v5e.components["embed_pick_s"]) == cm.embed_pick_time(v5e.components, values)
    assert t.sum() == t[j] and 4e-6 < t[j] < 6e-6   # about the 5 us the chip's own pick_rows takes
    assert "embed_pick" not in kernel_terms(g, v7)
