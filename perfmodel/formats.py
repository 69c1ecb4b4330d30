"""Storage formats of weights and caches, with their true size including scales.

bits_per_value counts the block scales: MXFP4 is an e2m1 value plus one 8-bit (E8M0) scale
per 32 values = 4.25 bits (OCP Microscaling spec v1.0); NVFP4 is e2m1 plus one FP8 (E4M3)
scale per 16 values = 4.5 bits (NVIDIA Blackwell docs); INT4 as in Kimi K2-Thinking keeps one
bf16 scale per group of 32 = 4.5 bits (Moonshot model card: "group size 32").
"""
from dataclasses import dataclass

from .errors import SpecError


@dataclass(frozen=True)
class Format:
    name: str
    value_bits: int
    scale_bits: int = 0
    group: int = 1  # values sharing one scale
    compute_dtype: str = "bf16"  # operand dtype the MXU / tensor core sees

    @property
    def bits_per_value(self) -> float:
        return self.value_bits + (self.scale_bits / self.group if self.scale_bits else 0.0)

    @property
    def bytes_per_value(self) -> float:
        return self.bits_per_value / 8


FORMATS = {f.name: f for f in (
    Format("f32", 32, compute_dtype="f32"),
    Format("bf16", 16),
    Format("fp16", 16),
    Format("fp8", 8, compute_dtype="fp8"),
    Format("int8", 8, compute_dtype="int8"),
    Format("int4", 4, 16, 32),
    Format("mxfp4", 4, 8, 32, compute_dtype="fp4"),
    Format("nvfp4", 4, 8, 16, compute_dtype="fp4"),
)}


def get_format(name: str, field: str = "format") -> Format:
    if name not in FORMATS:
        raise SpecError(field, name, f"unknown storage format; known: {', '.join(FORMATS)}")
    return FORMATS[name]
