"""The facts of the TPU a kernel is built for, in one place: JAX's own `tpu_info`.

`chip(version)` is the attached TPU when one is attached and no version is asked for, else the
named chip ("v5e", "v6e", "7x", ...; TPU7x when none is named), one TensorCore each. Every
module that needs a tile, a lane count, the MXU width, the VMEM capacity or whether the MXU
takes fp8 asks it: layout, stream, quant, comm and the VMEM budget.

Weight layouts are shared by every supported chip (`SUPPORTED`): an offset or a row count that
a DMA or a slice uses is a multiple of `tile_rows(dtype)`, the largest sublane tiling of that
dtype among them (bf16: 16 rows on TPU7x, 8 on v5e; int8: 32; f32: 8), so one packing serves
v5e and TPU7x alike. Only the lane width of the stream and of an expert tile (`KernelConfig.
tile`, the MXU width: 128 on v5e, 256 on v6e and TPU7x) differs between them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from perfmodel.util.errors import require

DEFAULT = "7x"                   # the chip a kernel is built for when none is attached
SUPPORTED = ("v5e", "v6e", "7x")  # chips whose tiling rules the layouts satisfy


@dataclass(frozen=True)
class Chip:
    """One TensorCore's figures (`pltpu.TpuInfo`), with the questions the kernel asks."""
    info: pltpu.TpuInfo
    attached: bool

    @property
    def version(self) -> str:
        return self.info.chip_version.value

    @property
    def lanes(self) -> int:
        return self.info.num_lanes

    @property
    def mxu(self) -> int:
        """The MXU width: the default stream and expert tile edge."""
        return self.info.mxu_column_size

    @property
    def vmem_bytes(self) -> int:
        return self.info.vmem_capacity_bytes

    @property
    def fp8(self) -> bool:
        """Whether the MXU takes fp8 operands (TPU7x, v6e: yes; v5e: no)."""
        return self.info.fp8_ops_per_second > 0

    def sublane_tiling(self, dtype) -> int:
        """Rows of this chip's (rows, 128) memory tile for dtype."""
        return self.info.get_sublane_tiling(jnp.dtype(dtype))

    def describe(self) -> str:
        how = "attached" if self.attached else "not attached: jax tpu_info figures"
        return f"TPU {self.version} ({how}, one TensorCore)"


@functools.lru_cache(maxsize=None)
def _named(version: str) -> Chip:
    names = [c.value for c in pltpu.ChipVersion]
    require(version in names, "chip", version, f"must be one of {', '.join(names)} (jax tpu_info)")
    return Chip(pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(version), 1), False)


def attached() -> Chip | None:
    """The attached TPU (one TensorCore), or None."""
    if not pltpu.is_tpu_device():
        return None
    return Chip(pltpu.get_tpu_info(), True)


def chip(version: str | None = None) -> Chip:
    """The named chip; without a name the attached TPU, else `DEFAULT`."""
    if version is None:
        return attached() or _named(DEFAULT)
    here = attached()
    return here if here is not None and here.version == version else _named(version)


def _lanes() -> int:
    lanes = {_named(v).lanes for v in SUPPORTED}
    assert len(lanes) == 1, lanes
    return lanes.pop()


@functools.lru_cache(maxsize=None)
def tile_rows(dtype) -> int:
    """Rows every layout offset and count of dtype is a multiple of: the largest sublane tiling
    of dtype among the supported chips."""
    return max(_named(v).sublane_tiling(dtype) for v in SUPPORTED)


def round_rows(n: int, dtype) -> int:
    """n rounded up to whole tiles of dtype (`tile_rows`)."""
    r = tile_rows(dtype)
    return -(-n // r) * r


LANES = _lanes()   # the lane count of every supported chip (128)
