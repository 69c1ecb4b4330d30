"""Op graph: byte classes add up to the model's weights, FLOPs by hand, layout errors."""
import dataclasses

import pytest

from perfmodel.graph.ops import build
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError


def test_one_device_streams_every_weight_once():
    """Every weight matrix once, plus the gathered embedding row; the small vectors (norms, router
    bias, conv taps: < 0.01 % of the bytes) are left out of the op graph."""
    m = load_model("deepseek-v3")
    g = build(m, Deployment(devices=1, tp=1, batch=1))
    f = m.formats
    mats = [mm for l in m.layers for mm in m.layer_matmuls(l) if mm.family != "routed_expert"]
    expected = sum(mm.params * f[mm.family].bytes_per_value for mm in mats)
    expected += m.vocab * m.hidden * f["lm_head"].bytes_per_value + m.hidden * f["embedding"].bytes_per_value
    assert g.static_bytes.sum() == pytest.approx(expected)
    per_expert = 3 * m.hidden * m.moe.expert_width * f["routed_expert"].bytes_per_value
    assert g.routed_bytes.sum() == pytest.approx(8 * per_expert * m.count(ffn="moe"))  # batch 1: top-8


def test_byte_classes_sum_to_total():
    g = build(load_model("kimi-k3"), Deployment(devices=32, tp=32, ep=8, batch=4))
    assert g.bytes.sum() == pytest.approx(g.static_bytes.sum() + g.routed_bytes.sum() + g.kv_bytes.sum()
                                          + g.act_bytes.sum())


def test_gqa_flops_and_kv_by_hand():
    m = load_model("llama-3.1-8b")
    g = build(m, Deployment(devices=1, tp=1, batch=2, context=1000))
    core = [i for i, n in enumerate(g.name) if n == "gqa_attention"][0]
    assert g.flops[core] == 4.0 * 2 * 32 * 128 * 1000
    assert g.kv_bytes[core] == 2 * (1000 + 1) * 2 * 8 * 128 * 2
    q = [i for i, n in enumerate(g.name) if n == "q_proj"][0]
    assert g.flops[q] == 2.0 * 2 * 4096 * 4096 and g.static_bytes[q] == 4096 * 4096 * 2


def test_tp_shards_weights_and_adds_all_reduces():
    m = load_model("llama-3.1-8b")
    g1, g4 = build(m, Deployment(devices=1, tp=1)), build(m, Deployment(devices=4, tp=4))
    assert g4.static_bytes.sum() == pytest.approx(g1.static_bytes.sum() / 4, rel=1e-3)
    # two all-reduces a layer, the embedding's and the head's all-gather, the megakernel's entry barrier
    assert g1.is_collective.sum() == 0 and g4.is_collective.sum() == 2 * 32 + 2 + 1


@pytest.mark.parametrize("change,field", [
    (dict(tp=5), "tp"), (dict(tp=64, devices=64), "tp"), (dict(batch=0), "batch"),
    (dict(ep=7), "ep"), (dict(context=-1), "context"), (dict(devices=2, tp=2, ep=2), "devices"),
    (dict(engine="xla"), "engine"),
])
def test_impossible_layouts_name_the_field(change, field):
    d = dataclasses.replace(Deployment(devices=32, tp=32, ep=8), **change)
    with pytest.raises(SpecError) as e:
        validate(load_model("kimi-k3"), load_hardware("tpu-v7"), d)
    assert e.value.field == field


def test_the_shared_expert_runs_where_the_kernel_runs_it():
    """[megakernel] shared_expert: "with_copies" (the default) puts a MoE layer's shared expert after the
    latent down-projection, while the routed experts' copies land; "last" after the latent up-projection, as
    perfmodel_kernels' moe does (its plan says so); the same ops and bytes either way. Another value is
    refused naming the field."""
    from perfmodel.spec.recipe import from_table
    from perfmodel_kernels import plan as kplan
    from perfmodel_kernels.layout import KernelConfig
    from perfmodel_kernels.specs import slice_spec
    m = load_model("kimi-k3")
    d = Deployment(devices=32, tp=32, ep=8, batch=4)
    first, last = (build(dataclasses.replace(m, megakernel=from_table({"shared_expert": s})), d)
                   for s in ("with_copies", "last"))
    layer = next(int(x) for x, k in zip(first.layer, first.phase) if k == "moe")
    order = lambda g: [n for n, x in zip(g.name, g.layer) if x == layer and n in  # noqa: E731
                       ("latent_down", "shared_gate_up", "shared_down", "routed_experts", "latent_up")]
    assert order(first) == ["latent_down", "shared_gate_up", "shared_down", "routed_experts", "latent_up"]
    assert order(last) == ["latent_down", "routed_experts", "latent_up", "shared_gate_up", "shared_down"]
    assert sorted(first.name) == sorted(last.name) and first.static_bytes.sum() == last.static_bytes.sum()
    assert kplan.settings(slice_spec("k3-tp32-core", "mxfp4"), KernelConfig(batch=1, chip="v5e"))["shared_expert"] \
        == "last"
    with pytest.raises(SpecError, match="megakernel.shared_expert"):
        from_table({"shared_expert": "first"})
