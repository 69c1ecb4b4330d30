"""Property tests over random valid architectures, hardware and layouts (hypothesis)."""
import pytest
from hypothesis import given, settings, strategies as st

from perfmodel.graph.moe import expected_busiest_group, expected_distinct
from perfmodel.graph.ops import build
from perfmodel.spec.arch import from_dict
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.step.predict import predict

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def architectures(draw):
    n = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([4, 8]))
    kinds = draw(st.lists(st.sampled_from(["kda", "mla", "gqa"]), min_size=n, max_size=n))
    experts = draw(st.sampled_from([8, 16, 32]))
    d = {"name": "random", "hidden": draw(st.sampled_from([64, 128, 256])), "vocab": draw(st.integers(50, 5000)),
         "layers": n, "attention": {"default": "gqa"},
         "kda": {"heads": heads, "head_dim": 32, "decay_gate_rank": 16},
         "mla": {"heads": heads, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_nope_dim": 16, "qk_rope_dim": 8,
                 "v_head_dim": 16, "output_gate": draw(st.booleans())},
         "gqa": {"heads": heads, "kv_heads": draw(st.sampled_from([1, 2, 4])), "head_dim": 32,
                 "window": draw(st.sampled_from([0, 64]))},
         "ffn": {"dense_layers": [1] if draw(st.booleans()) else [], "dense_width": 256},
         "moe": {"experts": experts, "top_k": draw(st.integers(1, 8)), "expert_width": 64,
                 "shared_width": draw(st.sampled_from([0, 64])), "latent_dim": draw(st.sampled_from([0, 32])),
                 "routing_skew": draw(st.sampled_from([0.0, 0.5]))},
         "formats": {"routed_expert": draw(st.sampled_from(["bf16", "fp8", "mxfp4"]))}}
    for kind in ("kda", "mla"):
        d["attention"][f"{kind}_layers"] = [i + 1 for i, k in enumerate(kinds) if k == kind]
    return from_dict(d)


@st.composite
def cases(draw):
    m = draw(architectures())
    hw = load_hardware(draw(st.sampled_from(["tpu-v7", "gb200", "h100"])))
    devices = draw(st.sampled_from([1, 2, 4]))
    d = Deployment(devices=devices, tp=devices, ep=draw(st.sampled_from([1, devices])),
                   engine=draw(st.sampled_from(["megakernel", "multikernel"])), batch=draw(st.integers(1, 16)),
                   context=draw(st.integers(0, 2048)), expert_slots=1)
    return m, hw, d


@SETTINGS
@given(cases())
def test_step_time_is_above_the_roofline(case):
    m, hw, d = case
    p = predict(m, hw, d)
    flops = sum(r.flops for r in p.layers)
    floor = max(p.bytes_per_device / hw.core_hbm_bandwidth_bytes_per_s, flops / max(hw.core_flops_per_s.values()))
    assert p.timeline.step_s >= floor * (1 - 1e-9)


@SETTINGS
@given(cases(), st.floats(1.01, 8.0))
def test_more_bandwidth_is_never_slower(case, factor):
    m, hw, d = case
    faster = hw.replace(hbm_bandwidth_bytes_per_s=hw.hbm_bandwidth_bytes_per_s * factor)
    assert predict(m, faster, d).step_s <= predict(m, hw, d).step_s * (1 + 1e-9)


@SETTINGS
@given(cases())
def test_bytes_are_conserved_across_the_layer_table(case):
    m, hw, d = case
    p = predict(m, hw, d)
    g = build(m, d)
    for cls in ("static", "routed", "kv", "act"):
        total = getattr(g, f"{cls}_bytes").sum()
        assert sum(getattr(r, f"{cls}_bytes") for r in p.layers) == pytest.approx(total, rel=1e-9, abs=1e-6)
    if d.engine == "megakernel":  # activations stay on chip; everything else goes through the DMA
        moved = g.static_bytes.sum() + g.routed_bytes.sum() + g.kv_bytes.sum()
        assert p.bytes_per_device == pytest.approx(moved, rel=1e-9, abs=1e-6)
    assert sum(r.time_s for r in p.layers) == pytest.approx(p.timeline.step_s, rel=1e-9)


@SETTINGS
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 512), st.floats(0, 2))
def test_distinct_experts_within_k_and_e(experts_mult, top_k, tokens, skew):
    experts = top_k * experts_mult
    e = expected_distinct(experts, top_k, tokens, skew)
    assert top_k - 1e-9 <= e <= experts + 1e-9
    busiest, _ = expected_busiest_group(experts, top_k, tokens, 1, skew)
    assert abs(busiest - e) < 1e-6 * experts + 0.05 * e  # one group: the busiest is everything
