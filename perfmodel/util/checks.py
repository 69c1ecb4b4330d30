"""Checks at the input boundary: value types, finite numbers, ranges, and sizes that bound memory.

Loaders call these on the raw data of a file (TOML / JSON) before building a spec, so a bad
file fails with one `SpecError` naming the field and its value, never deep inside the model.
"""
from __future__ import annotations

import math
import unicodedata

from perfmodel.util.errors import require

# Sizes that keep one prediction within memory and seconds (real models are far below them).
MAX_LAYERS = 1024          # Kimi K3: 93
MAX_EXPERTS = 65536        # Kimi K3: 896 routed experts
MAX_INT = 2**53            # larger integers lose precision (and overflow) as floats
MAX_DEPTH = 8              # nesting of tables / lists in a spec file
MAX_ITEMS = 100_000        # entries of one list or table

MAX_SKEW = 10.0            # Zipf exponent of expert popularity (1 is already very skewed)
MAX_MIB = 2**30            # an on-chip buffer or ring depth in MiB (1 PiB)

NUMBER, INT, STR, BOOL, TABLE, LIST = "a number", "an integer", "a string", "a boolean", "a table", "a list"
COUNT = "a positive integer"
LAYERS = f"an integer in [0, {MAX_LAYERS}]"
_CHECK = {NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
          STR: lambda v: isinstance(v, str), BOOL: lambda v: isinstance(v, bool),
          TABLE: lambda v: isinstance(v, dict), LIST: lambda v: isinstance(v, list),
          COUNT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          LAYERS: lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LAYERS,
          None: lambda v: v is None}

# File schemas for check_tree: a tuple of kinds; a dict for a table ("*": any other key); a
# one-element list for a list of that rule. Finer checks stay with the loaders.
_SECTION = {"*": (NUMBER, BOOL)}
MODEL_FILE = {"name": (STR,), "base": (STR,), "hidden": (INT,), "vocab": (INT,),
              "layers": (INT,), "tie_embeddings": (BOOL,),
              "attention": {"default": (STR,), "*": [(INT,)]},
              "ffn": {"dense_layers": [(INT,)], "dense_width": (INT,)},
              "formats": {"*": (STR,)}, "sources": {"*": (STR,)},
              "kda": _SECTION, "mla": _SECTION, "gqa": _SECTION, "moe": _SECTION}
HARDWARE_FILE = {"peak_flops_per_s": {"*": (NUMBER,)}, "efficiency": {"*": (NUMBER,)},
                 "components": {"*": (NUMBER,)},
                 "sources": {"*": (STR,)}, "*": (NUMBER, STR)}
_OPT_INT = (INT, None)
HF_CONFIG = {"_name_or_path": (STR, None), "num_hidden_layers": (LAYERS,), "hidden_size": (COUNT,),
             "vocab_size": (COUNT,), "tie_word_embeddings": (BOOL, None),
             "num_attention_heads": (COUNT,), "num_key_value_heads": (COUNT, None),
             "head_dim": _OPT_INT, "sliding_window": _OPT_INT, "kv_lora_rank": _OPT_INT,
             "q_lora_rank": _OPT_INT, "qk_nope_head_dim": _OPT_INT, "qk_rope_head_dim": _OPT_INT,
             "v_head_dim": _OPT_INT, "intermediate_size": _OPT_INT,
             "n_routed_experts": _OPT_INT, "num_experts": _OPT_INT, "n_shared_experts": _OPT_INT,
             "moe_intermediate_size": _OPT_INT, "num_experts_per_tok": _OPT_INT,
             "first_k_dense_replace": (LAYERS, None), "quantization_config": (TABLE, None),
             "linear_attn_config": {"num_heads": (COUNT,), "head_dim": (COUNT,),
                                    "short_conv_kernel_size": (INT,), "full_attn_layers": [(INT,)]}}


def check_type(field: str, value, *kinds: str | None):
    """`value` if it is one of `kinds` (NUMBER, INT, COUNT, STR, ..., None for null)."""
    require(any(_CHECK[k](value) for k in kinds), field, value,
            "must be " + " or ".join(k or "null" for k in kinds))
    return value


def check_finite(field: str, value):
    if isinstance(value, float):
        require(math.isfinite(value), field, value, "must be a finite number")
    elif isinstance(value, int) and not isinstance(value, bool):
        require(abs(value) <= MAX_INT, field, value, "magnitude must be <= 2**53")
    return value


def check_range(field: str, value, lo=None, hi=None, lo_open: bool = False):
    """`value` (a finite number) within [lo, hi] ((lo, hi] with lo_open)."""
    check_finite(field, check_type(field, value, NUMBER))
    if lo is not None:
        ok = value > lo if lo_open else value >= lo
        require(ok, field, value, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None:
        require(value <= hi, field, value, f"must be <= {hi}")
    return value


def check_tree(data, rule=None, field: str = "file", depth: int = 0):
    """Every value in parsed file data finite, bounded and nested at most MAX_DEPTH deep, and of
    the kind `rule` (a schema as MODEL_FILE) says; returns `data`."""
    require(depth <= MAX_DEPTH, field, "...", f"nested more than {MAX_DEPTH} deep")
    if isinstance(rule, dict):
        check_type(field, data, TABLE)
    elif isinstance(rule, list):
        check_type(field, data, LIST)
    elif rule:
        check_type(field, data, *rule)
    if isinstance(data, (dict, list)):
        require(len(data) <= MAX_ITEMS, field, f"{len(data)} entries", f"at most {MAX_ITEMS}")
    if isinstance(data, list):
        for i, v in enumerate(data):
            check_tree(v, rule[0] if isinstance(rule, list) else None, f"{field}[{i}]", depth + 1)
    elif isinstance(data, dict):
        sub = rule if isinstance(rule, dict) else {}
        for k, v in data.items():
            check_tree(v, sub.get(k, sub.get("*")), f"{field}.{k}" if depth else str(k), depth + 1)
    else:
        check_finite(field, data)
    return data


def one_line(text: str) -> str:
    """`text` with control, format and separator characters (and lone surrogates) escaped."""
    return "".join(c.encode("unicode_escape").decode("ascii") if c != " " and
                   unicodedata.category(c)[0] in "CZ" else c for c in str(text))
