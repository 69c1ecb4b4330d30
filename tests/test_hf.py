"""Hugging Face import: every real config.json fixture imports, with the model card's counts."""
import dataclasses
import json
from pathlib import Path

import pytest

from perfmodel.arch import load_model
from perfmodel.errors import SpecError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

# model card figures as stated (their precision sets the tolerance: 1 %, or half a unit of the
# last stated digit when the card rounds coarser than that) and the layer kinds expected
CARDS = {
    "qwen3-next-80b-a3b-thinking.json": ("80B", None, {"gdn+moe": 36, "gqa+moe": 12}),
    "qwen3.5-397b-a17b.json": ("397B", None, {"gdn+moe": 45, "gqa+moe": 15}),
    "qwen3-vl-235b-a22b-thinking.json": ("235B", "22B", {"gqa+moe": 94}),
    "kimi-k2-thinking.json": ("1T", None, {"mla+dense": 1, "mla+moe": 60}),
    "glm-4.7-fp8.json": ("355B", None, {"gqa+dense": 3, "gqa+moe": 89}),
    "llama-3.3-70b-instruct.json": ("70.6B", None, {"gqa+dense": 80}),
    "kimi-k2.5-int4.json": ("1T", "32B", {"mla+dense": 1, "mla+moe": 60}),
    "glm-4.7-flash.json": ("30B", None, {"mla+dense": 1, "mla+moe": 46}),
    "glm-5.1.json": ("744B", None, {"mla-dsa2048+dense": 3, "mla-dsa2048+moe": 75}),
    "deepseek-r1.json": ("671B", "37B", {"mla+dense": 3, "mla+moe": 58}),
    "mixtral-8x7b.json": ("46.7B", None, {"gqa+moe": 32}),
    "nemotron-3-nano-30b-a3b.json": ("31.6B", None, {"mamba2": 23, "moe": 23, "gqa": 6}),
    "kimi-k3.json": ("2.8T", None, {"kda+dense": 1, "kda+moe": 68, "mla+moe": 24}),
    "gpt-oss-20b.json": ("20.91B", "3.61B", {"gqa-swa128+moe": 12, "gqa+moe": 12}),
    "gpt-oss-120b.json": ("116.83B", "5.13B", {"gqa-swa128+moe": 18, "gqa+moe": 18}),
}


def figure(text: str) -> tuple[float, float]:
    """'70.6B' -> (70.6e9, tolerance): 1 %, or half a unit of the last stated digit if coarser."""
    scale = {"B": 1e9, "T": 1e12}[text[-1]]
    digits = text[:-1]
    unit = 10 ** -len(digits.partition(".")[2]) * scale
    value = float(digits) * scale
    return value, max(0.01 * value, unit / 2)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_fixture_imports_with_card_counts(name):
    total, active, kinds = CARDS[name]
    m = load_model(str(FIXTURES / name))
    value, tol = figure(total)
    assert abs(m.total_params - value) <= tol
    if active:
        value, tol = figure(active)
        assert abs(m.active_params - value) <= tol
    got = {}
    for layer in m.layers:
        got[m.layer_kind(layer)] = got.get(m.layer_kind(layer), 0) + 1
    assert got == kinds


def test_every_fixture_is_covered():
    assert {p.name for p in FIXTURES.glob("*.json")} == set(CARDS) | {"glm-5-fp8.json", "minimax-m1.json"}


def test_lightning_attention_is_refused():
    """MiniMax-M1 mixes lightning (linear) attention layers, which are not modelled."""
    with pytest.raises(SpecError) as e:
        load_model(str(FIXTURES / "minimax-m1.json"))
    assert e.value.field == "config.json:attn_type_list"


def test_deepseek_fp8_blocks_and_sparse_attention_cache():
    r1 = load_model(str(FIXTURES / "deepseek-r1.json"))
    assert r1.formats["routed_expert"].name == "fp8-block128"
    glm = load_model(str(FIXTURES / "glm-5.1.json"))
    assert glm.mla.index_topk == 2048 and glm.mla.index_heads == 32
    # per token and layer: the 512 + 64 latent and the indexer's 128-wide key, bf16
    assert glm.cache_bytes("mla", 1, 1) == (512 + 64 + 128) * 2


def test_released_kimi_k3_config_is_the_preset():
    """The released config (num_experts_per_token, num_shared_experts, routed_expert_hidden_size,
    MLA output gate, full-rank KDA gate, MXFP4 experts) gives the kimi-k3 preset's shapes exactly."""
    m, preset = load_model(str(FIXTURES / "kimi-k3.json")), load_model("kimi-k3")
    assert m.layers == preset.layers and m.kda == preset.kda and m.mla == preset.mla
    assert dataclasses.replace(m.moe, routing_skew=preset.moe.routing_skew) == preset.moe
    assert m.weight_bytes() == preset.weight_bytes() and m.formats["routed_expert"].name == "mxfp4"


