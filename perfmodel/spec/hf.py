"""Hugging Face `config.json` -> ModelSpec, for the families people serve.

Read: DeepSeek-V3 / V3.2 (MLA, DeepSeek sparse attention), DeepSeek-V4 (compressed sparse and
heavily compressed attention over a sliding window, hyper-connections, FP4 experts), Kimi K2 / K2.5, Kimi Linear (KDA +
MLA), GLM-4.x / GLM-5, Llama 3 / 4 (interleaved MoE, chunked attention), Mixtral, Qwen3 dense and
MoE, Qwen3-Next / Qwen3.5 (gated DeltaNet + gated attention), gpt-oss (sliding / full pattern,
sinks, MXFP4 experts), Gemma 3 (5 local : 1 global), Gemma 4 (global layers with their own head
size and K = V, experts beside a dense MLP), MiMo-V2 (hybrid sliding / full pattern with its own
sliding shape and sinks), MiniMax-M2 / M3 (block-sparse attention), Nemotron-H / Nemotron-3
(Mamba-2 hybrids, latent MoE).
A key the importer does not understand but that changes cost (a `layer_types` value, a hybrid
pattern character, a quantisation method, a sparse-attention model without its index keys) is a
SpecError naming the key: the importer never silently models something else.
"""
from __future__ import annotations

import re
from pathlib import Path

from perfmodel.spec.arch import MAX_LAYERS, ModelSpec, from_dict
from perfmodel.util import schema
from perfmodel.util.errors import SpecError, in_file, require

LAYER_TYPES = {"full_attention": "full", "sliding_attention": "swa", "linear_attention": "linear",
               "chunked_attention": "swa"}   # a chunk bounds the span as a window does
HYBRID_CHARS = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors", "modelopt")
MODELOPT_FORMATS = {"NVFP4": "nvfp4", "FP8": "fp8", "FP8_BLOCK_SCALES": "fp8-block128"}
# ModelOpt `hf_quant_config.json` quant_algo -> its config.json quant_algo (the ones modelled)
SIDECAR_ALGOS = {"NVFP4": "NVFP4", "FP8": "FP8", "FP8_BLOCK_SCALES": "FP8_BLOCK_SCALES"}
# module-name keywords of ModelOpt exclude patterns -> the weight family they keep in bf16
EXCLUDE_FAMILIES = (("shared_expert", "shared_expert"), ("experts", "routed_expert"), ("self_attn", "attention"),
                    ("attn", "attention"), ("mlp", "dense_ffn"))
UNQUANTISED = ("lm_head", "embed", "norm", "vision", "visual", "mm_projector")  # bf16 anyway
ROUTER_NAMES = ("gate", "router")  # a MoE block's router (not gate_proj): bf16 anyway
# Hugging Face `Gemma3TextConfig` defaults for the keys Gemma 3's published configs leave out
# (google/gemma-3-27b-it states neither its vocabulary nor its layer pattern nor tied embeddings)
GEMMA3_DEFAULTS = {"vocab_size": 262208, "sliding_window_pattern": 6, "tie_word_embeddings": True}
# DeepSeek-V4 `expert_dtype`: FP4 (e2m1, one e8m0 scale per 32) is MXFP4; FP8 as the rest
EXPERT_DTYPES = {"fp4": "mxfp4", "fp8": "fp8-block128"}
UNGATED_ACTIVATIONS = ("relu2",)  # Nemotron-H: up and down projections only
STATE_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}
# keys of mechanisms that change cost and are not modelled: refused, not approximated
UNMODELLED_KEYS = {"num_kv_shared_layers": "KV cache shared across layers",
                   "kv_sharing_layer_map": "KV cache shared across layers",
                   "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 3n, Gemma 4 E2B / E4B)",
                   "use_double_wide_mlp": "double-width MLPs on KV-sharing layers (Gemma 4 E2B / E4B)",
                   "altup_num_inputs": "AltUp (Gemma 3n)"}


