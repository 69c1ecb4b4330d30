"""GPU serving engines: kernel tables, the physical kernel fits, the engine's kernel lists,
layouts (attention DP, all-to-all EP, PP, two nodes) and the presets' assumed components."""
import dataclasses
import json
import warnings

import numpy as np
import pytest

from perfmodel.cost import gpu_kernels as gk
from perfmodel.engine.serving import fabric_time, kernels
from perfmodel.graph import ops
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import list_presets, load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.step.serving_report import kernel_summary
from perfmodel.util.errors import SpecError

NEW_PRESETS = ("a100", "h20", "b300", "gb300", "mi300x", "mi325x", "mi355x")


def test_tables_carry_source_version_and_licence():
    found = 0
    for gpu in gk.gpus_with_tables():
        for engine in ("vllm", "sglang", "trtllm", "nccl"):
            doc = gk.provenance(gpu, engine)
            if not doc:
                continue
            found += 1
            assert "aiconfigurator-core" in doc["source"] and doc["licence"].startswith("Apache-2.0")
            assert doc["files"] and all("version" in m for m in doc["files"].values())
    assert found >= 7 * 3


def test_interpolation_is_exact_on_grid_points_and_refuses_outside():
    tabs = gk.tables("gb200", "vllm")
    t = next(t for t in tabs.of_class("gemm") if t.key["dtype"] == "bf16")
    point, secs = next(t.points())
    assert gk.interpolate(t, point) == pytest.approx(secs, rel=1e-9)
    assert gk.interpolate(t, {**point, "n": 10 * max(t.raw_axes["n"])}) is None


def test_interpolation_lies_between_neighbours():
    t = next(t for t in gk.tables("h100", "vllm").of_class("gemm") if t.key["dtype"] == "bf16")
    lo, hi = gk.interpolate(t, {"m": 1, "n": 4096, "k": 4096}), gk.interpolate(t, {"m": 1, "n": 5120, "k": 4096})
    mid = gk.interpolate(t, {"m": 1, "n": 4600, "k": 4096})
    assert min(lo, hi) <= mid <= max(lo, hi)


@pytest.mark.parametrize("gpu", ["a100", "h100", "h200", "b200", "gb200", "b300", "gb300"])
def test_kernel_fit_residuals(gpu):
    """The stored fits (perfmodel calibrate --kernels --write): every engine's median within 10 %
    on every GPU with tables."""
    doc = json.loads((gk.KERNEL_DIR / gpu / "fit.json").read_text())
    assert set(doc["summary"]) == {e for e in ("vllm", "sglang", "trtllm", "nccl") if gk.tables(gpu, e)}
    for engine, s in doc["summary"].items():
        assert s["median_abs_residual"] <= 0.10, (engine, s)


def test_stored_fits_reproduce_their_residuals():
    """Recomputed from the stored parameters and the tables, each fit group's median residual is
    the one fit.json states (GB200 vLLM: every group)."""
    from perfmodel.fit.kernels import _cells
    groups = gk.engine_fits("gb200", "vllm")
    for g, (cls, s, t) in _cells(gk.tables("gb200", "vllm")).items():
        res = gk.physical_time(groups[g], cls, s) / t - 1
        assert np.median(np.abs(res)) == pytest.approx(groups[g]["median_abs_residual"], rel=1e-3, abs=1e-4), g


