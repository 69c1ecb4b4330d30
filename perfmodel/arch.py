"""Model architectures: the layer sequence, its weight matrices and their storage formats.

One source of truth for shapes: the analytic model, the parameter counts and the Pallas
kernel's test configurations all derive from a `ModelSpec`. Presets are TOML files in
`presets/models/`; a preset may name a `base` preset and override some of its fields (that is
how the MINI kernel configuration derives from kimi-k3). Hugging Face `config.json` files of the
DeepSeek / Kimi / Llama families load through `from_hf_config`.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .checks import (HF_CONFIG, MAX_EXPERTS, MAX_LAYERS, MAX_SKEW, MODEL_FILE, STR, check_range,
                     check_tree, check_type)
from .errors import SpecError, positive_int, require
from .files import check_path, read_text
from .formats import Format, get_format

PRESET_DIR = Path(__file__).parent / "presets" / "models"
ATTENTION_KINDS = ("kda", "mla", "gqa")
WEIGHT_FAMILIES = ("attention", "dense_ffn", "shared_expert", "routed_expert", "router",
                   "embedding", "lm_head")
CACHE_FAMILIES = ("kv_cache", "state", "activation")


@dataclass(frozen=True)
class KDA:
    """Kimi Delta Attention: linear attention with a per-head recurrent state dk x dv."""
    heads: int
    head_dim: int
    conv_width: int = 4
    decay_gate_rank: int = 128   # low-rank decay gate (Kimi Linear)
    output_gate_rank: int = 0    # 0 = full-rank output gate (K3)


@dataclass(frozen=True)
class MLA:
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    output_gate: bool = False


@dataclass(frozen=True)
class GQA:
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0  # 0 = full attention, else sliding window length


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0   # total width of the shared experts
    latent_dim: int = 0     # 0 = experts take the hidden state directly
    routing_skew: float = 0.0  # Zipf exponent of expert popularity (perfmodel.moe); 0 = uniform


@dataclass(frozen=True)
class Matmul:
    """One weight matrix: y[in] -> y[out]; `experts` > 1 for a stacked expert tensor."""
    name: str
    family: str
    d_in: int
    d_out: int
    experts: int = 1

    @property
    def params(self) -> int:
        return self.d_in * self.d_out * self.experts


@dataclass(frozen=True)
class Layer:
    index: int        # 1-based
    attention: str    # one of ATTENTION_KINDS
    ffn: str          # "dense" or "moe"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    formats: dict[str, Format]
    kda: KDA | None = None
    mla: MLA | None = None
    gqa: GQA | None = None
    dense_width: int = 0
    moe: MoE | None = None
    tie_embeddings: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    # ----- weights -------------------------------------------------------------------------
    def attention_matmuls(self, kind: str) -> list[Matmul]:
        h = self.hidden
        if kind == "kda":
            a = self.kda
            qk, v = a.heads * a.head_dim, a.heads * a.head_dim
            mm = [Matmul("q_proj", "attention", h, qk), Matmul("k_proj", "attention", h, qk),
                  Matmul("v_proj", "attention", h, v),
                  Matmul("decay_a", "attention", h, a.decay_gate_rank),
                  Matmul("decay_b", "attention", a.decay_gate_rank, qk),
                  Matmul("beta_proj", "attention", h, a.heads)]
            if a.output_gate_rank:
                mm += [Matmul("gate_a", "attention", h, a.output_gate_rank),
                       Matmul("gate_b", "attention", a.output_gate_rank, v)]
            else:
                mm.append(Matmul("gate_proj", "attention", h, v))
            return mm + [Matmul("o_proj", "attention", v, h)]
        if kind == "mla":
            m = self.mla
            mm = [Matmul("q_a", "attention", h, m.q_lora_rank),
                  Matmul("q_b", "attention", m.q_lora_rank, m.heads * (m.qk_nope_dim + m.qk_rope_dim)),
                  Matmul("kv_a", "attention", h, m.kv_lora_rank + m.qk_rope_dim),
                  Matmul("kv_b", "attention", m.kv_lora_rank, m.heads * (m.qk_nope_dim + m.v_head_dim))]
            if m.output_gate:
                mm.append(Matmul("gate_proj", "attention", h, m.heads * m.v_head_dim))
            return mm + [Matmul("o_proj", "attention", m.heads * m.v_head_dim, h)]
        g = self.gqa
        return [Matmul("q_proj", "attention", h, g.heads * g.head_dim),
                Matmul("k_proj", "attention", h, g.kv_heads * g.head_dim),
                Matmul("v_proj", "attention", h, g.kv_heads * g.head_dim),
                Matmul("o_proj", "attention", g.heads * g.head_dim, h)]

    def attention_small_params(self, kind: str) -> int:
        """Non-matmul attention parameters (conv taps, per-head decay constants, norms)."""
        if kind == "kda":
            a = self.kda
            return 3 * a.heads * a.head_dim * a.conv_width + 2 * a.heads + a.head_dim
        if kind == "mla":
            return self.mla.q_lora_rank + self.mla.kv_lora_rank
        return 0

    def ffn_matmuls(self, ffn: str) -> list[Matmul]:
        h = self.hidden
        if ffn == "dense":
            w = self.dense_width
            return [Matmul("gate_up", "dense_ffn", h, 2 * w), Matmul("down", "dense_ffn", w, h)]
        m = self.moe
        d = m.latent_dim or h
        mm = [Matmul("router", "router", h, m.experts)]
        if m.latent_dim:
            mm += [Matmul("latent_down", "shared_expert", h, d),
                   Matmul("latent_up", "shared_expert", d, h)]
        if m.shared_width:
            mm += [Matmul("shared_gate_up", "shared_expert", h, 2 * m.shared_width),
                   Matmul("shared_down", "shared_expert", m.shared_width, h)]
        return mm + [Matmul("expert_gate_up", "routed_expert", d, 2 * m.expert_width, m.experts),
                     Matmul("expert_down", "routed_expert", m.expert_width, d, m.experts)]

    def layer_matmuls(self, layer: Layer) -> list[Matmul]:
        return self.attention_matmuls(layer.attention) + self.ffn_matmuls(layer.ffn)

    def params_by_family(self) -> dict[str, int]:
        return dict(self._params_by_family)

    @cached_property
    def _params_by_family(self) -> dict[str, int]:
        out = dict.fromkeys(WEIGHT_FAMILIES, 0)
        for layer in self.layers:
            for mm in self.layer_matmuls(layer):
                out[mm.family] += mm.params
            out["attention"] += self.attention_small_params(layer.attention) + 2 * self.hidden
            if layer.ffn == "moe":
                out["router"] += self.moe.experts  # selection bias
        out["embedding"] = self.vocab * self.hidden
        out["lm_head"] = 0 if self.tie_embeddings else self.vocab * self.hidden
        out["attention"] += self.hidden  # final norm
        return out

    @property
    def total_params(self) -> int:
        return sum(self.params_by_family().values())

    def weight_bytes(self) -> int:
        return int(sum(n * self.formats[f].bytes_per_value
                       for f, n in self.params_by_family().items()))

    def count(self, attention: str | None = None, ffn: str | None = None) -> int:
        return sum(1 for l in self.layers
                   if (attention is None or l.attention == attention)
                   and (ffn is None or l.ffn == ffn))


# ----- loading --------------------------------------------------------------------------------

def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


# Values `perfmodel reproduce --write` fits (section.field): a derived preset gets the physical
# default unless it opts in by name, e.g. `inherit_fitted = ["moe.routing_skew"]`.
FITTED = ("moe.routing_skew",)


def _derived(base: dict, over: dict) -> dict:
    """`over` merged into `base`; a nested table replaces only the keys it names, except
    `attention`, replaced whole (its layer lists depend on the layer count). Fitted values
    (FITTED) and their sources stay behind unless `over["inherit_fitted"]` names them."""
    keep = check_tree(over.get("inherit_fitted", []), [(STR,)], "inherit_fitted")
    for name in keep:
        require(name in FITTED, "inherit_fitted", name, f"fitted values are {', '.join(FITTED)}")
    base = {**base, "sources": dict(base.get("sources", {}))}
    for name in set(FITTED) - set(keep):
        section, field = name.split(".")
        if isinstance(base.get(section), dict):
            base[section] = {k: v for k, v in base[section].items() if k != field}
        base["sources"].pop(field, None)
    if "attention" in over:
        base = {k: v for k, v in base.items() if k != "attention"}
    return _merge(base, over)


def _read_toml(path: Path, chain: tuple[str, ...] = ()) -> dict:
    text = read_text(path, "model file")
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, over-long integers, deep nesting
        raise SpecError("model file", str(path), f"not valid TOML: {e}") from None
    if "base" in data:
        base = check_type("base", data.pop("base"), STR)
        require(base not in chain, "base", base, "cycle: " + " -> ".join(chain + (base,)))
        data = _derived(_preset_data(base, chain + (base,)), data)
    return data


def _preset_data(name: str, chain: tuple[str, ...] = ()) -> dict:
    require(name in list_presets(), "model", name,
            f"unknown preset; known: {', '.join(list_presets())} (or give a .toml/.json path)")
    return _read_toml(PRESET_DIR / f"{name}.toml", chain or (name,))


def derive(base: str, **overrides) -> ModelSpec:
    """The preset `base` with `overrides` (nested tables as dicts), validated like a preset file:
    `derive("kimi-k3", hidden=1024, moe={"experts": 64})`."""
    return from_dict(_derived(_preset_data(base), overrides))


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (`perfmodel list`), a preset-format .toml file or an HF config.json."""
    p = check_path("--model", name_or_path)
    if p.suffix == ".json" or (p.is_dir() and (p / "config.json").exists()):
        return from_hf_config(p / "config.json" if p.is_dir() else p)
    if p.suffix == ".toml":
        require(p.exists(), "model", name_or_path, "file not found")
        return from_dict(_read_toml(p))
    return from_dict(_preset_data(name_or_path))


