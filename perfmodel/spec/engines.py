"""GPU serving engines the multi-kernel model knows (perfmodel/data/serving_engines/*.toml) and the
layouts they refuse, checked before anything is predicted."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from perfmodel.util import schema
from perfmodel.util.errors import SpecError, require

ENGINE_DIR = Path(__file__).parents[1] / "data" / "serving_engines"
ROW_PARALLEL = ("o_proj", "down", "shared_down", "out_proj")   # split along the input over tp


def serving_engines() -> list[str]:
    return sorted(p.stem for p in ENGINE_DIR.glob("*.toml"))


@lru_cache(maxsize=None)
def inventory(name: str) -> dict:
    """One engine's kernel inventory (the TOML file as a dict)."""
    if name not in serving_engines():
        raise SpecError("serving_engine", name, f"one of {', '.join(serving_engines())}")
    return schema.load(ENGINE_DIR / f"{name}.toml", {"*": None}, "serving engine inventory", fmt="toml")


def check_serving_layout(model, hw, d) -> None:
    """Refuse what the engine refuses: an unknown engine; a tensor-parallel split of a
    block-quantised matrix that cuts a quantisation block (`check_block_splits`); all-to-all EP
    that is not over every device."""
    inv = inventory(d.serving_engine)
    check_block_splits(model, d, set(inv.get("replicated", {}).get("matmuls", [])), d.serving_engine)
    if d.moe_comm == "all_to_all":
        require(model.moe is not None, "moe_comm", d.moe_comm, "all-to-all dispatch needs a MoE model")
        require(d.expert_groups == d.devices, "ep", d.expert_groups,
                f"all-to-all EP (DeepEP) puts whole experts on every device: ep must equal devices ({d.devices})")


def kept_whole() -> set[str]:
    """The matrices every serving engine keeps whole on each GPU (the generic engine's default)."""
    return set.intersection(*(set(inventory(e).get("replicated", {}).get("matmuls", [])) for e in serving_engines()))


FFN_FAMILIES = ("dense_ffn", "shared_expert", "routed_expert")  # split by every engine
PADDED = ("mxfp4", "nvfp4")  # MoE methods pad the experts' width per GPU (vLLM Mxfp4MoEMethod, FlashInfer FP4 MoE)


def check_block_splits(model, d, replicated: set[str] | None = None, engine: str = "") -> None:
    """A tensor-parallel split of a block-quantised matrix must keep whole blocks on every GPU (vLLM:
    "not divisible by weight quantization block_n"; SGLang and TensorRT-LLM refuse it too): the
    attention / dense / shared weights over `tp`, the routed experts over devices / ep; matrices
    the engine keeps whole (`replicated`) and the router are not split. With no engine named, only
    the FFN weights, which every engine splits this way, are checked."""
    families = FFN_FAMILIES if replicated is None else None
    replicated = kept_whole() if replicated is None else replicated
    etp = d.devices // d.expert_groups
    who = f"{engine} refuses it" if engine else "GPU serving engines (vLLM, SGLang, TensorRT-LLM) refuse it"
    for layer in {l.attention: l for l in model.layers}.values():
        for mm in model.layer_matmuls(layer):
            fmt = model.matmul_format(mm)
            bo, bi = fmt.block
            if mm.family == "router" or mm.name in replicated or max(bo, bi) <= 1 or \
                    (families and mm.family not in families) or (mm.family == "routed_expert" and fmt.name in PADDED):
                continue
            shards, field = (etp, "ep") if mm.family == "routed_expert" else (d.tp, "tp")
            if shards == 1:
                continue
            dim, block = (mm.d_in, bi) if mm.name in ROW_PARALLEL or mm.name == "expert_down" else (mm.d_out, bo)
            if mm.name == "expert_gate_up":
                dim = dim // (1 + model.ffn_gated)
            if block > 1 and (dim % shards or (dim // shards) % block):
                value = d.tp if field == "tp" else d.expert_groups
                raise SpecError(field, value, f"{who}: {mm.name} ({dim} wide, {fmt.name} in "
                                f"{block}-wide blocks) split {shards} ways is {dim / shards:g} per GPU, not a "
                                f"multiple of the block")