class _Config:
    """The config dict with typed, range-checked access naming `config.json:<key>`."""

    def __init__(self, c: dict):
        self.c = c

    def has(self, key: str) -> bool:
        return self.c.get(key) is not None

    def int(self, key: str, default: int | None = None, lo: int = 0, hi: int = 1 << 24) -> int:
        v = self.c.get(key)
        if v is None:
            if default is None:
                raise SpecError(f"config.json:{key}", None, "required key is missing")
            return default
        require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, f"config.json:{key}", v,
                f"must be an integer in {lo}..{hi}")
        return v

    def list(self, key: str) -> list:
        v = self.c.get(key)
        require(v is None or isinstance(v, list), f"config.json:{key}", v, "must be a list")
        return v or []


def from_hf_config(path: Path) -> ModelSpec:
    # NaN / Infinity stay text: no key reads them as numbers; unread keys are not checked (a
    # config.json holds many that do not change cost; those that do are refused, UNMODELLED_KEYS)
    top = schema.load(path, {"*": None}, "model file", fmt="json", json_constant=str)
    text = top.get("text_config")
    require(text is None or isinstance(text, dict), "config.json:text_config", text, "must be an object")
    c = dict(text or top)
    for key in ("quantization_config", "tie_word_embeddings", "_name_or_path"):  # often kept at the top
        if key not in c and key in top:
            c[key] = top[key]
    name = c.get("_name_or_path") or Path(path).stem
    if name == "config":
        name = Path(path).parent.name or "hf-model"
    source = f"Hugging Face config {Path(path).name}"
    sidecar = Path(path).parent / "hf_quant_config.json"
    if sidecar.is_file():
        with in_file(sidecar):
            c["quantization_config"] = _sidecar(sidecar, c.get("quantization_config"))
        source += " + hf_quant_config.json"
    with in_file(path):
        return from_dict(spec_dict(c, str(name), source))


def _sidecar(path: Path, qc) -> dict:
    """NVIDIA ModelOpt's `hf_quant_config.json` beside a config.json, as the `quantization_config`
    ModelOpt writes into config.json (`quant_algo`, `kv_cache_scheme`, `ignore` = its
    `exclude_modules`, `group_size`). A config.json that names another method is refused."""
    doc = schema.load(path, None, "hf_quant_config.json", fmt="json", json_constant=str)
    q = doc.get("quantization") if isinstance(doc, dict) else None
    require(isinstance(q, dict), "hf_quant_config.json:quantization", q, "must be an object")
    algo = q.get("quant_algo")
    require(algo in SIDECAR_ALGOS, "hf_quant_config.json:quantization.quant_algo", algo,
            f"known: {', '.join(SIDECAR_ALGOS)} (another algorithm changes cost)")
    group = q.get("group_size")
    if algo == "NVFP4":
        require(group in (None, 16), "hf_quant_config.json:quantization.group_size", group,
                "NVFP4 scales blocks of 16 values")
    kv = q.get("kv_cache_quant_algo")
    require(kv in (None, "FP8"), "hf_quant_config.json:quantization.kv_cache_quant_algo", kv, "known: FP8 or null")
    exclude = q.get("exclude_modules") or []
    require(isinstance(exclude, list) and all(isinstance(x, str) for x in exclude),
            "hf_quant_config.json:quantization.exclude_modules", exclude, "must be a list of module patterns")
    out = {"quant_method": "modelopt", "quant_algo": SIDECAR_ALGOS[algo], "ignore": exclude,
           "ignore_field": "hf_quant_config.json:quantization.exclude_modules"}
    if kv:
        out["kv_cache_scheme"] = kv
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        require(method == "modelopt" and qc.get("quant_algo") in (None, out["quant_algo"]),
                "config.json:quantization_config", method,
                f"disagrees with hf_quant_config.json beside it (ModelOpt {algo})")
    return out