def _section(data: dict, key: str, cls, prefix: str):
    if key not in data:
        return None
    sec = dict(data[key])
    fields = cls.__dataclass_fields__
    for k in sec:
        require(k in fields, f"{prefix}.{k}", sec[k], f"unknown field; known: {', '.join(fields)}")
    try:
        obj = cls(**sec)
    except TypeError as e:
        raise SpecError(prefix, sec, f"missing field ({e})") from None
    for k, v in vars(obj).items():
        if isinstance(v, bool):
            continue
        if isinstance(cls.__dataclass_fields__[k].default, float):
            require(isinstance(v, (int, float)) and v >= 0, f"{prefix}.{k}", v, "must be a number >= 0")
        else:
            require(isinstance(v, int) and v >= 0, f"{prefix}.{k}", v, "must be an integer >= 0")
    return obj


def from_dict(data: dict) -> ModelSpec:
    """Build and validate a ModelSpec from the preset schema (see presets/models/*.toml)."""
    check_tree(data, MODEL_FILE)
    for key in ("name", "hidden", "vocab", "layers"):
        require(key in data, key, None, "required field is missing")
    n = positive_int("layers", data["layers"])
    require(n <= MAX_LAYERS, "layers", n, f"at most {MAX_LAYERS}")
    attn = data.get("attention", {})
    default = attn.get("default", "gqa")
    require(default in ATTENTION_KINDS, "attention.default", default,
            f"must be one of {ATTENTION_KINDS}")
    kinds = [default] * n
    for key, idx in attn.items():
        if key == "default":
            continue
        kind = key.removesuffix("_layers")
        require(key.endswith("_layers") and kind in ATTENTION_KINDS, f"attention.{key}", idx,
                f"expected <kind>_layers with kind in {ATTENTION_KINDS}")
        for i in idx:
            require(isinstance(i, int) and 1 <= i <= n, f"attention.{key}", i,
                    f"layer numbers are 1-based and <= layers ({n})")
            kinds[i - 1] = kind
    ffn = data.get("ffn", {})
    dense = set(ffn.get("dense_layers", [] if "moe" in data else range(1, n + 1)))
    layers = tuple(Layer(i, kinds[i - 1], "dense" if i in dense else "moe") for i in range(1, n + 1))
    formats = {fam: get_format(fmt, f"formats.{fam}") for fam, fmt in data.get("formats", {}).items()}
    for fam in WEIGHT_FAMILIES + CACHE_FAMILIES:
        formats.setdefault(fam, get_format("f32" if fam == "state" else "bf16"))
    unknown = set(formats) - set(WEIGHT_FAMILIES + CACHE_FAMILIES)
    require(not unknown, "formats", sorted(unknown), "unknown weight family")
    spec = ModelSpec(
        name=str(data["name"]), hidden=positive_int("hidden", data["hidden"]),
        vocab=positive_int("vocab", data["vocab"]), layers=layers, formats=formats,
        kda=_section(data, "kda", KDA, "kda"), mla=_section(data, "mla", MLA, "mla"),
        gqa=_section(data, "gqa", GQA, "gqa"),
        dense_width=int(ffn.get("dense_width", 0)), moe=_section(data, "moe", MoE, "moe"),
        tie_embeddings=bool(data.get("tie_embeddings", False)),
        sources=dict(data.get("sources", {})))
    _validate(spec)
    return spec


