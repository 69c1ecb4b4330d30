"""Architecture specs derived from a preset, for reference runs and kernel tests at other sizes.

`derived_spec("kimi-k3", hidden=1024, moe={"experts": 64})` merges overrides (nested tables as
dicts) into the preset's data and validates the result like any preset file.
"""
from __future__ import annotations

import tomllib

from perfmodel.arch import PRESET_DIR, ModelSpec, from_dict, load_model
from perfmodel.errors import require

# A kimi-k3 derivative whose widths are not multiples of the 128-wide tile (head dims 64,
# expert width 96, q_lora 192), with 6 layers and 32 experts top-6: exercises tile padding.
ODD_SIZED = dict(
    name="kimi-k3-odd", hidden=384, vocab=2048, layers=6,
    attention={"default": "kda", "mla_layers": [4, 6]},
    kda={"heads": 3, "head_dim": 64, "decay_gate_rank": 64},
    mla={"heads": 3, "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_dim": 64,
         "qk_rope_dim": 64, "v_head_dim": 64},
    ffn={"dense_layers": [1], "dense_width": 768},
    moe={"experts": 32, "top_k": 6, "expert_width": 96, "shared_width": 192, "latent_dim": 192},
    formats={"routed_expert": "bf16"})


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def derived_spec(base: str = "kimi-k3", **overrides) -> ModelSpec:
    """The preset `base` with `overrides` applied (a nested table replaces only named keys;
    `attention` is replaced whole, since its layer lists depend on the layer count)."""
    load_model(base)  # a clear SpecError for an unknown preset
    data = tomllib.loads((PRESET_DIR / f"{base}.toml").read_text())
    require("base" not in data, "base", base, "derive from a root preset (one without base)")
    if "attention" in overrides:
        data.pop("attention", None)
    return from_dict(_merge(data, overrides))
