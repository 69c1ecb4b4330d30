"""Architecture presets, parameter counts, storage formats and Hugging Face config loading."""
import json

import pytest

from perfmodel.spec.arch import from_dict, list_presets
from perfmodel.spec.formats import FORMATS
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

# published totals (docs/sources.md s.3; model cards) -> must match within 3 %
PUBLISHED = {"kimi-k3": 2.8e12, "kimi-k2": 1.0e12, "deepseek-v3": 671e9, "llama-3.1-8b": 8.03e9,
             "llama-3.2-1b": 1.235e9, "kimi-linear-48b": 48e9, "llama-3.3-70b": 70.6e9,
             "qwen3-235b-a22b": 235e9, "qwen3-next-80b-a3b": 80e9, "qwen3.5-397b-a17b": 397e9,
             "gpt-oss-120b": 116.83e9, "nemotron-3-nano-30b-a3b": 31.6e9}


@pytest.mark.parametrize("name,total", PUBLISHED.items())
def test_parameter_counts_match_published_totals(name, total):
    assert load_model(name).total_params == pytest.approx(total, rel=0.03)


def test_kimi_k3_layer_pattern():
    m = load_model("kimi-k3")
    assert len(m.layers) == 93 and m.count(attention="kda") == 69 and m.count(attention="mla") == 24
    assert [l.index for l in m.layers if l.attention == "mla"][-2:] == [92, 93]
    assert m.layers[0].ffn == "dense" and m.count(ffn="moe") == 92
    assert m.formats["routed_expert"].name == "mxfp4"


def test_format_bits_count_their_scales():
    assert FORMATS["mxfp4"].bits_per_value == 4.25   # e2m1 + 8-bit scale / 32
    assert FORMATS["nvfp4"].bits_per_value == 4.5    # e2m1 + fp8 scale / 16
    assert FORMATS["int4"].bits_per_value == 4.5     # int4 + bf16 scale / 32
    assert FORMATS["bf16"].bytes_per_value == 2


def test_routed_expert_bytes_of_k3():
    m = load_model("kimi-k3")
    per_expert = 3 * 3584 * 3072
    assert m.params_by_family()["routed_expert"] == 92 * 896 * per_expert
    assert m.weight_bytes() > m.params_by_family()["routed_expert"] * 4.25 / 8


def test_mini_preset_derives_from_k3():
    mini, k3 = load_model("kimi-k3-mini"), load_model("kimi-k3")
    assert mini.kda.conv_width == k3.kda.conv_width and mini.moe.top_k < mini.moe.experts
    assert {l.attention for l in mini.layers} == {"kda", "mla"} and mini.layers[0].ffn == "dense"
    assert mini.moe.experts >= 16


def test_every_preset_loads():
    assert set(PUBLISHED) | {"kimi-k3-mini"} <= set(list_presets())


def deepseek_config():
    return {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "vocab_size": 129280,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
            "intermediate_size": 18432, "quantization_config": {"quant_method": "fp8"}}


def test_hf_deepseek_config_matches_preset(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(deepseek_config()))
    m = load_model(str(p))
    assert m.total_params == load_model("deepseek-v3").total_params
    assert m.formats["routed_expert"].name == "fp8" and m.count(ffn="dense") == 3


def test_hf_llama_and_kimi_linear_configs(tmp_path):
    llama = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "vocab_size": 128256}
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "config.json").write_text(json.dumps(llama))
    assert load_model(str(tmp_path / "l")).total_params == load_model("llama-3.1-8b").total_params
    kl = dict(deepseek_config(), hidden_size=2304, num_hidden_layers=27, num_attention_heads=32,
              n_routed_experts=256, moe_intermediate_size=1024, first_k_dense_replace=1,
              intermediate_size=9216, q_lora_rank=None, vocab_size=163840,
              linear_attn_config={"kda_layers": [], "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                  "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4})
    kl.pop("quantization_config")
    (tmp_path / "k.json").write_text(json.dumps(kl))
    m = load_model(str(tmp_path / "k.json"))
    assert m.count(attention="mla") == 7 and m.count(attention="kda") == 20


@pytest.mark.parametrize("text,field", [
    ("{not json", "model file"),
    ("[1, 2]", "model file"),
    ('{"hidden_size": 8}', "config.json:num_hidden_layers"),
])
def test_malformed_hf_config_names_the_problem(tmp_path, text, field):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_model(str(p))
    assert e.value.field == field


@pytest.mark.parametrize("patch,field", [
    ({"moe": {"experts": 4, "top_k": 8, "expert_width": 16}}, "moe.top_k"),
    ({"hidden": -5}, "hidden"),
    ({"attention": {"default": "rnn"}}, "attention.default"),
    ({"attention": {"default": "gqa", "mla_layers": [99]}}, "attention.mla_layers"),
    ({"gqa": {"heads": 6, "kv_heads": 4, "head_dim": 8}}, "gqa.kv_heads"),
    ({"formats": {"attention": "fp3"}}, "formats.attention"),
    ({"megakernel": {"shard_collective_rows": [8, 0]}}, "megakernel.shard_collective_rows"),
    ({"megakernel": {"shard_collective_rows": 8}}, "megakernel.shard_collective_rows"),
    ({"megakernel": {"shard_rows": [8]}}, "megakernel.shard_rows"),
    ({"megakernel": {"collective_wire": "fp8"}}, "megakernel.collective_wire"),
    ({"megakernel": {"kv_prefetch": 1}}, "megakernel.kv_prefetch"),
    ({"megakernel": {"collective_rows": 0}}, "megakernel.collective_rows"),
])
def test_invalid_specs_name_field_and_value(patch, field):
    base = {"name": "t", "hidden": 64, "vocab": 100, "layers": 2, "gqa": {"heads": 4, "kv_heads": 2, "head_dim": 16},
            "ffn": {"dense_layers": [1], "dense_width": 128}, "moe": {"experts": 8, "top_k": 2, "expert_width": 32}}
    with pytest.raises(SpecError) as e:
        from_dict({**base, **patch})
    assert e.value.field == field


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(SpecError, match="kimi-k3"):
        load_model("gpt-17")


def test_megakernel_collective_rows_round_trip():
    from perfmodel.spec.arch import to_dict
    k3 = load_model("kimi-k3")
    assert k3.megakernel.shard_collective_rows == (8,)
    assert load_model("qwen3-235b-a22b").megakernel.shard_collective_rows is None
    assert from_dict(to_dict(k3)).megakernel.shard_collective_rows == (8,)
    ms = load_model("muse-spark")
    assert from_dict(to_dict(ms)).megakernel == ms.megakernel
