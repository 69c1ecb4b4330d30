"""Layer kinds by hand: bytes per layer for one layer of each kind, formats, routing, patterns."""
import tomllib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from perfmodel.graph.moe import expected_busiest_group, expected_distinct
from perfmodel.graph.ops import build
from perfmodel.spec.arch import derive, from_dict, to_toml
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.formats import FORMATS
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

ONE = Deployment(devices=1, tp=1, batch=1, context=1000)


def layer_bytes(m, index, d=ONE):
    g = build(m, d)
    sel = g.layer == index
    return g.static_bytes[sel].sum(), g.kv_bytes[sel].sum()


def tiny(**over):
    base = {"name": "t", "hidden": 256, "vocab": 1000, "layers": 2, "ffn": {"dense_width": 512},
            "gqa": {"heads": 4, "kv_heads": 2, "head_dim": 64}}
    return from_dict({**base, **over})


def test_gqa_layer_by_hand():
    """Llama-3.3-70B: q, k, v, o and the SwiGLU FFN in bf16; K and V of 1000 + 1 tokens."""
    m = load_model("llama-3.3-70b")
    static, kv = layer_bytes(m, 5)
    h, q, k, w = 8192, 64 * 128, 8 * 128, 28672
    assert static == 2 * (h * q + 2 * h * k + q * h + 3 * h * w)
    assert kv == (1000 + 1) * 2 * 8 * 128 * 2


def test_sliding_window_layer_is_bounded_by_its_window():
    m = tiny(attention={"pattern": ["swa", "gqa"], "swa": {"type": "gqa", "window": 128}})
    assert [m.layer_kind(l) for l in m.layers] == ["gqa-swa128+dense", "gqa+dense"]
    _, kv_swa = layer_bytes(m, 1)
    _, kv_full = layer_bytes(m, 2)
    assert kv_swa == (128 + 1) * 2 * 2 * 64 * 2 and kv_full == (1000 + 1) * 2 * 2 * 64 * 2


def test_output_gate_and_sinks_on_gqa():
    gated = tiny(gqa={"heads": 4, "kv_heads": 2, "head_dim": 64, "output_gate": True, "sinks": True})
    plain = tiny()
    (g, _), (p, _) = layer_bytes(gated, 1), layer_bytes(plain, 1)
    assert g - p == 2 * 256 * 4 * 64      # the gate projection, bf16
    assert gated.total_params - plain.total_params == 2 * (256 * 256 + 4)  # gate + one sink per head


def test_keys_equal_values_layer_by_hand():
    """Gemma 4 global layers (`k_eq_v`): q, k and o, no v projection; the cache still holds K and
    V (V is the normed, un-rotated K, a tensor of its own)."""
    m = tiny(gqa={"heads": 4, "kv_heads": 2, "head_dim": 64, "k_eq_v": True})
    static, kv = layer_bytes(m, 1)
    h, q, k, w = 256, 4 * 64, 2 * 64, 512
    assert static == 2 * (h * q + h * k + q * h + 3 * h * w)
    assert kv == (1000 + 1) * 2 * 2 * 64 * 2


def test_sliding_variant_with_its_own_heads_by_hand():
    """MiMo-V2 style: the sliding layers have more KV heads and sinks; queries and keys 96 wide,
    values 64."""
    m = tiny(gqa={"heads": 4, "kv_heads": 2, "head_dim": 96, "v_head_dim": 64},
             attention={"pattern": ["swa", "gqa"], "swa": {"type": "gqa", "window": 128, "kv_heads": 4, "sinks": True}})
    (s_swa, kv_swa), (s_full, kv_full) = layer_bytes(m, 1), layer_bytes(m, 2)
    h, w = 256, 512
    assert s_swa == 2 * (h * 4 * 96 + h * 4 * 96 + h * 4 * 64 + 4 * 64 * h + 3 * h * w)
    assert s_full == 2 * (h * 4 * 96 + h * 2 * 96 + h * 2 * 64 + 4 * 64 * h + 3 * h * w)
    assert kv_swa == (128 + 1) * 4 * (96 + 64) * 2 and kv_full == (1000 + 1) * 2 * (96 + 64) * 2


def test_gated_deltanet_layer_by_hand():
    """Qwen3-Next: separate key (16 x 128) and value (32 x 128) heads; f32 state 32 x 128 x 128."""
    m = load_model("qwen3-next-80b-a3b")
    assert m.layer_kind(m.layers[0]) == "gdn+moe"
    g = build(m, ONE)
    ops = {n: j for j, n in enumerate(g.name) if g.layer[j] == 1}
    h, k, v = 2048, 16 * 128, 32 * 128
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "beta_alpha_proj", "o_proj")
    assert sum(g.static_bytes[ops[n]] for n in names) == 2 * (2 * h * k + 2 * h * v + h * 64 + v * h)
    state = 32 * 128 * 128 * 4 + (2 * k + v) * 3 * 2   # f32 state + bf16 conv window
    assert g.kv_bytes[ops["gdn_recurrence"]] == 2 * state  # read and written back