def spec_dict(raw: dict, name: str, source: str) -> dict:
    """The preset-schema dict (perfmodel.spec.arch.from_dict) of one config.json."""
    if raw.get("model_type") in ("gemma3", "gemma3_text"):
        raw = {**GEMMA3_DEFAULTS, **raw}
    c = _Config(raw)
    for key, what in UNMODELLED_KEYS.items():
        require(raw.get(key) in (None, False, 0, []), f"config.json:{key}", raw.get(key),
                f"{what} changes cost and is not modelled")
    n = c.int("num_hidden_layers", lo=1, hi=MAX_LAYERS)
    h, heads = c.int("hidden_size", lo=1), c.int("num_attention_heads", lo=1)
    tie = raw.get("tie_word_embeddings", False)
    require(isinstance(tie, bool), "config.json:tie_word_embeddings", tie, "must be true or false")
    d: dict = {"name": name, "hidden": h, "vocab": c.int("vocab_size", lo=1), "layers": n,
               "tie_embeddings": tie, "residual_streams": c.int("hc_mult", 1, lo=1, hi=64),
               "sources": {"all": source}}
    attn, ffn = _attention(c, raw, d, n, h, heads), _ffn_kinds(c, raw, n)
    _moe(c, raw, d, n, ffn)
    d["attention"] = attn
    d["formats"], custom = _formats(raw.get("quantization_config"), n, ffn)
    state_key = _first(raw, "mamba_ssm_dtype", "mamba_ssm_cache_dtype")
    if raw.get(state_key) is not None:  # recurrent state precision (gated DeltaNet, Mamba-2)
        require(raw[state_key] in STATE_DTYPES, f"config.json:{state_key}", raw[state_key],
                f"known: {', '.join(STATE_DTYPES)}")
        d["formats"]["state"] = STATE_DTYPES[raw[state_key]]
    if raw.get("expert_dtype") is not None:  # DeepSeek-V4: routed experts stored apart
        require(raw["expert_dtype"] in EXPERT_DTYPES, "config.json:expert_dtype", raw["expert_dtype"],
                f"known: {', '.join(EXPERT_DTYPES)}")
        d["formats"]["routed_expert"] = EXPERT_DTYPES[raw["expert_dtype"]]
    if custom:
        d["custom_formats"] = custom
    return d


def _attention(c: _Config, raw: dict, d: dict, n: int, h: int, heads: int) -> dict:
    if "hybrid_override_pattern" in raw:  # Nemotron-H: one mixer per block
        pat = raw["hybrid_override_pattern"]
        require(isinstance(pat, str) and len(pat) == n, "config.json:hybrid_override_pattern", pat,
                f"must be a string of num_hidden_layers ({n}) characters")
        bad = sorted(set(pat) - set(HYBRID_CHARS))
        require(not bad, "config.json:hybrid_override_pattern", bad, f"unknown block kinds; known: {HYBRID_CHARS}")
        d["mamba2"] = {"heads": c.int("mamba_num_heads", lo=1), "head_dim": c.int("mamba_head_dim", lo=1),
                       "state_dim": c.int("ssm_state_size", lo=1), "groups": c.int("n_groups", 1, lo=1),
                       "conv_width": c.int("conv_kernel", 4, lo=1)}
        _gqa(c, raw, d, h, heads, window=0)
        kinds = {"M": "mamba2", "*": "gqa"}
        return {"default": "none", **{f"{k}_layers": [i + 1 for i, ch in enumerate(pat) if kinds.get(ch) == k]
                                      for k in ("mamba2", "gqa")}}
    if raw.get("compress_ratios") is not None:  # DeepSeek-V4
        return _csa(c, raw, d, n, heads)
    lin = raw.get("linear_attn_config")
    if lin is not None:  # Kimi Linear / K3: KDA with MLA on the listed layers
        require(isinstance(lin, dict), "config.json:linear_attn_config", lin, "must be an object")
        lc = _Config(lin)
        head_dim = lc.int("head_dim", 128, lo=1)
        full_gate = lin.get("use_full_rank_gate", False)
        require(isinstance(full_gate, bool), "config.json:linear_attn_config.use_full_rank_gate", full_gate,
                "must be true or false")
        d["kda"] = {"heads": lc.int("num_heads", heads, lo=1), "head_dim": head_dim,
                    "conv_width": lc.int("short_conv_kernel_size", 4, lo=1),
                    "output_gate_rank": 0 if full_gate else head_dim}  # Kimi Linear: low rank = head_dim
        _mla(c, raw, d, heads)
        full = lc.list("full_attn_layers")
        require(all(isinstance(i, int) and 1 <= i <= n for i in full), "config.json:linear_attn_config.full_attn_layers",
                full, f"must be 1-based layer numbers <= {n}")
        return {"default": "kda", "mla_layers": list(full)}
    if c.has("kv_lora_rank"):
        _mla(c, raw, d, heads)
        return {"default": "mla"}
    types = _layer_types(c, raw, n)
    window = c.int("sliding_window", 0) if raw.get("use_sliding_window", True) else 0
    if c.has("attention_chunk_size") and "hybrid_layer_pattern" not in raw:  # Llama 4: local layers
        window = c.int("attention_chunk_size", lo=1)                        # attend within their chunk
    if "linear" in types:  # Qwen3-Next / Qwen3.5: gated DeltaNet
        d["gdn"] = {"key_heads": c.int("linear_num_key_heads", lo=1), "value_heads": c.int("linear_num_value_heads", lo=1),
                    "key_head_dim": c.int("linear_key_head_dim", lo=1),
                    "value_head_dim": c.int("linear_value_head_dim", lo=1),
                    "conv_width": c.int("linear_conv_kernel_dim", 4, lo=1)}
    swa = "swa" in types
    _gqa(c, raw, d, h, heads, window=0 if swa else window)
    full = _full_shape(c, raw, heads)  # Gemma 4: the full layers' own head size, K = V
    local = {k: d["gqa"][k] for k in full}
    d["gqa"].update(full)
    out: dict = {"default": "gqa"}
    if swa:
        require(window > 0, "config.json:sliding_window", raw.get("sliding_window"),
                "layer_types has sliding layers but no window is given")
        out["swa"] = {"type": "gqa", "window": window, **local, **_swa_shape(c, raw)}
        out["swa_layers"] = [i + 1 for i, t in enumerate(types) if t == "swa"]
    if "linear" in types:
        out["gdn_layers"] = [i + 1 for i, t in enumerate(types) if t == "linear"]
    if raw.get("sparse_attention_config") is not None:
        sparse = _msa(raw["sparse_attention_config"], n)
        if sparse:
            out["msa"], out["msa_layers"] = sparse
            require(not set(out["msa_layers"]) & set(out.get("swa_layers", [])) and "linear" not in types,
                    "config.json:sparse_attention_config", raw["sparse_attention_config"],
                    "block-sparse attention on sliding-window or linear-attention layers is not modelled")
    return out


