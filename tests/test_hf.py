"""Hugging Face import: every real config.json fixture imports, with the model card's counts."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

# model card figures as stated (their precision sets the tolerance: 1 %, or half a unit of the
# last stated digit when the card rounds coarser than that), the layer kinds expected, and how
# the card counts: "vision" = its total includes a vision tower the importer does not model (the
# test adds a hand count of the tower's layers); "embedding" = its active count includes the
# embedding table (perfmodel's, like the gpt-oss card's, leaves the unread rows out)
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
    "deepseek-v3.2-nvfp4.json": ("671B", "37B", {"mla-dsa2048+dense": 3, "mla-dsa2048+moe": 58}),
    "llama-4-scout-17b-16e-instruct.json": ("109B", "17B", {"gqa-swa8192+moe": 36, "gqa+moe": 12},
                                            {"vision", "embedding"}),
    "llama-4-maverick-17b-128e-instruct.json": ("400B", "17B", {"gqa-swa8192+dense": 24, "gqa-swa8192+moe": 12,
                                                                "gqa+moe": 12}, {"vision", "embedding"}),
    "mimo-v2-flash.json": ("309B", "15B", {"gqa+dense": 1, "gqa+moe": 8, "gqa-swa128+moe": 39}),
    "minimax-m2.5.json": ("230B", "10B", {"gqa+moe": 62}),
    "nemotron-h-56b-base-8k.json": ("56B", None, {"mamba2": 54, "dense": 54, "gqa": 10}),
    "qwen3-32b-fp8-static.json": ("32.8B", None, {"gqa+dense": 64}),
    "gemma-4-26b-a4b.json": ("25.2B", "3.8B", {"gqa-swa1024+moe": 25, "gqa+moe": 5}, {"embedding"}),
    "gemma-4-31b-it-nvfp4.json": ("30.7B", "30.7B", {"gqa-swa1024+dense": 50, "gqa+dense": 10}, {"embedding"}),
    "nemotron-3-super-120b-a12b-nvfp4.json": ("120B", "12B", {"mamba2": 40, "moe": 40, "gqa": 8}),
    "qwen3-235b-a22b-fp8.json": ("235B", "22B", {"gqa+moe": 94}),
    "deepseek-v4-flash.json": ("284B", "13B", {"swa128+moe": 2, "csa4+moe": 21, "hca128+moe": 20}),
    "deepseek-v4-pro.json": ("1.6T", "49B", {"csa4+moe": 30, "hca128+moe": 31}),
    "minimax-m3.json": ("428B", None, {"gqa+dense": 3, "gqa-msa2048+moe": 57}),
}
REFUSED = {  # real configs of mechanisms the importer does not model: the key it names
    "glm-5-fp8.json": "config.json:index_n_heads",       # abridged: sparse attention without its indexer
    "minimax-m1.json": "config.json:attn_type_list",     # lightning attention
}


def figure(text: str) -> tuple[float, float]:
    """'70.6B' -> (70.6e9, tolerance): 1 %, or half a unit of the last stated digit if coarser."""
    scale = {"B": 1e9, "T": 1e12}[text[-1]]
    digits = text[:-1]
    unit = 10 ** -len(digits.partition(".")[2]) * scale
    value = float(digits) * scale
    return value, max(0.01 * value, unit / 2)


def vision_tower_params(path: Path) -> int:
    """Hand count of the vision tower's layers: q, k, v, o (h x h) and the MLP (2 x h x i) per layer
    (its patch embedding and projector, under 1 % of it, left out)."""
    v = json.loads(path.read_text())["vision_config"]
    h, i = v["hidden_size"], v["intermediate_size"]
    return v["num_hidden_layers"] * (4 * h * h + 2 * h * i)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_fixture_imports_with_card_counts(name):
    total, active, kinds, counts = (*CARDS[name], set())[:4]
    m = load_model(str(FIXTURES / name))
    value, tol = figure(total)
    unmodelled = vision_tower_params(FIXTURES / name) if "vision" in counts else 0
    assert abs(m.total_params + unmodelled - value) <= tol
    if active:
        value, tol = figure(active)
        embedding = (m.vocab - 1) * m.hidden if "embedding" in counts else 0
        assert abs(m.active_params + embedding - value) <= tol
    got = {}
    for layer in m.layers:
        got[m.layer_kind(layer)] = got.get(m.layer_kind(layer), 0) + 1
    assert got == kinds


def test_every_fixture_is_covered():
    assert {p.name for p in FIXTURES.glob("*.json")} == set(CARDS) | set(REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unmodelled_mechanisms_are_refused_naming_the_key(name):
    with pytest.raises(SpecError) as e:
        load_model(str(FIXTURES / name))
    assert e.value.field == REFUSED[name]


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
    ({"compress_ratios": [0, 4, 128]}, "config.json:compress_ratios"),  # one ratio short
    ({"expert_dtype": "fp2"}, "config.json:expert_dtype"),
    ({"sparse_attention_config": {"use_sparse_attention": True, "sparse_attention_freq": [0, 1, 1, 1],
                                  "sparse_disable_index_value": [0, 1, 0, 1], "sparse_block_size": 16,
                                  "sparse_num_index_heads": 2, "sparse_index_dim": 32, "sparse_topk_blocks": 4}},
     "config.json:sparse_attention_config.sparse_disable_index_value"),  # an index value branch
    ({"num_kv_shared_layers": 2}, "config.json:num_kv_shared_layers"),
    ({"mamba_ssm_dtype": "float8"}, "config.json:mamba_ssm_dtype"),
    ({"num_hidden_layers": 20000}, "config.json:num_hidden_layers"),
    ({"num_key_value_heads": float("nan")}, "config.json:num_key_value_heads"),
    ({"hidden_size_per_layer_input": 256}, "config.json:hidden_size_per_layer_input"),
    ({"hybrid_layer_pattern": [0, 1, 2, 1], "sliding_window": 8}, "config.json:hybrid_layer_pattern"),
    ({"attention_chunk_size": 64, "no_rope_layers": [1, 1, 0]}, "config.json:no_rope_layers"),
    ({"quantization_config": {"quant_algo": "FP8", "producer": {"name": "modelopt"}, "kv_cache_scheme": "INT4"}},
     "config.json:quantization_config.kv_cache_scheme"),
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


def test_nemotron_h_56b_mamba_mlp_attention_blocks():
    """The published file holds `Infinity` (time_step_limit): a key no cost reads, so it imports;
    attention reads `attention_head_dim`, the MLP blocks are relu2 (up and down only)."""
    m = load_model(str(FIXTURES / "nemotron-h-56b-base-8k.json"))
    assert m.mamba2.heads * m.mamba2.head_dim == 2 * m.hidden and m.mamba2.state_dim == 256
    assert m.gqa.head_dim == 128 and m.gqa.kv_heads == 8 and not m.ffn_gated and m.dense_width == 32768


def test_llama4_without_no_rope_layers_keeps_every_fourth_layer_global():
    """The Llama 4 configs leave out `no_rope_layers`; its default (no_rope_layer_interval = 4)
    makes layers 4, 8, ... global (NoPE) and the rest chunked (8192)."""
    m = load_model(str(FIXTURES / "llama-4-scout-17b-16e-instruct.json"))
    assert [m.attn(l.attention).window for l in m.layers[:8]] == [8192, 8192, 8192, 0] * 2
    maverick = load_model(str(FIXTURES / "llama-4-maverick-17b-128e-instruct.json"))
    assert [l.ffn for l in maverick.layers[:4]] == ["dense", "moe"] * 2 and maverick.dense_width == 16384


def test_mimo_v2_hybrid_pattern_with_its_own_sliding_shape():
    """hybrid_layer_pattern: 1 = sliding window (128) with 8 KV heads and sink logits, 0 = full
    with 4 KV heads and none; queries and keys 192 wide, values 128; first layer dense."""
    m = load_model(str(FIXTURES / "mimo-v2-flash.json"))
    full, swa = m.gqa, m.variants["swa"]
    assert (full.kv_heads, full.sinks, full.window) == (4, False, 0)
    assert (swa.kv_heads, swa.sinks, swa.window) == (8, True, 128)
    assert full.head_dim == swa.head_dim == 192 and full.v_head_dim == swa.v_head_dim == 128
    assert [m.layer_kind(l) for l in m.layers[:7]] == ["gqa+dense"] + ["gqa-swa128+moe"] * 4 + ["gqa+moe", "gqa-swa128+moe"]


def test_gemma4_global_layers_share_keys_and_values():
    """Gemma 4: sliding layers 256-wide heads with 8 KV heads; full layers 512-wide with 2 KV heads
    and no value projection (attention_k_eq_v); the dense MLP runs beside 128 experts (top 8)."""
    m = load_model(str(FIXTURES / "gemma-4-26b-a4b.json"))
    full, swa = m.gqa, m.variants["swa"]
    assert (full.head_dim, full.kv_heads, full.k_eq_v) == (512, 2, True)
    assert (swa.head_dim, swa.kv_heads, swa.k_eq_v, swa.window) == (256, 8, False, 1024)
    assert "v_proj" not in [mm.name for mm in m.attention_matmuls("gqa")]
    assert (m.moe.experts, m.moe.top_k, m.moe.expert_width, m.moe.shared_width) == (128, 8, 704, 2112)
    assert m.tie_embeddings


def test_modelopt_without_quant_method_and_with_an_fp8_kv_cache():
    """Qwen3-32B (ModelOpt FP8): the method is named only by `producer`; `kv_cache_scheme` FP8
    stores the KV cache in fp8; the lm_head (ignored) stays bf16."""
    m = load_model(str(FIXTURES / "qwen3-32b-fp8-static.json"))
    f = m.formats
    assert f["attention"].name == f["dense_ffn"].name == "fp8" and f["kv_cache"].name == "fp8-kv"
    assert f["lm_head"].name == "bf16"


def test_modelopt_ignoring_attention_keeps_it_bf16(tmp_path):
    """Gemma 4 31B (NVIDIA NVFP4): every layer's self_attn is in `ignore`, so attention stays bf16
    while the MLP is NVFP4; its KV cache scheme is 8-bit float."""
    f = load_model(str(FIXTURES / "gemma-4-31b-it-nvfp4.json")).formats
    assert (f["attention"].name, f["dense_ffn"].name, f["kv_cache"].name) == ("bf16", "nvfp4", "fp8-kv")
    every = [f"model.layers.{i}.self_attn*" for i in range(4)]
    cfg = base_config(quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4",
                                           "ignore": ["lm_head", "model.layers.0.mlp.gate"] + every})
    m = load_model(write(tmp_path, cfg))
    assert m.formats["attention"].name == "bf16" and m.formats["dense_ffn"].name == "nvfp4"
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.self_attn*"]  # one layer of four
    with pytest.raises(SpecError, match=r"config.json: config.json:quantization_config.ignore=\[0\]: .*only some layers"):
        load_model(write(tmp_path, cfg))


def sidecar(tmp_path, quantization: dict, **config):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}))
    return write(tmp_path, base_config(**config))


def test_hf_quant_config_beside_config_json(tmp_path):
    """ModelOpt's hf_quant_config.json (NVFP4 in blocks of 16, FP8 KV cache, exclude_modules) is
    read as the quantisation of the config.json beside it: without it the checkpoint would be
    predicted as bf16."""
    m = load_model(sidecar(tmp_path, {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
                                      "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]}))
    f = m.formats
    assert (f["dense_ffn"].name, f["attention"].name, f["kv_cache"].name, f["lm_head"].name) == \
        ("nvfp4", "bf16", "fp8-kv", "bf16")
    assert "hf_quant_config.json" in m.sources["all"]
    m = load_model(sidecar(tmp_path, {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}))
    assert m.formats["attention"].name == m.formats["dense_ffn"].name == "fp8" and m.formats["kv_cache"].name == "bf16"
    m = load_model(sidecar(tmp_path, {"quant_algo": "FP8_BLOCK_SCALES"}))
    assert m.formats["dense_ffn"].name == "fp8-block128"


@pytest.mark.parametrize("quantization,config,field", [
    ({"quant_algo": "W4A8_AWQ"}, {}, "hf_quant_config.json:quantization.quant_algo"),
    ({"quant_algo": "NVFP4", "group_size": 32}, {}, "hf_quant_config.json:quantization.group_size"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}, {}, "hf_quant_config.json:quantization.kv_cache_quant_algo"),
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, {}, "hf_quant_config.json:quantization.exclude_modules"),
    ({"quant_algo": "NVFP4"}, {"quantization_config": {"quant_method": "fp8"}}, "config.json:quantization_config"),
    ({"quant_algo": "NVFP4", "exclude_modules": ["model.layers.1.mlp*"]}, {}, "hf_quant_config.json:quantization.exclude_modules"),
])
def test_hf_quant_config_refuses_what_it_cannot_model(tmp_path, quantization, config, field):
    with pytest.raises(SpecError, match=f"json: {re.escape(field)}="):
        load_model(sidecar(tmp_path, quantization, **config))


def test_minimax_shared_intermediate_size_is_read(tmp_path):
    cfg = base_config(model_type="minimax_m2", num_local_experts=8, num_experts_per_tok=2,
                      shared_intermediate_size=384)
    assert load_model(write(tmp_path, cfg)).moe.shared_width == 384


def test_nemotron3_super_latent_moe():
    """`moe_latent_size`: the routed experts work in a 1024-wide latent space (down and up
    projections around them); the shared expert (5376) at full width; relu2, no gate."""
    m = load_model(str(FIXTURES / "nemotron-3-super-120b-a12b-nvfp4.json"))
    assert (m.moe.latent_dim, m.moe.shared_width, m.moe.expert_width, m.moe.top_k) == (1024, 5376, 2688, 22)
    assert not m.ffn_gated and m.formats["state"].name == "f32"
    experts = {mm.name: mm for mm in m.ffn_matmuls("moe")}
    assert experts["expert_gate_up"].d_in == 1024 and experts["latent_down"].d_out == 1024


def test_qwen3_moe_fp8_blocks():
    m = load_model(str(FIXTURES / "qwen3-235b-a22b-fp8.json"))
    assert m.formats["routed_expert"].name == m.formats["attention"].name == "fp8-block128"
    assert (m.moe.experts, m.moe.top_k, m.moe.expert_width, m.moe.shared_width) == (128, 8, 1536, 0)


def test_deepseek_v4_compressed_attention_layers():
    """DeepSeek-V4-Flash: ratio 0 = window only, 4 = CSA (overlapping blocks, indexer), 128 = HCA;
    the last ratio listed belongs to the MTP layer; FP4 experts are MXFP4; four residual streams."""
    m = load_model(str(FIXTURES / "deepseek-v4-flash.json"))
    kinds = [m.layer_kind(l) for l in m.layers]
    assert kinds[:4] == ["swa128+moe", "swa128+moe", "csa4+moe", "hca128+moe"] and kinds[-1] == "csa4+moe"
    csa, hca = m.attn(m.layers[2].attention), m.attn(m.layers[3].attention)
    assert (csa.compress_ratio, csa.overlap, csa.index_topk) == (4, True, 512)
    assert (hca.compress_ratio, hca.overlap, hca.index_topk) == (128, False, 0)
    assert m.formats["routed_expert"].name == "mxfp4" and m.formats["attention"].name == "fp8-block128"
    assert m.residual_streams == 4
    # one sequence, 1000 tokens, bf16 cache: window 128 raw + 250 entries of 512 + 250 index keys
    # of 128, and the f32 compressor blocks (2 x 8 x 1024 values and 2 x 8 x 256 for the indexer)
    assert m.cache_bytes(m.layers[2].attention, 1000, 1) == (128 + 250) * 512 * 2 + 250 * 128 * 2 \
        + (2 * 8 * 1024 + 2 * 8 * 256) * 4


def test_deepseek_v4_tp_splits_whole_output_groups():
    """The grouped output projection (8 groups on V4-Flash) splits over TP by whole groups."""
    from perfmodel.spec.deployment import Deployment, validate
    from perfmodel.spec.hardware import load_hardware
    m, hw = load_model(str(FIXTURES / "deepseek-v4-flash.json")), load_hardware("b200")
    validate(m, hw, Deployment(devices=8, tp=8, engine="multikernel"))
    with pytest.raises(SpecError, match="output groups"):
        validate(m, hw, Deployment(devices=16, tp=16, engine="multikernel"))


def test_minimax_m3_block_sparse_layers():
    """MiniMax-M3: dense attention on the first 3 layers, then index heads (one per KV head) over one
    shared 128-wide index key per token, each KV group reading its top 16 blocks of 128 tokens."""
    m = load_model(str(FIXTURES / "minimax-m3.json"))
    a = m.attn(m.layers[3].attention)
    assert (a.index_heads, a.index_head_dim, a.index_topk, a.kv_heads) == (4, 128, 2048, 4)
    assert m.layers[2].attention == "gqa" and m.layers[3].attention == "msa"
    # per token, bf16: K and V of 4 heads x 128, and the 128-wide index key
    assert m.cache_bytes("msa", 1, 1) == (4 * 2 * 128 + 128) * 2


def test_gemma3_published_shape_takes_the_hf_defaults(tmp_path):
    """google/gemma-3-27b-it's text_config states head_dim 128 and the 1024 window but not the
    vocabulary, the 5 local : 1 global pattern or tied embeddings: the Gemma3TextConfig defaults
    (262208, 6, tied) apply, so 2 of 12 layers are global, not all 12 windowed."""
    text = {"model_type": "gemma3_text", "hidden_size": 64, "head_dim": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "num_hidden_layers": 12, "num_key_value_heads": 2,
            "query_pre_attn_scalar": 168, "sliding_window": 1024}
    m = load_model(write(tmp_path, {"model_type": "gemma3", "text_config": text,
                                    "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}))
    kinds = [m.layer_kind(l) for l in m.layers]
    assert kinds == (["gqa-swa1024+dense"] * 5 + ["gqa+dense"]) * 2
    assert m.vocab == 262208 and m.tie_embeddings and m.gqa.head_dim == 128