def test_mamba2_layer_by_hand():
    m = tiny(attention={"default": "mamba2"}, ffn={"none_layers": [1, 2]},
             mamba2={"heads": 8, "head_dim": 32, "state_dim": 16, "groups": 2, "conv_width": 4})
    assert m.layer_kind(m.layers[0]) == "mamba2"
    static, kv = layer_bytes(m, 1)
    inner = 8 * 32
    assert static == 2 * (256 * (2 * inner + 2 * 2 * 16 + 8) + inner * 256)
    assert kv == 2 * (inner * 16 * 4 + (inner + 2 * 2 * 16) * 3 * 2)  # state read and written


def test_mla_and_sparse_attention_by_hand():
    """DeepSeek sparse attention: the indexer reads every cached index key, MLA only the top-k."""
    mla = {"heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_dim": 16, "qk_rope_dim": 8,
           "v_head_dim": 16}
    dense = tiny(attention={"default": "mla"}, mla=mla)
    sparse = tiny(attention={"default": "mla"}, mla={**mla, "index_heads": 2, "index_head_dim": 16, "index_topk": 100})
    assert sparse.layer_kind(sparse.layers[0]) == "mla-dsa100+dense"
    (s0, kv0), (s1, kv1) = layer_bytes(dense, 1), layer_bytes(sparse, 1)
    assert kv0 == (1000 + 1) * (32 + 8) * 2
    assert kv1 == (100 + 1) * (32 + 8) * 2 + (1000 + 1) * 16 * 2
    assert s1 - s0 == 2 * (64 * 2 * 16 + 256 * 16 + 256 * 2)  # index_q, index_k, index_weights


def test_block_sparse_gqa_by_hand():
    """Block-sparse GQA (MiniMax-M3 style): the indexer reads every cached index key, the KV heads
    only the top-k tokens; index_q (2 heads x 16) and index_k (16) add to the projections."""
    sparse = tiny(attention={"default": "gqa"},
                  gqa={"heads": 4, "kv_heads": 2, "head_dim": 64, "index_heads": 2, "index_head_dim": 16,
                       "index_topk": 100})
    dense = tiny()
    assert sparse.layer_kind(sparse.layers[0]) == "gqa-msa100+dense"
    (s0, kv0), (s1, kv1) = layer_bytes(dense, 1), layer_bytes(sparse, 1)
    assert kv0 == (1000 + 1) * 2 * 2 * 64 * 2
    assert kv1 == (100 + 1) * 2 * 2 * 64 * 2 + (1000 + 1) * 16 * 2
    assert s1 - s0 == 2 * (256 * 2 * 16 + 256 * 16)


def test_router_hi_lo_pair_doubles_router_bytes_not_params():
    one = derive("kimi-k3-mini")
    two = derive("kimi-k3-mini", moe={"router_copies": 2})
    assert one.total_params == two.total_params
    g1, g2 = build(one, ONE), build(two, ONE)
    r = [i for i, n in enumerate(g1.name) if n == "router"][0]
    assert g2.static_bytes[r] == 2 * g1.static_bytes[r] and g2.flops[r] == 2 * g1.flops[r]


def test_formats_count_their_scales_exactly():
    f = FORMATS
    assert f["int4-g128-f32"].tensor_bytes(256, 8) == (256 * 8 * 4 + 8 * 2 * 32) / 8
    assert f["int8-channel"].tensor_bytes(100, 8) == 100 * 8 + 8 * 4
    assert f["fp8-block128"].tensor_bytes(300, 200) == 300 * 200 + 3 * 2 * 4
    assert f["nvfp4"].tensor_bytes(32, 2) == (64 * 4 + 4 * 8 + 32) / 8
    assert f["nvfp4"].bits_per_value == 4.5 and f["mxfp4"].bits_per_value == 4.25


def test_user_defined_format_in_toml():
    m = tiny(custom_formats={"int3-g64": {"value_bits": 3, "scale_dtype": "fp16", "block": [1, 64]}},
             formats={"dense_ffn": "int3-g64"})
    assert m.formats["dense_ffn"].bits_per_value == 3 + 16 / 64
    with pytest.raises(SpecError) as e:
        tiny(custom_formats={"bad": {"value_bits": 3, "block": [1, -1]}})
    assert e.value.field == "custom_formats.bad.block"
    with pytest.raises(SpecError) as e:  # a list where a dtype name goes (found by make fuzz)
        tiny(custom_formats={"bad": {"value_bits": 4, "scale_dtype": [], "block": [1, 32]}})
    assert e.value.field == "custom_formats.bad.scale_dtype"