def _msa(sc, n: int) -> tuple[dict, list[int]] | None:
    """MiniMax-M3 block-sparse attention: on the layers `sparse_attention_freq` marks, index heads
    (one per KV head) score every token against one shared index key, keep each block's maximum
    and read their top `sparse_topk_blocks` blocks of `sparse_block_size` tokens (the forced local
    and initial blocks counted among them). Only the score-only indexer is known."""
    require(isinstance(sc, dict), "config.json:sparse_attention_config", sc, "must be an object")
    use = sc.get("use_sparse_attention", False)
    require(isinstance(use, bool), "config.json:sparse_attention_config.use_sparse_attention", use,
            "must be true or false")
    if not use:
        return None
    s = _Config(sc)
    key = "config.json:sparse_attention_config."
    freq = s.list("sparse_attention_freq")
    require(len(freq) == n and all(f in (0, 1) for f in freq), key + "sparse_attention_freq", freq,
            f"must give 0 or 1 for each of the {n} layers")
    layers = [i + 1 for i, f in enumerate(freq) if f]
    no_value = s.list("sparse_disable_index_value")
    require(len(no_value) == n and all(no_value[i - 1] == 1 for i in layers), key + "sparse_disable_index_value",
            no_value, "index value / output projections (0 on a sparse layer) are not modelled")
    require(sc.get("sparse_score_type", "max") == "max", key + "sparse_score_type", sc.get("sparse_score_type"),
            "the known block score is max")
    block = s.int("sparse_block_size", lo=1)
    return {"type": "gqa", "index_heads": s.int("sparse_num_index_heads", lo=1),
            "index_head_dim": s.int("sparse_index_dim", lo=1),
            "index_topk": s.int("sparse_topk_blocks", lo=1) * block}, layers


