"""GPU serving engines: kernel tables, the physical kernel fits, the engine's kernel lists,
layouts (attention DP, all-to-all EP, PP, two nodes) and the presets' assumed components."""
import dataclasses
import json

import numpy as np
import pytest

from perfmodel.cost import gpu_kernels as gk
from perfmodel.engine.serving import fabric_time, kernels
from perfmodel.graph import ops
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import list_presets, load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError

NEW_PRESETS = ("a100", "h20", "b300", "gb300", "mi300x", "mi325x", "mi355x")


def test_tables_carry_source_version_and_licence():
    for gpu in gk.gpus_with_tables():
        for engine in ("vllm", "sglang", "trtllm", "nccl"):
            path = gk.KERNEL_DIR / gpu / f"{engine}.json"
            if not path.exists():
                continue
            doc = json.loads(path.read_text())
            assert "aiconfigurator-core" in doc["source"] and doc["licence"].startswith("Apache-2.0")
            assert all("version" in m for m in doc["files"].values())


def test_interpolation_is_exact_on_grid_points_and_refuses_outside():
    tabs = gk.tables("gb200", "vllm")
    t = next(t for t in tabs.by_class["gemm"] if t.key["dtype"] == "bf16")
    point, secs = next(t.points())
    assert gk.interpolate(t, point) == pytest.approx(secs, rel=1e-9)
    assert gk.interpolate(t, {**point, "n": 10 * max(t.raw_axes["n"])}) is None


def test_interpolation_lies_between_neighbours():
    t = next(t for t in gk.tables("h100", "vllm").by_class["gemm"] if t.key["dtype"] == "bf16")
    lo, hi = gk.interpolate(t, {"m": 1, "n": 4096, "k": 4096}), gk.interpolate(t, {"m": 1, "n": 5120, "k": 4096})
    mid = gk.interpolate(t, {"m": 1, "n": 4600, "k": 4096})
    assert min(lo, hi) <= mid <= max(lo, hi)


@pytest.mark.parametrize("gpu", ["h100", "h200", "b200", "gb200", "b300", "gb300"])
def test_kernel_fit_residuals(gpu):
    """The stored fits (perfmodel calibrate --kernels --write) reproduce their own summary, and
    vLLM's kernels (the seed's engine) are fitted within 10 % (median) on every GPU."""
    doc = json.loads((gk.KERNEL_DIR / gpu / "fit.json").read_text())
    assert doc["summary"]["vllm"]["median_abs_residual"] <= 0.10
    assert doc["summary"]["nccl"]["median_abs_residual"] <= 0.10
    for engine, s in doc["summary"].items():
        assert s["median_abs_residual"] <= 0.13, (engine, s)  # SGLang / TRT-LLM on Hopper: 10-12 %


def test_physical_time_is_a_roofline_with_fixed_cost():
    p = {"fixed_s": 2e-6, "bytes_per_s": 1e12, "flops_per_s": 1e15}
    assert gk.physical_time(p, "kda", {"bytes": 1e6, "flops": 1e6, "ranks": 1}) == pytest.approx(2e-6 + 1e-6)
    assert gk.physical_time(p, "kda", {"bytes": 1e3, "flops": 1e10, "ranks": 1}) == pytest.approx(2e-6 + 1e-5)


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


def test_vllm_replicates_the_latent_projections_so_nothing_is_gathered():
    m, hw = load_model("kimi-k3"), load_hardware("gb200")
    d = _d()
    g = ops.build(m, d)
    ks = kernels(m, hw, d, g)
    assert not any(g.name[k.op] == "latent_all_gather" for k in ks)
    lat = next(k for k in ks if k.name == "latent_down_gemm")
    assert lat.point["n"] == m.moe.latent_dim  # whole on every rank


def test_serving_prediction_sums_its_kernels():
    m, hw = load_model("kimi-k3"), load_hardware("gb200")
    d = _d()
    p = predict(m, hw, d)
    ks = kernels(m, hw, d, ops.build(m, d))
    assert p.step_s == pytest.approx(sum(k.seconds for k in ks), rel=1e-9)


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
