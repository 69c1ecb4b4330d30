"""GPU serving engines the multi-kernel model knows (perfmodel/data/serving_engines/*.toml) and the
layouts they refuse, checked before anything is predicted."""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from perfmodel.spec.arch import GQA
from perfmodel.util import checked, schema
from perfmodel.util.checks import BOOL, STR, ListOf, Num, OneOf, Req, check_tree
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import read_bytes

ENGINE_DIR = Path(__file__).parents[1] / "data" / "serving_engines"
ROW_PARALLEL = ("o_proj", "down", "shared_down", "out_proj")   # split along the input over tp


def serving_engines() -> list[str]:
    return sorted(p.stem for p in ENGINE_DIR.glob("*.toml"))


# An inventory file's schema: every key perfmodel.engine.serving reads, of the type it reads it as
NAME = (STR,)
TABLE_NAME = re.compile(r"[a-z0-9_]{1,64}")  # kernel_tables and measured_as.tables: perfmodel/data/kernels/<gpu>/<name>.npz
# the names a kernel's `values` may multiply (perfmodel.engine.serving._layer_names)
VALUE_NAMES = ("hidden", "latent", "vocab", "experts", "ffn_width", "shared_width", "heads", "head_dim", "kv_heads",
               "q_width", "kv_width", "lora", "rope", "v_width")
# a kernel's `values`: a product of numbers and VALUE_NAMES (a pattern: compiled only where an inventory is checked)
VALUES = r"\s*(?:\d+(?:\.\d+)?|{n})(?:\s*\*\s*(?:\d+(?:\.\d+)?|{n}))*\s*".format(n="|".join(VALUE_NAMES))
COUNT = Num(1, 2**20, integer=True)
INVENTORY = {
    "engine": Req(NAME), "version": Req(NAME), "source": Req(NAME), "kernel_tables": Req(NAME),
    "all_reduce": OneOf("custom", "nccl"), "all_reduce_nvlink_domain": OneOf("mnnvl"), "act_quant": (BOOL,),
    "mla": OneOf("granular", "module"), "kda": Req(ListOf(NAME, 1)), "moe_dispatch": NAME, "fused_moe_reduce": (BOOL,),
    "norm_in_all_reduce": (BOOL,),
    "measured_as": [{"class": Req(NAME), "kernel": NAME, "dtype": NAME, "ep": COUNT, "gpus": [NAME], "tables": [NAME],
                     "table_class": NAME, "why": NAME}],
    "gemm_groups": {"*": ListOf(NAME, 1)}, "replicated": {"matmuls": Req([NAME])},
    "shared_experts_stream": {"max_rows": Req(Num(0, 2**20, integer=True))},
    "latent_moe_tail": {"tp": Req([COUNT]), "max_rows": Req(Num(0, 2**20, integer=True)), "gpus": Req([NAME])},
    "kernel": [{"op": Req(NAME), "name": Req(NAME), "values": Req(NAME), "before": (BOOL,), "attention": NAME}],
    "published": [{"model": Req(NAME), "formats": {"*": NAME}, "hardware": Req(NAME), "devices": Req(COUNT),
                   "tp": Req(COUNT), "ep": COUNT, "kv_cache": NAME, "source": Req(NAME)}],
    "sources": Req({"block_splits": Req(NAME), "*": NAME}),
}
# Where a serving engine is not named (a GPU deployment of the generic multi-kernel engine), the
# rule every engine has for block-quantised splits (each inventory's [sources] block_splits)
BLOCK_SPLITS_SOURCE = ("vLLM fp8.py / fp8_utils.validate_fp8_block_shape: 'not divisible by weight quantization "
                       "block_n'; SGLang alike")


@lru_cache(maxsize=None)
def inventory(name: str) -> dict:
    """One engine's kernel inventory (the TOML file as a dict), through the schema layer (INVENTORY,
    and each kernel's `values` a product of numbers and VALUE_NAMES), checked once per content of
    the file (perfmodel.util.checked)."""
    if name not in serving_engines():
        raise SpecError("serving_engine", name, f"one of {', '.join(serving_engines())}")
    path = ENGINE_DIR / f"{name}.toml"
    raw = read_bytes(path, "serving engine inventory")
    data = schema.parse_file(raw, "toml", "serving engine inventory", path)

    def check():
        with in_file(path):
            check_tree(data, INVENTORY, "file")
            for key, where in ((data["kernel_tables"], "kernel_tables"),) + tuple(
                    (t, f"measured_as[{i}].tables") for i, m in enumerate(data.get("measured_as", []))
                    for t in m.get("tables", [])):
                require(TABLE_NAME.fullmatch(key) is not None, where, key, "must be a table name (letters, digits, _)")
            for i, k in enumerate(data.get("kernel", [])):
                require(re.fullmatch(VALUES, k["values"]) is not None, f"kernel[{i}].values", k["values"],
                        f"must be a product of numbers and {', '.join(VALUE_NAMES)}")
    checked.once(checked.content(raw), "inventory", check)
    return data


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
    require(d.expert_groups > 0 and d.devices % d.expert_groups == 0, "ep", d.expert_groups,
            f"must divide devices ({d.devices})")
    etp = d.devices // d.expert_groups
    source = inventory(engine)["sources"]["block_splits"] if engine else BLOCK_SPLITS_SOURCE
    who = (f"{engine} refuses it" if engine else "GPU serving engines (vLLM, SGLang, TensorRT-LLM) refuse it")
    for layer in {l.attention: l for l in model.layers}.values():
        attn = model.attn(layer.attention) if layer.attention != "none" else None
        for mm in model.layer_matmuls(layer):
            fmt = model.matmul_format(mm)
            bo, bi = fmt.block
            if mm.family == "router" or mm.name in replicated or max(bo, bi) <= 1 or \
                    (families and mm.family not in families) or (mm.family == "routed_expert" and fmt.name in PADDED):
                continue
            shards, field = (etp, "ep") if mm.family == "routed_expert" else (d.tp, "tp")
            if isinstance(attn, GQA) and mm.name in ("k_proj", "v_proj"):
                # fewer KV heads than ranks: each rank holds whole heads, replicated (vLLM
                # QKVParallelLinear: num_kv_head_replicas = tp / total_num_kv_heads; SGLang alike)
                shards = min(shards, attn.kv_heads)
            if shards == 1:
                continue
            dim, block = (mm.d_in, bi) if mm.name in ROW_PARALLEL or mm.name == "expert_down" else (mm.d_out, bo)
            if mm.name == "expert_gate_up":
                dim = dim // (1 + model.ffn_gated)
            if block > 1 and (dim % shards or (dim // shards) % block):
                value = d.tp if field == "tp" else d.expert_groups
                raise SpecError(field, value, f"{who}: {mm.name} ({dim} wide, {fmt.name} in "
                                f"{block}-wide blocks) split {shards} ways is {dim / shards:g} per GPU, not a "
                                f"multiple of the block (source: {source})")