def _csa(c: _Config, raw: dict, d: dict, n: int, heads: int) -> dict:
    """DeepSeek-V4: `compress_ratios` per layer; 0 = the sliding window only, 4 = compressed
    sparse attention (overlapping blocks and an indexer, as the reference code builds for ratio
    4), any other ratio = heavily compressed attention (every entry read). One variant a ratio."""
    ratios, mtp = c.list("compress_ratios"), c.int("num_nextn_predict_layers", 0, hi=MAX_LAYERS)
    require(len(ratios) in (n, n + mtp) and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= 1 << 20
                                                for r in ratios), "config.json:compress_ratios", ratios,
            f"must give a ratio (integer >= 0) for each of the {n} layers (and each MTP layer)")
    ratios = ratios[:n]  # the MTP layers' entries follow; MTP is not modelled
    d["csa"] = {"heads": heads, "head_dim": c.int("head_dim", lo=1), "rope_dim": c.int("qk_rope_head_dim", lo=1),
                "q_lora_rank": c.int("q_lora_rank", lo=1), "o_groups": c.int("o_groups", lo=1),
                "o_lora_rank": c.int("o_lora_rank", lo=1), "window": c.int("sliding_window", lo=1)}
    index = {"index_heads": c.int("index_n_heads", lo=1), "index_head_dim": c.int("index_head_dim", lo=1),
             "index_topk": c.int("index_topk", lo=1)}
    out: dict = {"default": "csa"}
    for r in sorted(set(ratios) - {0}):
        label = f"csa{r}" if r == 4 else f"hca{r}"
        out[label] = {"type": "csa", "compress_ratio": r, **({"overlap": True, **index} if r == 4 else {})}
        out[f"{label}_layers"] = [i + 1 for i, x in enumerate(ratios) if x == r]
    return out


def _layer_types(c: _Config, raw: dict, n: int) -> list[str]:
    """Per layer: full, swa or linear, from `layer_types` or the older interval keys."""
    if "layer_types" in raw:
        lt = c.list("layer_types")
        require(len(lt) == n, "config.json:layer_types", len(lt), f"must list num_hidden_layers ({n}) layers")
        for t in lt:
            require(t in LAYER_TYPES, "config.json:layer_types", t,
                    f"unknown layer type (changes cost); known: {', '.join(LAYER_TYPES)}")
        return [LAYER_TYPES[t] for t in lt]
    if c.has("linear_num_value_heads"):  # Qwen3-Next before layer_types: full every k-th
        k = c.int("full_attention_interval", lo=1)
        return ["full" if (i + 1) % k == 0 else "linear" for i in range(n)]
    pattern = _first(raw, "sliding_window_pattern", "_sliding_window_pattern")
    if c.has(pattern) and c.has("sliding_window"):  # Gemma 3: every k-th global
        k = c.int(pattern, lo=1)
        return ["full" if (i + 1) % k == 0 else "swa" for i in range(n)]
    if "hybrid_layer_pattern" in raw:  # MiMo-V2: 0 = full attention, 1 = sliding window
        pat = c.list("hybrid_layer_pattern")
        require(len(pat) == n and all(p in (0, 1) for p in pat), "config.json:hybrid_layer_pattern", pat,
                f"must give 0 (full) or 1 (sliding window) for each of the {n} layers")
        return ["swa" if p else "full" for p in pat]
    if c.has("attention_chunk_size"):  # Llama 4: RoPE layers attend within a chunk, NoPE layers globally
        rope = c.list("no_rope_layers")  # 1 = RoPE (chunked); empty: every k-th layer is NoPE
        if not rope:
            k = c.int("no_rope_layer_interval", 4, lo=1)
            rope = [int((i + 1) % k != 0) for i in range(n)]
        require(len(rope) == n and all(r in (0, 1) for r in rope), "config.json:no_rope_layers", rope,
                f"must give 0 or 1 for each of the {n} layers")
        return ["swa" if r else "full" for r in rope]
    if "attn_type_list" in raw:  # MiniMax: 0 = lightning (linear) attention, 1 = softmax
        types = c.list("attn_type_list")
        require(all(t == 1 for t in types), "config.json:attn_type_list", types,
                "lightning attention layers (0) are not modelled")
    return ["full"] * n