@pytest.mark.parametrize("over,field", [
    ({"layers": 20000}, "layers"),
    ({"attention": {"default": "gqa", "pattern": ["gqa", "rnn"]}}, "attention.pattern"),
    ({"gqa": {"heads": 4, "kv_heads": 2, "head_dim": float("inf")}}, "gqa.head_dim"),
    ({"moe": {"experts": 4, "top_k": 2, "expert_width": 8, "routing_skew": float("nan")}}, "moe.routing_skew"),
    ({"moe": {"experts": 4, "top_k": 2, "expert_width": 8, "routing_correlation": 1.5}}, "moe.routing_correlation"),
    ({"attention": {"swa": {"type": "rnn"}}}, "attention.swa.type"),
    ({"ffn": {"dense_width": 512, "patern": ["dense"]}}, "ffn.patern"),
])
def test_bad_fields_name_themselves(over, field):
    with pytest.raises(SpecError) as e:
        tiny(**over)
    assert e.value.field == field


def test_base_cycle_is_an_error(tmp_path, monkeypatch):
    import perfmodel.spec.arch as arch
    (tmp_path / "a.toml").write_text('base = "b"\nname = "a"\n')
    (tmp_path / "b.toml").write_text('base = "a"\nname = "b"\n')
    monkeypatch.setattr(arch, "PRESET_DIR", tmp_path)
    with pytest.raises(SpecError, match="cycle") as e:
        load_model("a")
    assert e.value.field == "base"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["gqa", "swa", "gdn", "mamba2", "mla", "kda", "none"]), min_size=1, max_size=12),
       st.lists(st.sampled_from(["dense", "moe", "none"]), min_size=1, max_size=12), st.integers(1, 12))
def test_any_valid_layer_pattern_round_trips_through_toml(attn, ffn, n):
    m = tiny(layers=n, attention={"pattern": attn[:n], "swa": {"type": "gqa", "window": 64}},
             ffn={"pattern": ffn[:n], "dense_width": 512},
             gdn={"key_heads": 2, "value_heads": 4, "key_head_dim": 32, "value_head_dim": 32},
             mamba2={"heads": 4, "head_dim": 16, "state_dim": 8},
             kda={"heads": 4, "head_dim": 32},
             mla={"heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_dim": 16, "qk_rope_dim": 8,
                  "v_head_dim": 16},
             moe={"experts": 8, "top_k": 2, "expert_width": 32})
    back = from_dict(tomllib.loads(to_toml(m)))
    assert back == m and [back.layer_kind(l) for l in back.layers] == [m.layer_kind(l) for l in m.layers]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(16, 2), (64, 8), (896, 16), (256, 8)]), st.integers(1, 4096),
       st.sampled_from([0.0, 0.7]))
def test_identical_routing_touches_exactly_top_k_experts(ek, batch, skew):
    experts, top_k = ek
    assert expected_distinct(experts, top_k, batch, skew, correlation=1.0) == pytest.approx(top_k, rel=1e-9)
    assert expected_busiest_group(experts, top_k, batch, 1, skew, 1.0)[0] == pytest.approx(top_k, rel=1e-9)


def test_correlation_interpolates_between_independent_and_identical():
    d = [expected_distinct(256, 8, 16, 0.0, rho) for rho in (0.0, 0.5, 1.0)]
    assert d[0] == pytest.approx(256 * (1 - (1 - 8 / 256) ** 16)) and d[0] > d[1] > d[2] == pytest.approx(8)


def test_identical_routing_streams_top_k_experts_at_every_batch():
    m = derive("kimi-k3-mini")
    per_layer = [build(m, Deployment(devices=1, tp=1, ep=1, batch=b, routing_correlation=1.0)).routed_bytes.max()
                 for b in (1, 4, 64)]
    expert = 3 * m.moe.latent_dim * m.moe.expert_width * 2
    assert per_layer == pytest.approx([m.moe.top_k * expert] * 3)


def test_megakernel_predicts_deepseek_v3_ep8_with_tiled_experts():
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import expert_tiling_cost, predict
    m = load_model("deepseek-v3")
    for hw in ("gb200", "tpu-v7"):
        d = Deployment(devices=8, tp=8, ep=8, batch=1)
        p = predict(m, load_hardware(hw), d)
        assert p.timeline.sizing.tiles_per_expert > 1 and p.tokens_per_s > 0
        cost = expert_tiling_cost(m, load_hardware(hw), p)
        assert cost["tiles_per_expert"] == p.timeline.sizing.tiles_per_expert