def _validate(s: ModelSpec) -> None:
    for kind in ATTENTION_KINDS:
        if s.count(attention=kind):
            require(getattr(s, kind) is not None, kind, None,
                    f"{s.count(attention=kind)} layers use {kind} but [{kind}] is missing")
    if s.kda:
        positive_int("kda.heads", s.kda.heads), positive_int("kda.head_dim", s.kda.head_dim)
    if s.mla:
        positive_int("mla.heads", s.mla.heads), positive_int("mla.kv_lora_rank", s.mla.kv_lora_rank)
    if s.gqa:
        positive_int("gqa.heads", s.gqa.heads), positive_int("gqa.kv_heads", s.gqa.kv_heads)
        require(s.gqa.heads % s.gqa.kv_heads == 0, "gqa.kv_heads", s.gqa.kv_heads,
                f"must divide gqa.heads ({s.gqa.heads})")
    if s.count(ffn="dense"):
        positive_int("ffn.dense_width", s.dense_width)
    if s.count(ffn="moe"):
        require(s.moe is not None, "moe", None, "MoE layers present but [moe] is missing")
        m = s.moe
        positive_int("moe.experts", m.experts), positive_int("moe.top_k", m.top_k)
        require(m.experts <= MAX_EXPERTS, "moe.experts", m.experts, f"at most {MAX_EXPERTS}")
        check_range("moe.routing_skew", m.routing_skew, 0, MAX_SKEW)
        positive_int("moe.expert_width", m.expert_width)
        require(m.top_k <= m.experts, "moe.top_k", m.top_k,
                f"must be <= moe.experts ({m.experts})")