def _gqa(c: _Config, raw: dict, d: dict, h: int, heads: int, window: int) -> None:
    mt = str(raw.get("model_type", ""))
    gate = raw.get("attn_output_gate", mt.startswith("qwen3_next"))
    require(isinstance(gate, bool), "config.json:attn_output_gate", gate, "must be true or false")
    sinks = raw.get("add_full_attention_sink_bias", mt == "gpt_oss")
    require(isinstance(sinks, bool), "config.json:add_full_attention_sink_bias", sinks, "must be true or false")
    head_dim = c.int(_first(raw, "head_dim", "attention_head_dim"), h // heads, lo=1)  # Nemotron-H: attention_head_dim
    d["gqa"] = {"heads": heads, "kv_heads": c.int("num_key_value_heads", heads, lo=1), "head_dim": head_dim,
                "v_head_dim": c.int("v_head_dim", 0), "window": window, "output_gate": gate, "sinks": sinks, "k_eq_v": False}


def _full_shape(c: _Config, raw: dict, heads: int) -> dict:
    """Fields in which the full-attention layers differ from the sliding ones (Gemma 4:
    `global_head_dim`; with `attention_k_eq_v`, no value projection and their own KV head count)."""
    k_eq_v = raw.get("attention_k_eq_v", False)
    require(isinstance(k_eq_v, bool), "config.json:attention_k_eq_v", k_eq_v, "must be true or false")
    out = {"head_dim": c.int("global_head_dim", lo=1)} if c.has("global_head_dim") else {}
    if k_eq_v:
        out.update(k_eq_v=True, kv_heads=c.int(_first(raw, "num_global_key_value_heads", "num_key_value_heads"),
                                               heads, lo=1))
    return out


def _swa_shape(c: _Config, raw: dict) -> dict:
    """Fields in which the sliding-window layers differ from the full ones (MiMo-V2: swa_* keys,
    sink logits on the sliding layers only)."""
    out = {field: c.int(key, lo=1) for field, key in (("heads", "swa_num_attention_heads"),
           ("kv_heads", "swa_num_key_value_heads"), ("head_dim", "swa_head_dim"), ("v_head_dim", "swa_v_head_dim"))
           if c.has(key)}
    if "add_swa_attention_sink_bias" in raw:
        sinks = raw["add_swa_attention_sink_bias"]
        require(isinstance(sinks, bool), "config.json:add_swa_attention_sink_bias", sinks, "must be true or false")
        out["sinks"] = sinks
    return out


def _mla(c: _Config, raw: dict, d: dict, heads: int) -> None:
    gate = raw.get("mla_use_output_gate", False)
    require(isinstance(gate, bool), "config.json:mla_use_output_gate", gate, "must be true or false")
    d["mla"] = {"heads": heads, "q_lora_rank": c.int("q_lora_rank", 0), "kv_lora_rank": c.int("kv_lora_rank", lo=1),
                "qk_nope_dim": c.int("qk_nope_head_dim", lo=1), "qk_rope_dim": c.int("qk_rope_head_dim"),
                "v_head_dim": c.int("v_head_dim", lo=1), "output_gate": gate}
    mt = str(raw.get("model_type", ""))
    sparse = "dsa" in mt or mt == "deepseek_v32" or c.has("index_topk")
    if sparse:
        d["mla"].update(index_heads=c.int("index_n_heads", lo=1), index_head_dim=c.int("index_head_dim", lo=1),
                        index_topk=c.int("index_topk", lo=1))


def _ffn_kinds(c: _Config, raw: dict, n: int) -> list[str]:
    """Per layer: dense or moe (or none: Nemotron-H blocks without an MLP)."""
    experts = _experts(c, raw)
    if "hybrid_override_pattern" in raw:
        pat = raw["hybrid_override_pattern"]
        return ["moe" if ch == "E" else "dense" if ch == "-" else "none" for ch in pat]
    if not experts:
        return ["dense"] * n
    first = c.int("first_k_dense_replace", 0, hi=n)
    freq = raw.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        require(len(freq) == n and all(f in (0, 1) for f in freq), "config.json:moe_layer_freq", freq,
                f"a list must give 0 or 1 for each of the {n} layers")
        moe = [bool(f) for f in freq]
    else:
        k = c.int("moe_layer_freq", 1, lo=1)
        moe = [i >= first and i % k == 0 for i in range(n)]
    step = c.int("decoder_sparse_step", 1, lo=1) if "decoder_sparse_step" in raw else \
        c.int("interleave_moe_layer_step", 1, lo=1)
    only_mlp = set(c.list("mlp_only_layers"))
    moe = [m and (i + 1) % step == 0 and i not in only_mlp for i, m in enumerate(moe)]
    if "moe_layers" in raw:  # Llama 4 lists them explicitly (0-based)
        listed = set(c.list("moe_layers"))
        moe = [i in listed for i in range(n)]
    return ["moe" if m else "dense" for m in moe]


def _first(raw: dict, *keys: str) -> str:
    """The first of `keys` the config sets (else the first, so its absence is the error)."""
    return next((k for k in keys if raw.get(k) is not None), keys[0])


def _experts(c: _Config, raw: dict) -> int:
    if raw.get("enable_moe_block") is False:  # Gemma 4 dense sizes
        return 0
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if raw.get(key):
            return c.int(key, lo=1)
    return 0


def _moe(c: _Config, raw: dict, d: dict, n: int, ffn: list[str]) -> None:
    experts = _experts(c, raw)
    mt = str(raw.get("model_type", ""))
    if "moe" in ffn:
        width = c.int("moe_intermediate_size") if c.has("moe_intermediate_size") else c.int("intermediate_size")
        top_k = c.int(_first(raw, "num_experts_per_tok", "num_experts_per_token", "experts_per_token",
                             "top_k_experts"), lo=1)
        shared = 0
        if c.has("shared_expert_intermediate_size") or c.has("shared_intermediate_size"):  # MiniMax-M2
            shared = c.int(_first(raw, "shared_expert_intermediate_size", "shared_intermediate_size"))
        elif c.has("n_shared_experts") or c.has("num_shared_experts"):
            count = c.int(_first(raw, "n_shared_experts", "num_shared_experts"))
            shared = count * (c.int("moe_shared_expert_intermediate_size") if
                              c.has("moe_shared_expert_intermediate_size") else width)
        elif mt.startswith("llama4"):  # one shared expert as wide as a routed one
            shared = width
        elif raw.get("enable_moe_block"):  # Gemma 4: the dense MLP runs beside the routed experts
            shared = c.int("intermediate_size", lo=1)
        d["moe"] = {"experts": experts, "top_k": top_k, "expert_width": width, "shared_width": shared,
                    "latent_dim": c.int(_first(raw, "routed_expert_hidden_size", "moe_latent_size"), 0)}
        # latent MoE: Kimi K3 `routed_expert_hidden_size`, Nemotron-3 Super `moe_latent_size`
    dense_width = 0
    if "dense" in ffn:
        dense_width = c.int(_first(raw, "intermediate_size_mlp", "dense_intermediate_size", "intermediate_size"), lo=1)
    act = raw.get("mlp_hidden_act", raw.get("hidden_act", "silu"))
    d["ffn"] = {"default": "dense", "dense_width": dense_width, "gated": act not in UNGATED_ACTIVATIONS,
                "moe_layers": [i + 1 for i, f in enumerate(ffn) if f == "moe"],
                "none_layers": [i + 1 for i, f in enumerate(ffn) if f == "none"]}


def _formats(qc, n: int, ffn: list[str]) -> tuple[dict, dict]:
    """Weight formats from `quantization_config` (none: bf16 as published)."""
    if qc is None:
        return {}, {}
    require(isinstance(qc, dict), "config.json:quantization_config", qc, "must be an object")
    producer = qc.get("producer")
    method = qc.get("quant_method") or (producer.get("name") if isinstance(producer, dict) else None)
    require(method in QUANT_METHODS, "config.json:quantization_config.quant_method", method,
            f"unknown quantisation method (changes cost); known: {', '.join(QUANT_METHODS)}")
    linear = ("attention", "dense_ffn", "shared_expert", "latent_projection", "routed_expert")
    if method == "fp8":
        block = qc.get("weight_block_size")
        require(block in (None, [128, 128]), "config.json:quantization_config.weight_block_size", block,
                "only 128x128 blocks (DeepSeek) or per-tensor scales are known")
        return dict.fromkeys(linear, "fp8-block128" if block else "fp8"), {}
    if method == "mxfp4":  # gpt-oss: the MoE experts only
        return {"routed_expert": "mxfp4"}, {}
    if method == "modelopt":  # ModelOpt (quant_method, or only its producer name, says so)
        algo = qc.get("quant_algo")
        require(algo in MODELOPT_FORMATS, "config.json:quantization_config.quant_algo", algo,
                f"known: {', '.join(MODELOPT_FORMATS)}")
        kept = _excluded(qc.get("ignore", []), n, ffn, qc.get("ignore_field", "config.json:quantization_config.ignore"))
        out = dict.fromkeys([f for f in linear if f not in kept], MODELOPT_FORMATS[algo])
        kv = qc.get("kv_cache_scheme")
        if kv is not None:
            require(kv == "FP8" or (isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float"),
                    "config.json:quantization_config.kv_cache_scheme", kv, "the known KV cache scheme is FP8")
            out["kv_cache"] = "fp8-kv"
        return out, {}
    return _compressed_tensors(qc, linear)


def _excluded(patterns, n: int, ffn: list[str], field: str) -> set[str]:
    """The weight families a ModelOpt ignore / exclude list keeps in bf16: a family whose pattern
    names no layer (or every layer that has it); one that names only some of its layers is refused
    (per-layer precision is not modelled)."""
    require(isinstance(patterns, list) and all(isinstance(p, str) for p in patterns), field, patterns,
            "must be a list of module-name patterns")
    layers: dict[str, set] = {}
    for p in patterns:
        family = next((f for key, f in EXCLUDE_FAMILIES if key in p), None)
        if family is None or any(u in p for u in UNQUANTISED) or p.rsplit(".", 1)[-1].strip("*") in ROUTER_NAMES:
            continue
        m = re.search(r"layers\.(\d+)\.", p)
        layers.setdefault(family, set()).add(int(m.group(1)) if m else "all")
    has = {"attention": set(range(n)), "dense_ffn": {i for i, f in enumerate(ffn) if f == "dense"},
           "shared_expert": {i for i, f in enumerate(ffn) if f == "moe"},
           "routed_expert": {i for i, f in enumerate(ffn) if f == "moe"}}
    out = set()
    for family, named in layers.items():
        if "all" in named or has[family] <= named:
            out.add(family)
        elif has[family] & named:
            raise SpecError(field, sorted(x for x in named if x != "all")[:8],
                            f"keeps {family} weights of only some layers in bf16: per-layer precision is not modelled")
    return out


def _compressed_tensors(qc: dict, linear: tuple[str, ...]) -> tuple[dict, dict]:
    """compressed-tensors weight-only groups: integer (Kimi K2-Thinking: int4, group 32) or
    MXFP4 (Kimi K3: 4-bit floats, group 32, uint8 = E8M0 scales)."""
    groups = qc.get("config_groups")
    require(isinstance(groups, dict) and len(groups) == 1, "config.json:quantization_config.config_groups",
            groups, "exactly one group is understood")
    w = next(iter(groups.values())).get("weights") or {}
    bits, group, strategy = w.get("num_bits"), w.get("group_size"), w.get("strategy")
    ignore = " ".join(str(x) for x in qc.get("ignore", []))
    targets = ["routed_expert"] if "self_attn" in ignore or "shared_experts" in ignore else list(linear)
    if w.get("type") == "float":
        require(bits == 4 and group == 32 and w.get("scale_dtype") == "torch.uint8",
                "config.json:quantization_config.config_groups.weights", w,
                "the known float format is MXFP4: 4 bits, group 32, uint8 (E8M0) scales")
        return dict.fromkeys(targets, "mxfp4"), {}
    require(w.get("type") == "int" and bits in (4, 8) and strategy in ("group", "channel"),
            "config.json:quantization_config.config_groups.weights", w,
            "known: integer weights of 4 or 8 bits, group or channel strategy")
    name = f"int{bits}-{strategy}{group or ''}"
    block = [1, group] if strategy == "group" else [1, 0]
    require(strategy == "channel" or (isinstance(group, int) and 1 <= group <= 1 << 20),
            "config.json:quantization_config.config_groups.weights.group_size", group, "must be a positive integer")
    feed = {"compute_dtype": "int8"} if bits == 8 else \
        {"compute_dtype": "int4", "scale_rows": max(1, 512 // group) if strategy == "group" else 1}
    custom = {name: {"value_bits": bits, "scale_dtype": "bf16", "block": block, **feed, "fallback_dtype": "bf16",
                     "source": "compressed-tensors pack-quantized (bf16 scales); fed as the int4 / int8 formats "
                               "of presets/formats.toml (block-diagonal scale rows = 512 / group)"}}
    return dict.fromkeys(targets, name), custom