def test_fits_stay_in_their_physical_ranges():
    """A group whose cells do not identify a term (here: every attention cell costs the same, so
    no bandwidth or rate is seen) keeps each parameter inside its bound, with no overflow on the
    way; and every stored parameter lies inside the bounds of its GPU (fit.json)."""
    from perfmodel.fit.kernels import bounds, fit_group, peaks
    bw, peak = peaks("h100")
    s = {"bytes": np.geomspace(1e4, 1e8, 40), "flops": np.geomspace(1e6, 1e10, 40), "ranks": np.ones(40),
         "units": np.full(40, 64.0), "cache": np.geomspace(1e4, 1e8, 40)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow or a division by zero fails the test
        params, _ = fit_group("attention", s, np.full(40, 5e-6), bw, peak)
    lo, hi = bounds("attention", bw, peak)
    for name, a, b in zip(gk.param_names("attention"), lo, hi):
        assert a * (1 - 1e-5) <= params[name] <= b * (1 + 1e-5), name
    for gpu in gk.gpus_with_tables():
        for engine in gk.fit_engines(gpu):
            for g, p in gk.engine_fits(gpu, engine).items():
                cls = g.split("/")[0]
                for name, a, b in zip(gk.param_names(cls), *bounds(cls, *peaks(gpu))):
                    assert a * (1 - 1e-5) <= p[name] <= b * (1 + 1e-5), (gpu, engine, g, name, p[name])


def test_physical_time_is_a_roofline_with_fixed_cost():
    p = {"fixed_s": 2e-6, "bytes_per_s": 1e12, "flops_per_s": 1e15}
    assert gk.physical_time(p, "kda", {"bytes": 1e6, "flops": 1e6, "ranks": 1}) == pytest.approx(2e-6 + 1e-6)
    assert gk.physical_time(p, "kda", {"bytes": 1e3, "flops": 1e10, "ranks": 1}) == pytest.approx(2e-6 + 1e-5)


def test_grouped_moe_overlap_is_a_p_norm_without_overflow():
    """overlap 0 adds loads and math, a large overlap is their roofline; a fit's trial point with a
    huge exponent and times above a second neither overflows nor warns."""
    s = {"bytes": 3e6, "flops": 4e9, "ranks": 1, "experts": 2.0, "pairs": 0.0}
    p = {"fixed_s": 1e-6, "bytes_per_s": 1e12, "flops_per_s": 1e12, "per_expert_s": 1e-7, "overlap": 0.0,
         "per_pair_s": 1e-8}
    assert gk.physical_time(p, "moe", s) == pytest.approx(1e-6 + 3e-6 + 4e-3 + 2e-7)
    assert gk.physical_time(p | {"overlap": 200.0}, "moe", s) == pytest.approx(1e-6 + 4e-3 + 2e-7, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = gk.physical_time(p | {"overlap": 5000.0, "bytes_per_s": 1.0}, "moe", s)
    assert np.isfinite(t) and t == pytest.approx(3e6, rel=1e-3)


def test_grouped_moe_pays_for_every_routed_pair_of_the_batch():
    """Expert parallelism divides a rank's experts, bytes and math, not the pairs its kernel sorts
    and launches blocks for: 64 tokens x top-8 cost 512 x per_pair_s at any EP degree."""
    p = {"fixed_s": 1e-6, "bytes_per_s": 1e12, "flops_per_s": 1e15, "per_expert_s": 0.0, "overlap": 100.0,
         "per_pair_s": 1e-8}
    key = {"dtype": "bf16", "experts": 256, "topk": 8, "hidden": 4096, "inter": 2048, "tp": 1}
    t = {ep: gk.physical_time(p, "moe", gk.shape("moe", key | {"ep": ep}, {"tokens": 64})) for ep in (1, 8)}
    for ep, secs in t.items():
        s = gk.shape("moe", key | {"ep": ep}, {"tokens": 64})
        assert s["pairs"] == 512
        assert secs == pytest.approx(1e-6 + max(s["bytes"] / 1e12, s["flops"] / 1e15) + 512 * 1e-8, rel=1e-6)
    assert t[8] < t[1]


def test_gemm_of_few_column_tiles_streams_at_their_bandwidth():
    """n / tile_n column tiles stream at most tile_bytes_per_s each: two tiles at 2 x 100 GB/s, many
    at the kernel's bandwidth; a single narrow tile at one tile's. Loads and math overlap as the
    `overlap` p-norm says."""
    p = {"fixed_s": 0.0, "bytes_per_s": 1e12, "flops_per_s": 1e18, "min_n": 1.0, "min_k": 1.0, "tile_n": 128.0,
         "tile_bytes_per_s": 1e11, "overlap": 100.0}
    gemm = lambda n: gk.physical_time(p, "gemm", {"m": 1, "n": n, "k": 4096, "bpv": 2.0})
    weights = lambda n: n * 4096 * 2.0 + 2.0 * (n + 4096)
    assert gemm(256) == pytest.approx(weights(256) / 2e11)
    assert gemm(16384) == pytest.approx(weights(16384) / 1e12)
    assert gemm(64) == pytest.approx(weights(64) / 1e11)
    # 16 rows, math as long as the weight loads: overlap 0 adds loads and math, a large one is the max
    shape = {"m": 16, "n": 16384, "k": 4096, "bpv": 2.0}
    loads = (16384 * 4096 * 2.0 + 2.0 * 16 * (16384 + 4096)) / 1e12
    p["flops_per_s"] = 2.0 * 16 * 16384 * 4096 / loads
    assert gk.physical_time(p | {"overlap": 0.0}, "gemm", shape) == pytest.approx(2 * loads)
    assert gk.physical_time(p | {"overlap": 200.0}, "gemm", shape) == pytest.approx(loads, rel=1e-2)


def _d(**kw):
    base = dict(devices=16, tp=16, ep=1, engine="multikernel", batch=1, serving_engine="vllm", routing_skew=0.0)
    return Deployment(**(base | kw))


def test_every_kernel_has_a_source_and_a_positive_time():
    m, hw = load_model("kimi-k3"), load_hardware("gb200")
    for engine in ("vllm", "sglang", "trtllm"):
        d = _d(serving_engine=engine)
        ks = kernels(m, hw, d, ops.build(m, d))
        assert ks and all(k.seconds > 0 and k.source for k in ks)
        assert any(k.measured for k in ks) and any(not k.measured for k in ks)
        names = {k.name for k in ks}
        assert "fused_moe" in names and ("mla_decode_module" in names or "mla_decode" in names)


def test_engines_split_experts_over_the_tp_ranks_unless_told_otherwise():
    """vLLM (no --enable-expert-parallel), SGLang (--ep-size 1) and TensorRT-LLM (moe_ep_size 1)
    split every expert over the tp ranks by default; all-to-all dispatch and the generic engine
    put whole experts on every device."""
    d = Deployment(devices=8, tp=8, engine="multikernel", serving_engine="sglang")
    assert d.expert_groups == 1
    assert dataclasses.replace(d, moe_comm="all_to_all").expert_groups == 8
    assert dataclasses.replace(d, serving_engine=None).expert_groups == 8
    assert dataclasses.replace(d, ep=4).expert_groups == 4


def test_sglang_runs_gpt_oss_experts_on_hopper_with_triton_kernels_at_ep_1():
    """At ep_size 1 SGLang runs MXFP4 experts on Hopper with OpenAI's triton_kernels, the kernel
    vLLM's table times (at 32 rows 133 us against its own fused_moe_triton's 320); at ep 8 it keeps
    its fused_moe_triton, its own table."""
    m, hw = load_model("gpt-oss-120b"), load_hardware("h100")

    def moe(ep):
        d = Deployment(devices=8, tp=8, ep=ep, engine="multikernel", batch=32, serving_engine="sglang")
        return next(k for k in kernels(m, hw, d, ops.build(m, d)) if k.name == "fused_moe")
    tp, ep = moe(None), moe(8)
    assert "vllm" in tp.source and "oaitritonmxfp4" in tp.source and tp.measured
    assert "sglang_fused_moe_triton" in ep.source and ep.measured
    assert tp.seconds == moe(1).seconds < 0.5 * ep.seconds


def test_vllm_runs_block_fp8_experts_on_hopper_with_triton_under_tp_and_flashinfer_cutlass_under_ep():
    """vLLM's block-fp8 MoE on Hopper: Triton fused_moe under tensor parallelism, priced as the
    Triton kernel SGLang adapted from it (the fit of its tables); FlashInfer CUTLASS experts at
    EP 8, vLLM's own table."""
    m, hw = load_model("deepseek-v3"), load_hardware("h200")

    def moe(ep):
        d = Deployment(devices=8, tp=8, ep=ep, engine="multikernel", batch=8, serving_engine="vllm")
        return next(k for k in kernels(m, hw, d, ops.build(m, d)) if k.name == "fused_moe")
    tp, ep = moe(1), moe(8)
    assert "sglang_fused_moe_triton" in tp.source.split(";")[0] and "Triton for TP" in tp.source
    assert "flashinfer" in ep.source.lower() and ep.measured


def test_vllm_replicates_the_latent_projections_so_nothing_is_gathered():
    m, hw = load_model("kimi-k3"), load_hardware("gb200")
    d = _d()
    g = ops.build(m, d)
    ks = kernels(m, hw, d, g)
    assert not any(g.name[k.op] == "latent_all_gather" for k in ks)
    lat = next(k for k in ks if k.name == "latent_down_gemm")
    assert lat.point["n"] == m.moe.latent_dim  # whole on every rank


def test_serving_prediction_sums_its_kernels():
    """The step is its kernels back to back, less what vLLM's second stream hides: each MoE layer's
    shared experts beside its routed experts (max_rows 256 in its inventory), so per MoE layer the
    longer of the two; at 512 rows, above the threshold, every kernel adds up. (The kernel overlap
    in the graph is off here: test_graph_overlap_hides_each_main_kernel_up_to_its_time.)"""
    m, hw = load_model("kimi-k3"), load_hardware("gb200").with_components(graph_kernel_overlap_s=0.0)
    for batch, overlap in ((1, True), (512, False)):
        d = _d(batch=batch)
        p, g = predict(m, hw, d), ops.build(m, d)
        ks = kernels(m, hw, d, g)
        shared = {}
        for k in ks:
            if g.name[k.op] in ("shared_gate_up", "shared_down"):
                assert k.stream == ("aux" if overlap else "main")
                shared[int(g.layer[k.op])] = shared.get(int(g.layer[k.op]), 0.0) + k.seconds
        routed = {int(g.layer[k.op]): k.seconds for k in ks if k.name == "fused_moe"}
        hidden = sum(min(s, routed[layer]) for layer, s in shared.items()) if overlap else 0.0
        assert shared and (hidden > 0) == overlap
        assert p.step_s == pytest.approx(sum(k.seconds for k in ks) - hidden, rel=1e-9)


def test_graph_overlap_hides_each_main_kernel_up_to_its_time():
    """components.graph_kernel_overlap_s: every main-stream kernel pays its time less the overlap,
    never below zero; the second stream is untouched. Hand-worked at 2 us (above the fastest
    kernels' 1.9 us, so the cap acts) against the same step with none."""
    m, d = load_model("kimi-k3"), _d(batch=1)
    none, hw = (load_hardware("gb200").with_components(graph_kernel_overlap_s=v) for v in (0.0, 2e-6))
    g = ops.build(m, d)
    ks = kernels(m, hw, d, g)
    main = [k.seconds for k in ks if k.stream == "main"]
    assert min(main) < 2e-6 < max(main)
    hidden = sum(min(2e-6, t) for t in main)
    assert predict(m, hw, d).step_s == pytest.approx(predict(m, none, d).step_s - hidden, rel=1e-9)
    assert kernel_summary(m, hw, d)["overlap_hidden_s"] == pytest.approx(hidden, rel=1e-9)


def test_two_nodes_are_one_node_plus_the_fabric():
    """DeepSeek-V3 TP16 on two HGX H100 nodes: each all-reduce is the 8-GPU kernel plus the fabric
    level; everything else is the same kernels as on one node of 16 (fictitious) NVLink GPUs."""
    m, hw = load_model("deepseek-v3"), load_hardware("h100")
    d = _d(devices=16, tp=16, ep=16)
    one = hw.replace(domain_devices=16, node_devices=16)
    g = ops.build(m, d)
    two_k, one_k = kernels(m, hw, d, g), kernels(m, one, d, g)
    assert len(two_k) == len(one_k)
    extra = 0.0
    for a, b in zip(two_k, one_k):
        if a.levels:
            assert a.levels[0][0] == "inside the NVLink domain"
            fab = fabric_time(hw, a.point["bytes"] / 8, 2, a.name.removeprefix("nccl_"))
            assert a.levels[1][1] == pytest.approx(fab)
            extra += fab
        else:
            assert a.seconds == pytest.approx(b.seconds)
    assert extra > 0


def test_a_layout_over_nodes_without_a_fabric_is_refused():
    m, hw = load_model("deepseek-v3"), load_hardware("h100").replace(fabric_bandwidth_bytes_per_s=0.0)
    with pytest.raises(SpecError, match="fabric_bandwidth_bytes_per_s"):
        predict(m, hw, _d(devices=16, tp=16, ep=16))


def test_attention_dp_gathers_tokens_and_all_to_all_dispatches():
    m, hw = load_model("deepseek-v3"), load_hardware("h200")
    dp = kernels(m, hw, _d(devices=8, tp=1, ep=8, batch=8), ops.build(m, _d(devices=8, tp=1, ep=8, batch=8)))
    assert {"nccl_all_gather", "nccl_reduce_scatter"} <= {k.name for k in dp}
    d = _d(devices=8, tp=1, ep=8, batch=8, moe_comm="all_to_all")
    a2a = kernels(m, hw, d, ops.build(m, d))
    assert {"deepep_ll_dispatch", "deepep_ll_combine"} <= {k.name for k in a2a}
    moe = next(k for k in a2a if k.name == "fused_moe")
    assert moe.point["tokens"] == 8  # every replica's row reaches the experts
    with pytest.raises(SpecError, match="ep"):
        predict(m, hw, _d(devices=8, tp=1, ep=4, batch=8, moe_comm="all_to_all"))


def test_pipeline_stages_add_their_sends():
    m, hw = load_model("llama-3.3-70b"), load_hardware("h100")
    one, two = _d(devices=8, tp=8, ep=None), _d(devices=16, tp=8, ep=None, pp=2)
    k2 = kernels(m, hw, two, ops.build(m, two))
    sends = [k for k in k2 if k.name == "pp_send"]
    assert len(sends) == 1 and "fabric" in sends[0].source  # stage 2 is on the second node
    p1, p2 = predict(m, hw, one), predict(m, hw, two)
    assert p2.step_s == pytest.approx(p1.step_s + sends[0].seconds, rel=1e-6)


def test_a_tp_split_that_breaks_quantisation_blocks_is_refused():
    m, hw = load_model("deepseek-v3"), load_hardware("h200")  # fp8 in 128 x 128 blocks
    with pytest.raises(SpecError, match=r"^tp=32:.*block"):
        predict(m, hw, _d(devices=32, tp=32, ep=1))  # 2048 / 32 = 64 per GPU


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_new_presets_load_predict_and_name_their_assumptions(name):
    hw = load_hardware(name)
    assert name in list_presets() and hw.kind == "gpu"
    assert any(k.startswith("components.") for k in hw.assumed)
    p = predict(load_model("llama-3.1-8b"), hw, Deployment(devices=1, tp=1, engine="multikernel", batch=1))
    assert p.step_s > 0
    p = predict(load_model("llama-3.1-8b"), hw, Deployment(devices=8, tp=8, engine="multikernel", batch=4,
                                                           serving_engine="vllm"))
    assert p.step_s > 0


def test_cli_predict_prints_the_assumptions_and_kernels(capsys):
    from perfmodel.cli.main import main
    assert main(["predict", "--model", "llama-3.1-8b", "--hardware", "mi355x", "--devices", "8", "--engine",
                 "multikernel", "--serving-engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "rests on assumed components" in out and "kernels per step" in out
    assert main(["explain", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--engine",
                 "multikernel", "--serving-engine", "vllm", "--layer", "2", "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)
    ks = [k for r in ex["ops"] for k in r.get("kernels", [])]
    assert ks and {k["measured"] for k in ks} == {True, False}
    assert main(["list"]) == 0
    assert "assumed components" in capsys.readouterr().out


def test_cli_attention_dp_must_multiply_out(capsys):
    from perfmodel.cli.main import main
    assert main(["predict", "--model", "deepseek-v3", "--hardware", "h200", "--devices", "8", "--tp", "2",
                 "--attention-dp", "8", "--engine", "multikernel", "--serving-engine", "sglang"]) == 2
    assert "--attention-dp" in capsys.readouterr().err


def _k3(batch=1):
    from perfmodel.spec.arch import derive
    m = derive("kimi-k3", formats={"kv_cache": "fp8-kv"})
    d = _d(batch=batch)
    return m, load_hardware("gb200"), d, kernels(m, load_hardware("gb200"), d, ops.build(m, d))


def test_vllm_on_gb200_runs_the_recipes_kernels():
    """The Dynamo recipe's vLLM on 16 GB200: MNNVL all-reduces across the trays, timed on GB300's
    fabric; the MoE as FlashInfer's TRT-LLM-gen kernel (not vLLM 0.24.0's Marlin stand-in); MLA
    kernel by kernel with kv_b absorbed; the fused latent tail at 1 row, not at 32."""
    m, hw, d, ks = _k3()
    names = {k.name for k in ks}
    assert "nccl_all_reduce" not in names and "custom_all_reduce" not in names
    ar = next(k for k in ks if k.name == "mnnvl_all_reduce")
    assert ar.measured and ar.source.startswith("table: gb300/") and "TRTLLM_MNNVL" in ar.source
    moe = next(k for k in ks if k.name == "fused_moe")
    assert moe.measured and "flashinfer_trtllm" in moe.source and "marlin" not in moe.source
    assert {"mla_absorb_q", "mla_decode", "mla_absorb_v", "q_b_gemm"} <= names and "kv_b_gemm" not in names
    assert "mla_decode_module" not in names and "output_gate_mul" in names
    g = ops.build(m, d)
    kda_gates = [k for k in ks if k.name == "output_gate_mul" and m.layers[int(g.layer[k.op]) - 1].attention == "kda"]
    assert not kda_gates  # KDA's output gate is inside fused_kda_decode
    assert {"latent_tail_collective", "latent_up_slice_gemm", "latent_tail_all_gather"} <= names
    up = next(k for k in ks if k.name == "latent_up_slice_gemm")
    assert up.point["n"] == m.hidden // 16 and up.point["k"] == m.moe.latent_dim
    _, _, _, ks32 = _k3(batch=32)  # above the tail's 16 rows: routed all-reduce, norm, whole up-projection
    names32 = {k.name for k in ks32}
    assert "latent_tail_collective" not in names32 and {"latent_rms_norm", "latent_up_gemm"} <= names32


def test_measured_as_falls_back_to_the_same_kernels_fit():
    """A kernel measured as another engine's, outside that table's grid, takes the fit of the same
    kernel source, never vLLM's own (Marlin) kernel's."""
    from perfmodel.engine.serving import Kernel, _cost
    from perfmodel.spec.engines import inventory
    hw, inv = load_hardware("gb200"), inventory("vllm")
    key = {"dtype": "mxfp4", "hidden": 3584, "inter": 3072, "topk": 16, "experts": 896, "tp": 16, "ep": 1}
    k = _cost(Kernel(0, "fused_moe", "moe", key, {"tokens": 4096}), hw, gk.tables("gb200", "vllm"), inv)
    fit = k.source.split(";")[0]  # the fit it took (the entry's reason follows)
    assert not k.measured and "flashinfer_trtllm" in fit and "marlin" not in fit.lower()


def test_kernel_tables_load_only_what_a_lookup_needs():
    tabs = gk.tables.__wrapped__("gb200", "sglang")  # a fresh, unshared instance
    assert not tabs.index and not tabs.built
    t = gk.table_time(tabs, "moe", {"dtype": "mxfp4", "hidden": 3584, "inter": 3072, "topk": 16, "experts": 896,
                                    "tp": 16, "ep": 1}, {"tokens": 1})
    assert t is not None and set(tabs.index) == {"moe"} and len(tabs.built) <= 2


def test_block_splits_are_refused_without_a_serving_engine_too():
    """DeepSeek-V3 (fp8 in 128 x 128 blocks) on 32 GPUs: the shared expert's 2048-wide down
    projection split 32 ways is 64 per GPU; on 16, every FFN split keeps whole blocks (MLA's down
    projections, which the generic op graph splits, engines keep whole)."""
    m, hw = load_model("deepseek-v3"), load_hardware("h200")
    with pytest.raises(SpecError, match=r"^tp=32: GPU serving engines .* shared_down .* 128-wide blocks"):
        predict(m, hw, Deployment(devices=32, tp=32, ep=1, engine="multikernel"))
    assert predict(m, hw, Deployment(devices=16, tp=16, ep=16, engine="multikernel")).step_s > 0
    g = load_model("gpt-oss-120b")  # MXFP4 experts 2880 wide over 8 GPUs: padded by the engines
    assert predict(g, load_hardware("h100"), Deployment(devices=8, tp=8, ep=1, engine="multikernel")).step_s > 0


def test_cli_kv_cache_format(capsys):
    from perfmodel.cli.main import main
    args = ["predict", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16", "--ep", "1",
            "--engine", "multikernel", "--serving-engine", "vllm", "--batch", "8", "--json"]
    steps = {}
    for kv in ("bf16", "fp8-kv"):
        assert main(args + ["--kv-cache", kv]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["inputs"]["kv_cache"] == kv
        steps[kv] = out["results"][0]["step_s"]
    assert steps["fp8-kv"] < steps["bf16"]  # half the MLA cache bytes
    assert main(args + ["--kv-cache", "fp9"]) == 2
    assert "--kv-cache='fp9'" in capsys.readouterr().err


def test_a_ranks_moe_share_is_at_least_one_pick_as_the_tables_time_it():
    """The MoE tables' balanced routing gives rank 0 expert 0's pick at every EP degree, so one
    token's cell at Kimi K2's shape (384 experts, top-8; H200 SGLang fp8) falls from EP 1 to 8
    (rank 0 holds 8, 4, 2, 1 picks) and stays from 8 to 16; `rank_share` counts the even share with
    that floor: one token at EP 16 is one pick and one expert, not half of one."""
    assert gk.rank_share(1, 8, 384, 8) == (1.0, 1.0)
    assert gk.rank_share(1, 8, 384, 16) == (1.0, 1.0)
    assert gk.rank_share(1, 8, 384, 2) == (4.0, 4.0)
    assert gk.rank_share(64, 8, 256, 8) == (32.0, 64.0)  # every expert touched: 256 / 8 a rank
    assert gk.rank_share(0, 8, 384, 8) == (0.0, 0.0)
    tabs = gk.tables("h200", "sglang")
    cell = {}
    for t in tabs.find("moe", {"hidden": 7168, "inter": 2048, "topk": 8, "experts": 384, "tp": 1,
                               "dtype": "fp8-block128"}, "sglang_fused_moe_triton"):
        cell[t.key["ep"]] = dict((p["tokens"], v) for p, v in t.points())[1]
    assert cell[1] > cell[2] > cell[4] > cell[8]
    assert cell[16] == pytest.approx(cell[8], rel=0.05)


def test_tables_that_route_the_balanced_logits_by_grouped_top_k_are_counted_so():
    """DeepSeek-V3's shape routes by grouped top-k (8 groups of 32, 4 kept). The collector's balanced
    logits give one token experts 0, 32, ..., 224 and tie the rest, so a kernel that routes them
    itself keeps groups 0-3 (picks 0, 32, 64, 96 and the tied experts of lowest index, 1-4): rank 0
    holds 8 picks at EP 1 and 2, 6 at EP 4 (0-4 and 32), 5 at EP 8 to 32, 4 at EP 64, 2 at 128, 1 at
    256. Such a table (B200 vLLM fp8: its one-token cell at EP 2 is its EP 1 cell) is fitted with that
    count; a kernel given the picks (B200 TensorRT-LLM DeepGEMM: EP 2 about half of EP 1) keeps the
    even share; a prediction prices the first by its physical fit, not by its collapsed cells."""
    picks = [gk.collector_share(1, 8, 256, ep, 8, 4)[1] for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert picks == [8, 8, 6, 5, 5, 5, 4, 2, 1]
    assert gk.collector_share(1, 8, 256, 4, 8, 4)[0] == 6
    key = {"hidden": 7168, "inter": 2048, "topk": 8, "experts": 256, "tp": 1, "ep": 8, "dtype": "fp8-block128"}
    vllm, trtllm = gk.tables("b200", "vllm"), gk.tables("b200", "trtllm")
    assert gk.grouped_routing(vllm, vllm.find("moe", key)[0]) == (8, 4)
    assert gk.grouped_routing(trtllm, trtllm.find("moe", key, "deepgemm")[0]) is None
    k2 = gk.tables("h200", "sglang").find("moe", {**key, "experts": 384})[0]
    assert gk.grouped_routing(gk.tables("h200", "sglang"), k2) is None  # Kimi K2's shape: no groups
    m = load_model("deepseek-v3")
    d = Deployment(devices=8, tp=8, ep=8, engine="multikernel", batch=1, serving_engine="vllm")
    moe = next(k for k in kernels(m, load_hardware("b200"), d, ops.build(m, d)) if k.name == "fused_moe")
    assert not moe.measured and moe.source.startswith("physical") and "grouped top-k" in moe.source