# ----- Hugging Face config.json ---------------------------------------------------------------

def from_hf_config(path: Path) -> ModelSpec:
    """DeepSeek-V3 / Kimi K2 / Kimi Linear / Llama style config.json -> ModelSpec."""
    text = read_text(path, "model file")
    try:
        c = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, deep nesting
        raise SpecError("model file", str(path), f"not a readable JSON config: {e}") from None
    require(isinstance(c, dict), "model file", str(path), "expected a JSON object")
    c = check_tree(c.get("text_config", c), HF_CONFIG, "config.json")

    def get(key, default=None):
        if key in c:
            return c[key]
        if default is None:
            raise SpecError(f"config.json:{key}", None, "required key is missing")
        return default

    n = get("num_hidden_layers")
    d: dict = {"name": c.get("_name_or_path") or Path(path).parent.name or "hf-model",
               "hidden": get("hidden_size"), "vocab": get("vocab_size"), "layers": n,
               "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
               "sources": {"all": f"Hugging Face config {path}"}}
    heads = get("num_attention_heads")
    if "kv_lora_rank" in c and c.get("kv_lora_rank"):
        d["mla"] = {"heads": heads, "q_lora_rank": c.get("q_lora_rank") or 0,
                    "kv_lora_rank": get("kv_lora_rank"), "qk_nope_dim": get("qk_nope_head_dim"),
                    "qk_rope_dim": get("qk_rope_head_dim"), "v_head_dim": get("v_head_dim")}
        d["attention"] = {"default": "mla"}
    else:
        kv = c.get("num_key_value_heads", heads)
        d["gqa"] = {"heads": heads, "kv_heads": kv,
                    "head_dim": c.get("head_dim") or get("hidden_size") // heads,
                    "window": c.get("sliding_window") or 0}
        d["attention"] = {"default": "gqa"}
    lin = c.get("linear_attn_config")
    if lin:
        d["kda"] = {"heads": lin.get("num_heads", heads), "head_dim": lin.get("head_dim", 128),
                    "conv_width": lin.get("short_conv_kernel_size", 4)}
        d["attention"] = {"default": "kda", "mla_layers": list(lin.get("full_attn_layers", []))}
    experts = c.get("n_routed_experts") or c.get("num_experts")
    if experts:
        shared = (c.get("n_shared_experts") or 0) * get("moe_intermediate_size")
        d["moe"] = {"experts": experts, "top_k": get("num_experts_per_tok"),
                    "expert_width": get("moe_intermediate_size"), "shared_width": shared}
        first = c.get("first_k_dense_replace", 0)
        d["ffn"] = {"dense_layers": list(range(1, first + 1)),
                    "dense_width": c.get("intermediate_size", 0)}
    else:
        d["ffn"] = {"dense_layers": list(range(1, n + 1)), "dense_width": get("intermediate_size")}
    qc = c.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8" or qc.get("fmt") == "e4m3":
        d["formats"] = {f: "fp8" for f in ("attention", "dense_ffn", "shared_expert", "routed_expert")}
    return from_dict(d)
