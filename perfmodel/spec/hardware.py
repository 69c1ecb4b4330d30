"""Accelerator specs: peak rates, memories, links, engine overheads and efficiency parameters.

A preset is one TOML file in `presets/hardware/` (a user adds a chip with one file). Every
numeric field needs an entry in the file's `[sources]` table, keyed by its dotted name.
Rates in the file are per chip; `per_core` derives the per-core figures the model uses (a TPU v7
chip is two TensorCores, each its own JAX device).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from perfmodel.util.checks import HARDWARE_FILE, check_tree
from perfmodel.util import schema
from perfmodel.util.errors import in_file, require
from perfmodel.util.files import check_path

PRESET_DIR = Path(__file__).parents[1] / "presets" / "hardware"
DMA_SHARING = ("fifo", "shared")
OPTIONAL = ("jax_chip", "dma_concurrent_copies", "domain_devices", "node_devices", "fabric_bandwidth_bytes_per_s",
            "fabric_latency_s", "collective_tables")
COLLECTIVE_ALGORITHMS = ("ring", "tree", "one_shot")


@dataclass(frozen=True)
class Efficiency:
    """Named efficiency parameters: the only knobs calibration may move."""
    hbm: float = 0.9                     # sustained / peak HBM bandwidth for streaming copies
    flops: float = 0.6                   # sustained / peak matmul rate on decode-shaped matmuls
    collective_latency_scale: float = 1.0  # multiplies every link latency term
    op_overhead_s: float = 0.0           # fixed cost per op (launch, sync) beyond the roofline


@dataclass(frozen=True)
class Hardware:
    """One accelerator as its preset file gives it (module docstring): rates, memories, links,
    overheads, fitted components and the source of each number."""
    name: str
    kind: str                           # "tpu", "gpu" or "cpu"
    cores_per_chip: int
    peak_flops_per_s: dict[str, float]  # per chip, by operand dtype
    hbm_bytes: float                    # per chip
    hbm_bandwidth_bytes_per_s: float    # per chip
    onchip_bytes: float                 # per core: VMEM (TPU), shared memory per SM x SMs (GPU), LLC (CPU)
    onchip_kind: str
    intra_chip_bandwidth_bytes_per_s: float  # per direction, between cores of one chip
    intra_chip_latency_s: float
    link_bandwidth_bytes_per_s: float   # per direction per chip (ICI / NVLink)
    link_latency_s: float               # one hop / one collective step
    collective_base_latency_s: float    # fixed cost of launching one collective
    collective_algorithm: str           # small-message algorithm: ring, tree or one_shot
    launch_overhead_s: float            # per kernel of a multi-kernel engine
    dma_latency_s: float                # issue -> first byte of an HBM -> on-chip copy
    dma_sharing: str                    # how concurrent copies share the DMA engine
    dma_tile_bytes: int                 # granule a kernel streams weights in (fill / drain)
    dma_concurrent_copies: int = 0      # shared DMA: copies in service at once, round-robin among
                                        # them, the others waiting in issue order (0: no limit)
    efficiency: Efficiency = Efficiency()
    jax_chip: str = ""                  # pltpu.ChipVersion member name, for TPUs
    domain_devices: int = 0             # GPUs per NVLink domain (8 HGX, 72 GB200 NVL72); 0: one domain
    node_devices: int = 0               # GPUs per host (a custom all-reduce stays inside one); 0: the domain
    fabric_bandwidth_bytes_per_s: float = 0.0  # inter-node fabric per GPU per direction (0: none given)
    fabric_latency_s: float = 0.0       # one inter-node step of a small collective
    collective_tables: str = ""         # a GPU whose kernel tables time collectives over the same NVLink
                                        # fabric, where this one's have none ("": none)
    components: dict[str, float] = field(default_factory=dict)  # perfmodel.cost.components parameters
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def core_flops_per_s(self) -> dict[str, float]:
        return {k: v / self.cores_per_chip for k, v in self.peak_flops_per_s.items()}

    @property
    def core_hbm_bandwidth_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_bytes_per_s / self.cores_per_chip

    @property
    def core_hbm_bytes(self) -> float:
        return self.hbm_bytes / self.cores_per_chip

    def flops_rate(self, dtype: str) -> float:
        """Per-core peak for operands of `dtype`, falling back to bf16 when the unit lacks it."""
        rates = self.core_flops_per_s
        return rates.get(dtype) or rates["bf16"]

    def with_efficiency(self, **changes) -> "Hardware":
        return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))

    def with_components(self, **changes) -> "Hardware":
        return dataclasses.replace(self, components={**self.components, **changes})

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)

    @property
    def assumed(self) -> list[str]:
        """Fields and components whose source says they are assumed (no measurement)."""
        return sorted(k for k, v in self.sources.items() if str(v).lower().startswith(("assumed", "assumption")))


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_hardware(name_or_path: str) -> Hardware:
    p = check_path("--hardware", name_or_path)
    if p.suffix == ".toml":
        require(p.exists(), "hardware", name_or_path, "file not found")
    else:
        require(name_or_path in list_presets(), "hardware", name_or_path,
                f"unknown preset; known: {', '.join(list_presets())} (or give a .toml path)")
        p = PRESET_DIR / f"{name_or_path}.toml"
    data = schema.load(p, HARDWARE_FILE, "hardware file", fmt="toml")
    with in_file(p):
        return from_dict(data)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def from_dict(data: dict) -> Hardware:
    data = dict(check_tree(data, HARDWARE_FILE))
    sources = data.pop("sources", {})
    eff = data.pop("efficiency", {})
    comp = data.pop("components", {})
    names = {f.name for f in dataclasses.fields(Hardware)} - {"efficiency", "sources", "components"}
    for k in data:
        require(k in names, k, data[k], "unknown hardware field")
    missing = sorted(names - set(data) - set(OPTIONAL))
    require(not missing, missing[0] if missing else "", None, "required hardware field is missing")
    for k in eff:
        require(k in Efficiency.__dataclass_fields__, f"efficiency.{k}", eff[k],
                f"unknown efficiency parameter; known: {', '.join(Efficiency.__dataclass_fields__)}")
    require(isinstance(comp, dict), "components", comp, "must be a table of name = number")
    hw = Hardware(**data, efficiency=Efficiency(**eff), components=comp, sources=sources)
    validate(hw)
    unsourced = [k for k, v in _flatten({**data, "efficiency": eff, "components": comp}).items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in sources
                 and k.split(".")[0] not in sources]
    require(not unsourced, "sources", unsourced, "every number needs a source entry")
    return hw


def _number(field: str, v) -> None:
    require(isinstance(v, (int, float)) and not isinstance(v, bool), field, v, "must be a number")


def validate(hw: Hardware) -> None:
    for f in dataclasses.fields(Hardware):
        v = getattr(hw, f.name)
        if f.type in ("float", "int"):
            _number(f.name, v)
        elif f.type == "str":
            require(isinstance(v, str), f.name, v, "must be a string")
    require(isinstance(hw.peak_flops_per_s, dict), "peak_flops_per_s", hw.peak_flops_per_s,
            "must be a table of dtype = FLOP/s")
    for k, v in hw.peak_flops_per_s.items():
        _number(f"peak_flops_per_s.{k}", v)
    for f in dataclasses.fields(Efficiency):
        _number(f"efficiency.{f.name}", getattr(hw.efficiency, f.name))
    for k, v in hw.components.items():
        _number(f"components.{k}", v)
        require(v >= 0, f"components.{k}", v, "must be >= 0")
    require(hw.kind in ("tpu", "gpu", "cpu"), "kind", hw.kind, "must be tpu, gpu or cpu")
    require(isinstance(hw.cores_per_chip, int) and hw.cores_per_chip > 0, "cores_per_chip",
            hw.cores_per_chip, "must be a positive integer")
    require("bf16" in hw.peak_flops_per_s, "peak_flops_per_s", hw.peak_flops_per_s,
            "needs at least a bf16 entry")
    for k, v in hw.peak_flops_per_s.items():
        require(v > 0, f"peak_flops_per_s.{k}", v, "must be > 0")
    for name in ("hbm_bytes", "hbm_bandwidth_bytes_per_s", "onchip_bytes", "link_bandwidth_bytes_per_s",
                 "intra_chip_bandwidth_bytes_per_s", "dma_tile_bytes"):
        require(getattr(hw, name) > 0, name, getattr(hw, name), "must be > 0")
    for name in ("intra_chip_latency_s", "link_latency_s", "collective_base_latency_s",
                 "launch_overhead_s", "dma_latency_s"):
        require(getattr(hw, name) >= 0, name, getattr(hw, name), "must be >= 0")
    require(isinstance(hw.dma_tile_bytes, int) and not isinstance(hw.dma_tile_bytes, bool), "dma_tile_bytes",
            hw.dma_tile_bytes, "must be a whole number of bytes")
    for name in ("domain_devices", "node_devices", "dma_concurrent_copies"):
        require(isinstance(getattr(hw, name), int) and getattr(hw, name) >= 0, name, getattr(hw, name),
                "must be an integer >= 0")
    for name in ("fabric_bandwidth_bytes_per_s", "fabric_latency_s"):
        require(getattr(hw, name) >= 0, name, getattr(hw, name), "must be >= 0")
    require(hw.dma_sharing in DMA_SHARING, "dma_sharing", hw.dma_sharing, f"one of {DMA_SHARING}")
    require(hw.collective_algorithm in COLLECTIVE_ALGORITHMS, "collective_algorithm",
            hw.collective_algorithm, f"one of {COLLECTIVE_ALGORITHMS}")
    e = hw.efficiency
    for name in ("hbm", "flops"):
        v = getattr(e, name)
        require(0 < v <= 1, f"efficiency.{name}", v, "must be in (0, 1]")
    require(e.collective_latency_scale >= 0, "efficiency.collective_latency_scale",
            e.collective_latency_scale, "must be >= 0")
    require(e.op_overhead_s >= 0, "efficiency.op_overhead_s", e.op_overhead_s, "must be >= 0")


def to_toml(hw: Hardware, header: str = "") -> str:
    """The hardware file of `hw` (the preset format), sources included."""
    def val(v):
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        return repr(v) if isinstance(v, int) else f"{v:.6g}"
    lines = [f"# {l}" for l in header.splitlines()]
    for f in dataclasses.fields(Hardware):
        v = getattr(hw, f.name)
        if f.name not in ("efficiency", "components", "sources") and not (f.name in OPTIONAL and not v):
            lines.append(f"{f.name} = {val(v)}")
    tables = {"efficiency": dataclasses.asdict(hw.efficiency), "components": hw.components,
              "sources": hw.sources}
    for name, table in tables.items():
        if table:
            lines += ["", f"[{name}]"] + [f"{k if k.isidentifier() else val(k)} = {val(v)}"
                                          for k, v in table.items()]
    return "\n".join(lines) + "\n"


def jax_chip_figures(hw: Hardware) -> dict[str, float] | None:
    """Per-chip figures JAX itself carries for this TPU (`pltpu.get_tpu_info_for_chip`), or None.

    JAX reports per TensorCore; chip figures are those times the physical cores per chip, so
    they compare directly with a preset's per-chip numbers. VMEM stays per core.
    """
    if not hw.jax_chip:
        return None
    from jax.experimental.pallas import tpu as pltpu  # jax only where TPU facts are read
    chip = getattr(pltpu.ChipVersion, hw.jax_chip)
    info = pltpu.get_tpu_info_for_chip(chip, 1)
    n = chip.num_physical_tensor_cores_per_chip
    return {"onchip_bytes": info.vmem_capacity_bytes, "hbm_bytes": info.hbm_capacity_bytes * n,
            "hbm_bandwidth_bytes_per_s": info.mem_bw_bytes_per_second * n,
            "bf16": info.bf16_ops_per_second * n, "fp8": info.fp8_ops_per_second * n}
