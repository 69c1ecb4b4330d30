"""Storage formats of weights and caches as data, with their true size including scales.

A format is bits per value plus block scales: a scale of `scale_dtype` shared by a block of
[outputs, inputs] of a weight matrix (0 = the whole dimension), and optionally one more scale
per tensor. It also says how a matrix unit is fed its values: `compute_dtype` where the chip's
matrix unit takes that operand (`scale_rows` LHS rows per batch row when the block scales are
applied through a block-diagonal LHS), else `fallback_dtype` (`fallback_scale_rows`); a chip
that takes neither is an error, never a silent bf16 (`Format.feed`). The built-in formats and
their sources are in `presets/formats.toml`; a model file defines new ones under
`[custom_formats.<name>]` with the same fields, no code needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from perfmodel.util import schema
from perfmodel.util.errors import SpecError, in_file, require

SCALE_BITS = {"": 0, "e8m0": 8, "e4m3": 8, "bf16": 16, "fp16": 16, "f32": 32}
COMPUTE_DTYPES = ("f32", "bf16", "fp8", "int8", "int4", "fp4")
FORMAT_FIELDS = ("value_bits", "scale_dtype", "block", "global_scale_dtype", "compute_dtype", "scale_rows",
                 "fallback_dtype", "fallback_scale_rows", "source")
MAX_SCALE_ROWS = 1024


@dataclass(frozen=True)
class Format:
    """A storage format: bits per value, its block and global scales, and how a matrix unit is fed
    its values (module docstring)."""
    name: str
    value_bits: int
    scale_dtype: str = ""
    block: tuple[int, int] = (1, 1)     # [outputs, inputs] sharing one scale; 0 = whole dimension
    global_scale_dtype: str = ""
    compute_dtype: str = "bf16"
    source: str = field(default="", compare=False)
    scale_rows: int = 1          # LHS rows per batch row fed with compute_dtype (block-diagonal scales)
    fallback_dtype: str = ""     # what a matrix unit without compute_dtype is fed ("" = none: an error)
    fallback_scale_rows: int = 1
    decode: str = ""             # a kernel's vector-unit decode before the feed (components.DECODE_KINDS)
    decode_passes: int = 0       # the passes of that decode a routed expert takes (components.decode_pass_time)

    def feed(self, native: frozenset[str], chip: str = "the chip") -> tuple[str, int]:
        """(operand dtype, LHS rows per batch row) a matrix unit taking the dtypes `native` is fed:
        compute_dtype where it takes it, else the fallback; SpecError when it takes neither."""
        if self.compute_dtype in native:
            return self.compute_dtype, self.scale_rows
        if self.fallback_dtype in native:
            return self.fallback_dtype, self.fallback_scale_rows
        raise SpecError(f"format {self.name}", self.compute_dtype,
                        f"{chip}'s matrix unit takes {', '.join(sorted(native))}; the format names no "
                        f"fallback it takes (fallback_dtype = {self.fallback_dtype!r})")

    @property
    def bits_per_value(self) -> float:
        """Bits per value for large tensors (a whole-dimension block's scale counts as 0)."""
        bo, bi = self.block
        per_scale = bo * bi
        return self.value_bits + (SCALE_BITS[self.scale_dtype] / per_scale if per_scale else 0.0)

    @property
    def bytes_per_value(self) -> float:
        return self.bits_per_value / 8

    def tensor_bytes(self, d_in: int, d_out: int, count: int = 1) -> float:
        """Exact bytes of `count` [d_out, d_in] matrices: values, block scales and global scales."""
        bits = d_in * d_out * self.value_bits + SCALE_BITS[self.global_scale_dtype]
        if self.scale_dtype:
            bo, bi = self.block
            bits += (math.ceil(d_out / bo) if bo else 1) * (math.ceil(d_in / bi) if bi else 1) \
                * SCALE_BITS[self.scale_dtype]
        return count * bits / 8


def format_from_dict(name: str, d: dict, where: str) -> Format:
    """A Format from its data-file fields, every field type- and range-checked."""
    require(isinstance(d, dict), where, d, "a format is a table of fields")
    for k in d:
        require(k in FORMAT_FIELDS, f"{where}.{k}", d[k], f"unknown field; known: {', '.join(FORMAT_FIELDS)}")
    bits = d.get("value_bits")
    require(isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 64,
            f"{where}.value_bits", bits, "must be an integer in 1..64")
    for k in ("scale_dtype", "global_scale_dtype"):
        v = d.get(k, "")
        require(isinstance(v, str) and v in SCALE_BITS, f"{where}.{k}", v, f"must be one of {sorted(SCALE_BITS)}")
    block = d.get("block", [1, 1])
    require(isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 1 << 20 for b in block),
            f"{where}.block", block, "must be [outputs, inputs], integers in 0..1048576 (0 = whole dimension)")
    compute = d.get("compute_dtype", "bf16")
    require(compute in COMPUTE_DTYPES, f"{where}.compute_dtype", compute, f"must be one of {COMPUTE_DTYPES}")
    fallback = d.get("fallback_dtype", "")
    require(fallback in COMPUTE_DTYPES + ("",), f"{where}.fallback_dtype", fallback,
            f"must be one of {COMPUTE_DTYPES} or \"\" (none)")
    rows = {}
    for k in ("scale_rows", "fallback_scale_rows"):
        v = d.get(k, 1)
        require(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SCALE_ROWS, f"{where}.{k}", v,
                f"must be an integer in 1..{MAX_SCALE_ROWS}")
        rows[k] = v
    require(isinstance(d.get("source", ""), str), f"{where}.source", d.get("source"), "must be a string")
    return Format(name, bits, d.get("scale_dtype", ""), tuple(block), d.get("global_scale_dtype", ""),
                  compute, d.get("source", ""), fallback_dtype=fallback, **rows)


def _builtin() -> dict[str, Format]:
    path = Path(__file__).parents[1] / "presets" / "formats.toml"
    data = schema.load(path, {"*": {"*": None}}, "formats file", fmt="toml")
    with in_file(path):
        return {name: format_from_dict(name, d, name) for name, d in data.items()}


FORMATS = _builtin()


def get_format(name: str, field: str = "format", custom: dict[str, Format] | None = None) -> Format:
    table = {**FORMATS, **(custom or {})}
    if not isinstance(name, str) or name not in table:
        raise SpecError(field, name, f"unknown storage format; known: {', '.join(table)}")
    return table[name]