def test_tiling_cost_gives_whole_experts_room_despite_rounding():
    """An expert of a fractional byte count (bytes / distinct experts): the comparison chip holds the
    ring and the whole-expert buffers exactly, which floating point once left a byte short of the
    second buffer (qwen3-235b-a22b on h100, batch 1: a refusal instead of a prediction)."""
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import expert_tiling_cost, predict
    m, hw = load_model("qwen3-235b-a22b"), load_hardware("h100")
    p = predict(m, hw, Deployment(devices=8, tp=8, ep=8, batch=1))
    assert p.timeline.sizing.expert_bytes % 1 != 0 and p.timeline.sizing.tiles_per_expert > 1
    cost = expert_tiling_cost(m, hw, p)
    assert cost["expert_slots"] == p.timeline.sizing.slots and cost["whole_expert_step_s"] > 0


def test_kda_layer_by_hand():
    """Kimi K3 layer 2: q, k, v, low-rank decay, beta, full-rank output gate, o; f32 state."""
    m = load_model("kimi-k3")
    g = build(m, ONE)
    ops = {n: j for j, n in enumerate(g.name) if g.layer[j] == 2 and g.phase[j] == "attention"}
    h, v = 7168, 96 * 128
    assert sum(g.static_bytes[j] for j in ops.values()) == 2 * (3 * h * v + h * 128 + 128 * v + h * 96 + h * v + v * h)
    assert g.kv_bytes[ops["kda_recurrence"]] == 2 * 96 * (128 * 128 * 4 + 3 * 128 * 3 * 2)


def test_moe_layer_with_custom_formats_by_hand():
    """The 62-layer example: int4 experts with f32 scales per 128 inputs, NVFP4 shared experts,
    a bf16 router kept as a hi/lo pair; one row picks top-8 experts."""
    m = load_model("docs/examples/gated-swa-moe-62l.toml")
    g = build(m, Deployment(devices=1, tp=1, ep=1, batch=1, context=1000))
    ops = {n: j for j, n in enumerate(g.name) if g.layer[j] == 2 and g.phase[j] == "moe"}
    h, w = 6144, 2048
    int4 = lambda d_in, d_out: (d_in * d_out * 4 + d_out * (d_in // 128) * 32) / 8
    assert g.routed_bytes[ops["routed_experts"]] == pytest.approx(8 * (int4(h, 2 * w) + int4(w, h)))
    nvfp4 = lambda d_in, d_out: (d_in * d_out * 4 + d_out * (d_in // 16) * 8 + 32) / 8
    assert g.static_bytes[ops["shared_gate_up"]] == nvfp4(h, 2 * w)
    assert g.static_bytes[ops["router"]] == 2 * 2 * h * 256


def test_deepseek_v4_layers_by_hand():
    """DeepSeek-V4-Flash, one layer of each attention kind, attention phase only (1000 tokens, one
    sequence). Matrices: fp8 128x128 blocks with an f32 scale each (the grouped o_a: one per group),
    except the compressor projections (f32); the hyper-connection map
    before the sublayer reads 24 x 16384 f32 weights. Cache: bf16, the compressor state f32."""
    m = load_model("tests/fixtures/hf/deepseek-v4-flash.json")
    fp8 = lambda i, o: i * o + 4 * -(-i // 128) * -(-o // 128)
    h, ql, d, ih = 4096, 1024, 512, 128
    base = fp8(h, ql) + fp8(ql, 64 * d) + fp8(h, d) + 8 * fp8(64 * d // 8, 1024) + fp8(8 * 1024, h) \
        + 24 * 4 * h * 4
    g = build(m, ONE)

    def attention(layer):
        sel = (g.layer == layer) & np.array([p == "attention" for p in g.phase])
        return g.static_bytes[sel].sum(), g.kv_bytes[sel].sum()

    assert [m.layer_kind(m.layers[i - 1]) for i in (1, 3, 4)] == ["swa128+moe", "csa4+moe", "hca128+moe"]
    static, kv = attention(1)  # window only: 128 tokens read, the new one written
    assert static == base and kv == (128 + 1) * d * 2
    static, kv = attention(3)  # CSA: 250 entries, all within the top 512, and 250 index keys
    assert static == base + 4 * 2 * h * 2 * d + fp8(ql, 64 * ih) + fp8(h, 64) + 4 * 2 * h * 2 * ih
    state = 2 * 8 * 2 * d + 2 * 8 * 2 * ih  # two overlapping blocks of 4, values and scores
    compressor = 2 * 2 * (d + ih) * 4 + (state * 4 + (d + ih) * 2) / 4  # row written; block read / 4
    assert kv == pytest.approx((128 + 250 + 1) * d * 2 + 250 * ih * 2 + compressor)
    static, kv = attention(4)  # HCA: every one of the 7 entries
    assert static == base + 4 * 2 * h * d
    compressor = 2 * d * 4 + (2 * 128 * d * 4 + d * 2) / 128
    assert kv == pytest.approx((128 + 7 + 1) * d * 2 + compressor)