def test_kimi_k25_int4_experts_only():
    """compressed-tensors int4, group 32, on the routed experts; attention, shared experts and the
    dense FFN stay bf16 (its `ignore` list)."""
    m = load_model(str(FIXTURES / "kimi-k2.5-int4.json"))
    f = m.formats
    assert f["routed_expert"].bits_per_value == 4.5 and f["attention"].name == f["shared_expert"].name == "bf16"


def test_sparse_attention_config_without_index_keys_is_refused():
    """GLM-5 uses DeepSeek sparse attention; the abridged config lacks the indexer's keys, so the
    importer refuses it instead of modelling dense MLA."""
    with pytest.raises(SpecError) as e:
        load_model(str(FIXTURES / "glm-5-fp8.json"))
    assert e.value.field == "config.json:index_n_heads"


def write(tmp_path, cfg) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def base_config(**extra):
    return {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 512, "vocab_size": 1000, **extra}


@pytest.mark.parametrize("extra,field", [
    ({"layer_types": ["full_attention", "ring_attention", "full_attention", "full_attention"]}, "config.json:layer_types"),
    ({"quantization_config": {"quant_method": "awq9"}}, "config.json:quantization_config.quant_method"),
    ({"hybrid_override_pattern": "M*X-", "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16},
     "config.json:hybrid_override_pattern"),
    ({"model_type": "deepseek_v32", "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
      "v_head_dim": 32}, "config.json:index_n_heads"),
    ({"attn_type_list": [0, 1, 1, 1]}, "config.json:attn_type_list"),
    ({"compress_ratios": [0, 4, 128, 0]}, "config.json:compress_ratios"),
    ({"num_kv_shared_layers": 2}, "config.json:num_kv_shared_layers"),
    ({"mamba_ssm_dtype": "float8"}, "config.json:mamba_ssm_dtype"),
    ({"num_hidden_layers": 20000}, "config.json:num_hidden_layers"),
    ({"hidden_size": None}, "config.json:hidden_size"),
    ({"hidden_size": 1.5}, "config.json:hidden_size"),
])
def test_cost_changing_keys_it_does_not_understand_are_errors(tmp_path, extra, field):
    with pytest.raises(SpecError) as e:
        load_model(write(tmp_path, base_config(**extra)))
    assert e.value.field == field


def test_undecodable_and_nonfinite_configs(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"hidden_size": 8\xff}')
    with pytest.raises(SpecError, match="UTF-8"):
        load_model(str(p))
    p.write_text('{"hidden_size": NaN}')
    with pytest.raises(SpecError):
        load_model(str(p))


def test_gpt_oss_style_config(tmp_path):
    """Alternating sliding / full layers, sinks, MXFP4 experts only, expert width = intermediate_size."""
    cfg = base_config(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
                      head_dim=64, layer_types=["sliding_attention", "full_attention"] * 2,
                      quantization_config={"quant_method": "mxfp4"})
    m = load_model(write(tmp_path, cfg))
    assert [m.layer_kind(l) for l in m.layers] == ["gqa-swa128+moe", "gqa+moe"] * 2
    assert m.gqa.sinks and m.moe.expert_width == 512
    assert m.formats["routed_expert"].name == "mxfp4" and m.formats["attention"].name == "bf16"


def test_nemotron_relu2_experts_have_no_gate():
    m = load_model(str(FIXTURES / "nemotron-3-nano-30b-a3b.json"))
    assert not m.ffn_gated and m.moe.shared_width == 3712 and m.formats["state"].name == "f32"
    assert m.mamba2.heads == 64 and m.mamba2.groups == 8 and m.mamba2.state_dim == 128


def test_nemotron_h_style_config(tmp_path):
    cfg = base_config(hybrid_override_pattern="M-*-", mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16,
                      n_groups=2, conv_kernel=4)
    m = load_model(write(tmp_path, cfg))
    assert [m.layer_kind(l) for l in m.layers] == ["mamba2", "dense", "gqa", "dense"]


def test_llama4_style_interleaved_moe(tmp_path):
    cfg = {"model_type": "llama4", "text_config": base_config(
        model_type="llama4_text", num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
        intermediate_size=128, intermediate_size_mlp=512, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0])}
    m = load_model(write(tmp_path, cfg))
    assert [l.ffn for l in m.layers] == ["dense", "moe"] * 2
    assert [m.layer_kind(l) for l in m.layers][2:] == ["gqa-swa8192+dense", "gqa+moe"]
    assert m.moe.shared_width == 128 and m.dense_width == 512
