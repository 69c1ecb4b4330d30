"""Compile the megakernel for a TPU on a machine without one: JAX's ahead-of-time path with
libtpu's own compiler (Mosaic), for one chip of the config's kind.

Mosaic's checks (tile-aligned offsets, layouts, dtypes the chip's MXU and vector unit take,
VMEM) run in libtpu, not in JAX, so interpret mode cannot show them; this can. It needs the
`libtpu` package (`pip install 'jax[tpu]'`, the libtpu that matches the JAX in use) and no
chip: `jax.experimental.topologies` describes a one-chip topology and `.compile()` runs the
same passes as on the chip. `compile_kernel` raises `MosaicRefusal` with Mosaic's message.

While lowering, JAX's Pallas rules ask `tpu_info.get_tpu_info()` for the default device (the
CPU here); `_target_chip` answers with the config's chip for the duration of the lowering.
"""
from __future__ import annotations

import contextlib
import importlib.util
import time

import jax
from jax.sharding import SingleDeviceSharding

from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import require

from . import megakernel, vmem
from .layout import KernelConfig

# one-chip topology of each chip: (name, libtpu's keyword arguments)
TOPOLOGIES = {
    "v5e": ("v5e:1x1", dict(chips_per_host_bounds=[1, 1, 1], num_slices=1,
                            wrap=[False, False, False])),
    "v6e": ("v6e:1x1", dict(chips_per_host_bounds=[1, 1, 1], num_slices=1,
                            wrap=[False, False, False])),
}


class MosaicRefusal(Exception):
    """Mosaic (libtpu) refused the kernel; the message is its own."""


def available() -> bool:
    """Whether libtpu is installed (the ahead-of-time compiler)."""
    return importlib.util.find_spec("libtpu") is not None


@contextlib.contextmanager
def _target_chip(info):
    from jax._src.pallas.mosaic import tpu_info
    saved = tpu_info.get_tpu_info
    tpu_info.get_tpu_info = lambda *a, **k: info
    try:
        yield
    finally:
        tpu_info.get_tpu_info = saved


def device(chip: str):
    """The one device of a one-chip topology of `chip` (no chip attached)."""
    from jax.experimental import topologies
    require(chip in TOPOLOGIES, "chip", chip,
            f"ahead-of-time compilation knows {', '.join(TOPOLOGIES)}")
    name, kwargs = TOPOLOGIES[chip]
    return topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs).devices[0]


def compile_kernel(spec: ModelSpec, cfg: KernelConfig) -> dict:
    """Lower and compile the one-device megakernel for cfg's chip; {"lower_s", "compile_s",
    "vmem_bytes"} or MosaicRefusal. The VMEM budget is checked first (SpecError)."""
    require(available(), "libtpu", "not installed",
            "ahead-of-time compilation for a TPU needs libtpu (pip install 'jax[tpu]')")
    budget = vmem.check_vmem(spec, cfg)
    sharding = SingleDeviceSharding(device(cfg.chip))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            for a in megakernel.call_args(spec, cfg)]
    # the limit the budget claims suffices (the chip itself gives Mosaic its whole VMEM)
    call = megakernel.build_call(spec, cfg, vmem_limit_bytes=budget.total_bytes + vmem.MARGIN_BYTES)
    with _target_chip(cfg.target.info):
        t0 = time.perf_counter()
        lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("tpu",))
        t1 = time.perf_counter()
        try:
            lowered.compile()
        except Exception as e:   # libtpu reports Mosaic's refusal as a runtime error
            if "Mosaic" not in str(e):
                raise
            raise MosaicRefusal(str(e).split("Please report a bug")[0].strip()) from None
    return {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
            "vmem_bytes": budget.total_bytes}
