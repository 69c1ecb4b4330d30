"""Host microbenchmarks: this machine's memory bandwidth, matmul FLOP/s and JAX overheads, written
as a hardware file (`kind = "cpu"`) that `perfmodel.spec.hardware.load_hardware` reads.

Measured (min / median / max over repeats, all through JAX on the default CPU device):
- streaming read bandwidth: a jitted sum over f32 arrays of several sizes beyond the last-level
  cache; the largest size's median is `hbm_bandwidth_bytes_per_s`; copy (read + write) is reported
  beside it;
- matmul FLOP/s: large square matmuls in bf16 and f32 (`peak_flops_per_s`), and a decode-shaped
  matmul (`DECODE_ROWS` rows x a cache-resident weight) whose rate / peak is `efficiency.flops`;
- decode-shaped matmul bandwidth: weight bytes / time of a (rows x K) @ (K x N) dot over a
  MATVEC_MIB weight, for each batch size in MATVEC_ROWS and each dtype (reported; the
  validation uses it to show how far XLA:CPU's dot falls below the streaming rate);
- the fixed cost of a dot inside a program: one program chaining DOT_CHAIN_LEN dependent dots
  over distinct 4 MiB f32 weights, per dot, by rows (`host-dot-chain-f32-r*`, fitted with the
  256 MiB dots: the large dot sets the rates, the small one the fixed cost);
- the absorbed MLA's use of kv_b: the reference splits kv_b into W_uk and W_uv and XLA:CPU lays
  each out again (a transposing copy) before its einsum; one program over ABSORB_RING_MIB of
  distinct f32 kv_b weights of each of ABSORB_SHAPES (the host models' shapes), at one row, per weight
  (`components.host_absorbed_kv_b_time`);
- dispatch overhead: one jitted call of a tiny op, called and waited on (`launch_overhead_s`:
  what each kernel of an op-by-op engine pays);
- dispatch against argument count: the same tiny op taking 1..256 arrays (reported; a decode
  phase passes its layer's weights, so its dispatch costs more than a one-array call);
- the thunk chain: programs of THUNK_LANES independent lanes of THUNK_CHAIN_STEPS dependent tiny
  steps (an 8 x THUNK_WIDTH matmul and a tanh), each call timed until its result is ready; their thunks (the kernels XLA:CPU's executable runs) are counted
  in the compiled HLO (`count_thunks`, a structure, not a timing); written as micro-benchmarks of
  `components.host_program_time` (a cost per call and per thunk);
- thunks of the reference step: the compiled HLO of `perfmodel_kernels/reference.py`'s decode step for
  PROBE_MODEL (batch 1), counted per phase kind (embed, attention by kind, dense FFN, MoE,
  head; a MoE layer's expert loop counts as one thunk, its iterations are `host_expert_time`),
  written as `components.host_thunks_*` (structure, never fitted);
- argmax: a jitted argmax over f32 logits (ARGMAX_SHAPES), values per second
  (`components.host_argmax_time`);
- the expert loop: a `fori_loop` over EXPERT_DISTINCT of EXPERT_SLABS stacked f32 experts
  (gate_up + SwiGLU + down, each expert indexed dynamically, as `perfmodel_kernels/reference.py` runs its
  routed experts), for two expert sizes (EXPERT_SHAPES) by batch rows; written as
  micro-benchmarks of `components.host_expert_time`;
- bf16 -> f32 widening: a jitted `astype(float32)` of bf16 arrays shaped like a latent cache
  (CONVERT_SHAPES: f32 results below and above the allocator's 32 MiB mmap threshold), values per
  second (`components.host_convert_time`);
- fresh pages of a program's temporary buffer: one program filling a TEMP_PAGES_MIB f32 temporary
  (kept by an optimisation barrier, a small result), below and above the mmap threshold, per
  call (`components.host_fresh_pages_time`: a cost per page of the OS page size);
- temporaries per cache byte (structure, not timing): the compiled reference step of PROBE_MODEL
  at TEMP_PROBE (batch, context): its temporary allocation (`memory_analysis`) over the caches it
  updates (`perfmodel.graph.ops` cache bytes), `components.host_temp_per_cache_byte`; and each
  attention phase as the op-by-op step compiles it, over its own layer's cache, per attention
  kind (`host_temp_per_cache_byte_attention_<kind>`);
- copies of the stacked caches (structure, not timing): in the same compiled programs, the `copy`
  instructions whose result has a cache parameter's shape or one layer's slot of it (XLA copies
  whole stacks, and slots, around their per-layer updates), in bytes: per layer of each kind in units of that kind's stacks
  (`host_stack_copies_<kind>`), and per op-by-op attention phase in units of all caches
  (`host_stack_copies_attention_<kind>`); both counts also for each other model in MEMORY_MODELS
  (the host models the validation runs), from its own compiled programs, written with the suffix
  `__<model>` (`perfmodel.validate.host.own_structure` applies a model's own);
- a copy of a cache stack into a reused buffer: one program copying a KDA-state-shaped f32 stack
  (STACK_COPY_SHAPES, below and above the mmap threshold) into a donated buffer of its shape (warm
  pages: the faults of a fresh buffer are `host_fresh_pages_time`'s), per call
  (`components.host_stack_copy_time`).
Not measured (stated as such in the file's sources): memory latency (`dma_latency_s`), the fill
granule (`dma_tile_bytes`) and the link fields, which do not apply to one CPU device.

CLI: `perfmodel hostbench [--out FILE] [--quick] [--repeats N]`; the default output is in the
user's data directory (perfmodel.util.files.host_hardware_file), never a committed file.
"""
from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from perfmodel.cli.args import count
from perfmodel.step.report import plain
from perfmodel.util.errors import SpecError, positive_int, require
from perfmodel.util.files import check_output, host_hardware_file, write_all

MIB = 2**20
BANDWIDTH_SIZES_MIB = (128, 512, 1024)
QUICK_BANDWIDTH_SIZES_MIB = (96, 192)
MATMUL_N = 2048
QUICK_MATMUL_N = 768
DECODE_ROWS = 32          # decode-shaped matmul: rows = batch
DECODE_WIDTH = 1024       # weight DECODE_WIDTH x DECODE_WIDTH (bf16: 2 MiB, stays in cache)
THUNK_CHAIN_STEPS = (16, 64, 256)  # programs of this many dependent tiny steps, in each of
THUNK_LANES, THUNK_WIDTH = 2, 32  # 2 independent lanes of 8 x 32 f32 (1 KiB): XLA:CPU's executor
# then runs the program concurrently, as it runs a decode step (it runs a program inline when its
# thunks form a chain, all buffers are <= 512 B or there are <= 8 thunks: thunk_executor.h)
PROBE_MODEL = "kimi-k3-host-small"  # its compiled reference step gives the thunks per phase kind
NOT_THUNKS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}  # no kernel
ARGMAX_SHAPES = ((1, 32768), (8, 32768), (32, 32768))  # f32 logits [rows, vocab]
DISPATCH_ARGS = (1, 16, 64, 256)  # dispatch cost against the number of array arguments
MATVEC_MIB = 256          # decode-shaped matmuls: a weight of this size, far beyond the LLC,
MATVEC_K = 1024           # with MATVEC_K input features (a hidden size), times MATVEC_ROWS rows
MATVEC_ROWS = (1, 2, 4, 8, 16, 32)
ABSORB_SHAPES = ((128, 2, 128, 128), (256, 8, 128, 128))  # MLA kv_b (kv_lora, heads, nope, v), f32
ABSORB_RING_MIB = 64  # distinct kv_b weights per program, this much in all (beyond the LLC: cold, as a
# decode step of a model larger than the LLC reads them)
DOT_CHAIN_K, DOT_CHAIN_LEN = 1024, 32  # one program of 32 dependent dots over distinct 4 MiB f32
# weights (128 MiB in all, beyond the LLC): the fixed cost of a dot inside a program
EXPERT_SHAPES = ((1024, 512), (256, 128), (64, 32))  # (input width K, FFN width W): gate_up [K, 2W], down [W, K]
EXPERT_SLABS, EXPERT_DISTINCT = 48, 16  # stacked experts (48 x 6 MiB: far beyond the LLC), 16 visited
EXPERT_ROWS = (1, 8, 32)
TEMP_PAGES_MIB = (8, 16, 24, 48, 96, 192)  # f32 temporaries below and above the 32 MiB mmap threshold
TEMP_PROBE = (32, 4096)  # (batch, context) of the reference step whose temporaries are counted
MEMORY_MODELS = ("kimi-k3-host-large",)  # counted too, each in its own programs (the validated host models)
STACK_COPY_SHAPES = ((6, 1, 8, 128, 128), (6, 4, 8, 128, 128), (6, 8, 8, 128, 128), (6, 16, 8, 128, 128))
# f32 [layers, batch, heads, dk, dk]: kimi-k3-host-large's KDA state stack at batch 1, 4, 8, 16 (3..48 MiB)
CONVERT_SHAPES = ((1, 4096, 192), (2, 4096, 192), (16, 4096, 192), (32, 4096, 192))  # bf16 latent-cache-like
MMAP_THRESHOLD_BYTES = 32 * MIB  # glibc malloc: allocations above it are always fresh mmap'd pages
DMA_LATENCY_ASSUMED_S = 1.0e-7
DMA_TILE_ASSUMED_BYTES = 65536


@dataclass(frozen=True)
class Stat:
    """min / median / max of repeated measurements of one figure."""
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, xs: list[float]) -> "Stat":
        return cls(min(xs), statistics.median(xs), max(xs))

    def scaled(self, k: float) -> "Stat":
        """k / x for a time x (a rate from a duration): min and max swap."""
        return Stat(k / self.max, k / self.median, k / self.min)

    def json(self) -> dict:
        return {"min": self.min, "median": self.median, "max": self.max}


@dataclass(frozen=True)
class HostBench:
    cpu: str
    date: str
    repeats: int
    read_bandwidth: dict[int, Stat]      # bytes/s by array size in MiB
    copy_bandwidth: dict[int, Stat]      # (read + written) bytes/s by size in MiB
    matmul_flops: dict[str, Stat]        # FLOP/s by dtype, square MATMUL_N matmul
    decode_matmul_flops: dict[str, Stat]  # FLOP/s by dtype, DECODE_ROWS x DECODE_WIDTH^2
    matvec_bandwidth: dict[tuple[str, int], Stat]  # weight bytes/s of a (rows x K) @ (K x N) dot
    dispatch_s: Stat                     # one jitted call, dispatched and waited on
    thunk_chain: dict[int, Stat]         # one call of a program, by its thunk count (HLO)
    llc_bytes: int
    ram_bytes: int
    devices: int
    load_average: float = float("nan")  # 1-minute load average when the run ended
    dispatch_by_args: dict[int, Stat] = field(default_factory=dict)  # one call with n arrays
    expert_loop: dict[tuple[int, int, int], Stat] = field(default_factory=dict)  # s per expert by (K, W, rows)
    convert_s: dict[tuple[int, ...], Stat] = field(default_factory=dict)  # bf16 -> f32 widening, by shape
    argmax_s: dict[tuple[int, int], Stat] = field(default_factory=dict)  # argmax of f32 [rows, vocab]
    reference_thunks: dict[str, float] = field(default_factory=dict)  # per phase kind (count_thunks)
    dot_chain: dict[int, Stat] = field(default_factory=dict)  # s per 4 MiB f32 dot in a chain, by rows
    absorb_s: dict[tuple[int, ...], Stat] = field(default_factory=dict)  # s per kv_b, absorbed MLA
    temp_pages_s: dict[int, Stat] = field(default_factory=dict)  # s per call, by temporary MiB
    temp_per_cache_byte: dict[str, float] = field(default_factory=dict)  # temporaries / cache bytes:
    # "step" (the compiled step) and "attention_<kind>" (an op-by-op attention phase, its own layer's cache)
    stack_copies: dict[str, float] = field(default_factory=dict)  # copies of the stacked caches (stack_copies)
    page_bytes: int = 4096  # the OS page size (os.sysconf)
    model_memory: dict[str, tuple[dict[str, float], dict[str, float]]] = field(default_factory=dict)
    # (temp_per_cache_byte, stack_copies) of each of MEMORY_MODELS, its own compiled programs
    stack_copy_s: dict[tuple[int, ...], Stat] = field(default_factory=dict)  # s per call, by stack shape
    memory_probe: tuple[int, int] = TEMP_PROBE  # (batch, context) of reference_memory's programs

    def dispatch_s_for(self, n_args: int) -> float:
        """Dispatch time of a call with `n_args` arrays: the least-squares line through the
        medians measured at DISPATCH_ARGS (a microbenchmark fit; no decode run feeds it)."""
        xs = sorted(self.dispatch_by_args)
        if len(xs) < 2:
            return self.dispatch_s.median
        ys = [self.dispatch_by_args[x].median for x in xs]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my + slope * (n_args - mx)

    @property
    def op_overhead_s(self) -> Stat:
        """Per thunk (an XLA op) inside one compiled program: the difference between the largest
        and the smallest thunk-chain program over their thunk difference (of their minima,
        medians and maxima); `host_thunk_s` is the fit through all of them."""
        lo, hi = min(self.thunk_chain), max(self.thunk_chain)
        a, b = self.thunk_chain[lo], self.thunk_chain[hi]
        return Stat.of([(y - x) / (hi - lo) for x, y in ((a.min, b.min), (a.median, b.median), (a.max, b.max))])

    @property
    def stream_bandwidth(self) -> Stat:
        return self.read_bandwidth[max(self.read_bandwidth)]

    @property
    def flops_efficiency(self) -> float:
        """Decode-shaped matmul rate / square-matmul peak, bf16 (the weights' dtype)."""
        return min(1.0, self.decode_matmul_flops["bf16"].median / self.matmul_flops["bf16"].median)

    def json(self) -> dict:
        return {"cpu": self.cpu, "date": self.date, "repeats": self.repeats, "devices": self.devices,
                "llc_bytes": self.llc_bytes, "ram_bytes": self.ram_bytes,
                "read_bandwidth_bytes_per_s": {str(k): v.json() for k, v in self.read_bandwidth.items()},
                "copy_bandwidth_bytes_per_s": {str(k): v.json() for k, v in self.copy_bandwidth.items()},
                "matmul_flops_per_s": {k: v.json() for k, v in self.matmul_flops.items()},
                "decode_matmul_flops_per_s": {k: v.json() for k, v in self.decode_matmul_flops.items()},
                "matvec_bandwidth_bytes_per_s": {f"{k[0]}/{k[1]}": v.json()
                                                 for k, v in self.matvec_bandwidth.items()},
                "dispatch_s": self.dispatch_s.json(), "op_overhead_s": self.op_overhead_s.json(),
                "thunk_chain_s": {str(k): v.json() for k, v in self.thunk_chain.items()},
                "dispatch_s_by_args": {str(k): v.json() for k, v in self.dispatch_by_args.items()},
                "expert_loop_s_per_expert": {f"{k}x{w}/{r}": v.json() for (k, w, r), v in self.expert_loop.items()},
                "convert_bf16_f32_s": {"x".join(map(str, k)): v.json() for k, v in self.convert_s.items()},
                "argmax_f32_s": {"x".join(map(str, k)): v.json() for k, v in self.argmax_s.items()},
                "reference_thunks": {"model": PROBE_MODEL, "batch": 1, **self.reference_thunks},
                "dot_chain_s_per_dot": {str(k): v.json() for k, v in self.dot_chain.items()},
                "absorbed_kv_b_s": {"x".join(map(str, k)): v.json() for k, v in self.absorb_s.items()},
                "temp_pages_s": {str(k): v.json() for k, v in self.temp_pages_s.items()},
                "temp_per_cache_byte": {"model": PROBE_MODEL, "batch": self.memory_probe[0],
                                        "context": self.memory_probe[1], **self.temp_per_cache_byte},
                "stack_copies": {"model": PROBE_MODEL, "batch": self.memory_probe[0],
                                 "context": self.memory_probe[1], **self.stack_copies},
                "model_memory": {m: {"temp_per_cache_byte": t, "stack_copies": c}
                                 for m, (t, c) in self.model_memory.items()},
                "stack_copy_s": {"x".join(map(str, k)): v.json() for k, v in self.stack_copy_s.items()},
                "page_bytes": self.page_bytes,
                "flops_efficiency": self.flops_efficiency,
                "load_average_1min": self.load_average}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes() -> int:
    """Largest cache reported by sysfs (the last-level cache), in bytes."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=32 * MIB)


def ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SpecError("/proc/meminfo", None, "no MemTotal line")


def _time(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(repeats: int = 7, quick: bool = False, progress: bool = True) -> HostBench:
    """Run every microbenchmark; `quick` uses smaller sizes (for tests; not a measurement)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm
    positive_int("repeats", repeats)
    sizes = QUICK_BANDWIDTH_SIZES_MIB if quick else BANDWIDTH_SIZES_MIB
    n = QUICK_MATMUL_N if quick else MATMUL_N
    steps = len(sizes) + 9
    bar = tqdm(total=steps, desc="hostbench", disable=not progress)

    total = jax.jit(jnp.sum)
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)  # in place: no page faults
    read, copy = {}, {}
    for mib in sizes:
        box = [jnp.ones((mib * MIB // 4,), jnp.float32)]
        nbytes = box[0].size * 4
        read[mib] = Stat.of(_time(lambda: total(box[0]).block_until_ready(), repeats)).scaled(nbytes)
        def rescale():
            box[0] = scale(box[0])
            box[0].block_until_ready()
        copy[mib] = Stat.of(_time(rescale, repeats)).scaled(2 * nbytes)
        box.clear()  # free this size's array before the next
        bar.update()

    matvec = {}  # decode-shaped matmul over a weight far beyond the LLC: effective bytes/s
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    for name, dt, size in (("f32", jnp.float32, 4), ("bf16", jnp.bfloat16, 2)):
        w = jnp.ones((MATVEC_K, (32 if quick else MATVEC_MIB) * MIB // size // MATVEC_K), dt)
        for rows in MATVEC_ROWS:
            x = jnp.ones((rows, w.shape[0]), dt)
            matvec[(name, rows)] = Stat.of(_time(lambda: dot(x, w).block_until_ready(),
                                                 repeats)).scaled(w.size * size)
        del w
        bar.update()

    matmul, decode = {}, {}
    mm = jax.jit(jnp.matmul)
    for name, dt in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        a = jnp.ones((n, n), dt)
        matmul[name] = Stat.of(_time(lambda: mm(a, a).block_until_ready(), repeats)).scaled(2.0 * n**3)
        x = jnp.ones((DECODE_ROWS, DECODE_WIDTH), dt)
        w = jnp.ones((DECODE_WIDTH, DECODE_WIDTH), dt)
        calls = 20  # each call is short: time a batch of calls
        def run():
            for _ in range(calls):
                y = mm(x, w)
            y.block_until_ready()
        decode[name] = Stat.of(_time(run, repeats)).scaled(2.0 * DECODE_ROWS * DECODE_WIDTH**2 * calls)
        bar.update()

    tiny = jax.jit(lambda v: v + 1)
    v = jnp.ones((8,), jnp.float32)
    calls = 2000
    def dispatch():
        for _ in range(calls):
            tiny(v).block_until_ready()
    dispatch_s = Stat.of([t / calls for t in _time(dispatch, repeats)])
    by_args = {}
    add_all = jax.jit(lambda *xs: functools.reduce(jnp.add, xs))
    for n_args in DISPATCH_ARGS:  # the same tiny op taking n_args arrays
        xs = [jnp.ones((8,), jnp.float32) for _ in range(n_args)]
        k = max(20, calls // n_args)
        def call_many():
            for _ in range(k):
                add_all(*xs).block_until_ready()
        by_args[n_args] = Stat.of([t / k for t in _time(call_many, repeats)])
    bar.update()

    chain = _thunk_chain(repeats)
    bar.update()
    argmax = {}
    for shape in ((1, 4096),) if quick else ARGMAX_SHAPES:
        logits = jax.random.normal(jax.random.key(1), shape, jnp.float32)
        top = jax.jit(lambda z: jnp.argmax(z, axis=-1))
        argmax[shape] = Stat.of(_time(lambda: top(logits).block_until_ready(), repeats))
    thunks = reference_thunks()
    dots = _dot_chain(4 if quick else DOT_CHAIN_LEN, repeats)
    absorb = {shape: _absorbed_kv_b(shape, 4 if quick else ABSORB_RING_MIB * MIB // (4 * shape[0] * shape[1]
                                                                                 * (shape[2] + shape[3])), repeats)
              for shape in ABSORB_SHAPES}
    bar.update()
    experts = {}
    for k, w in ((128, 64),) if quick else EXPERT_SHAPES:
        experts |= _expert_loop(k, w, 8 if quick else EXPERT_SLABS, 4 if quick else EXPERT_DISTINCT, repeats)
    bar.update()
    widen = jax.jit(lambda x: x.astype(jnp.float32))
    convert = {}
    for shape in ((2, 256, 192),) if quick else CONVERT_SHAPES:
        x = jnp.ones(shape, jnp.bfloat16)
        convert[shape] = Stat.of(_time(lambda: widen(x).block_until_ready(), repeats))
        del x
    temp = _temp_pages((8, 48) if quick else TEMP_PAGES_MIB, repeats)
    probe = (1, 256) if quick else TEMP_PROBE
    per_cache, copies = reference_memory(*probe)
    own = {m: reference_memory(*probe, m) for m in (() if quick else MEMORY_MODELS)}
    stack = _stack_copy(((6, 1, 8, 128, 128),) if quick else STACK_COPY_SHAPES, repeats)
    bar.update()
    bar.close()
    return HostBench(cpu_model(), datetime.date.today().isoformat(), repeats, read, copy, matmul,
                     decode, matvec, dispatch_s, chain, llc_bytes(), ram_bytes(), jax.device_count(),
                     os.getloadavg()[0], by_args, experts, convert, argmax, thunks, dots, absorb, temp,
                     per_cache, copies, os.sysconf("SC_PAGE_SIZE"), memory_probe=probe, model_memory=own,
                     stack_copy_s=stack)


def _temp_pages(sizes_mib, repeats: int) -> dict[int, Stat]:
    """Seconds per call of one program filling an f32 temporary of each size in MiB from an input
    of the same size (an optimisation barrier keeps the temporary; the result is 64 B): above the
    allocator's mmap threshold the temporary is new pages every call."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fill(x):
        t = jax.lax.optimization_barrier(x * 1.5 + 1.0)
        return t[:8] + t[-8:]

    out = {}
    for mib in sizes_mib:
        x = jnp.ones((mib * MIB // 4,), jnp.float32)
        out[mib] = Stat.of(_time(lambda: fill(x).block_until_ready(), repeats))
        del x
    return out


def _stack_copy(shapes, repeats: int) -> dict[tuple[int, ...], Stat]:
    """Seconds per call of one program copying an f32 stack of each shape into a donated buffer
    of that shape (its result: one `copy` thunk writing warm, reused pages)."""
    import jax
    import jax.numpy as jnp
    copy = jax.jit(lambda dst, src: src, donate_argnums=0, keep_unused=True)
    out = {}
    for shape in shapes:
        src, dst = jnp.ones(shape, jnp.float32), [jnp.zeros(shape, jnp.float32)]

        def call():
            dst[0] = copy(dst[0], src)
            dst[0].block_until_ready()
        out[shape] = Stat.of(_time(call, repeats))
        del src, dst
    return out


def stack_copies(hlo_text: str) -> tuple[dict[str, float], dict[str, int]]:
    """(copies, bytes) by cache name: the `copy` instructions of a compiled program's entry
    computation whose result has the shape of a cache parameter (one named `cache['<name>']`, a
    stack over its layers: one copy) or of one layer's slot of it (the shape without the leading
    layer dimension: 1 / layers of a copy), and that cache's bytes."""
    import re
    line_re = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(")
    size = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
    shapes, copies, entry = {}, {}, False
    for line in hlo_text.splitlines():
        entry = entry or line.startswith("ENTRY")
        m = line_re.match(line) if entry else None
        if m is None:
            continue
        name, dtype, dims, opcode = m.groups()
        shape = (dtype, dims)
        if opcode == "parameter" and name.startswith("cache__"):
            stack = [int(x) for x in dims.split(",") if x]
            shapes[shape] = (name.split("__")[1], 1.0)
            shapes.setdefault((dtype, ",".join(map(str, stack[1:]))), (name.split("__")[1], 1.0 / stack[0]))
        elif opcode == "copy" and shape in shapes:
            k, share = shapes[shape]
            copies[k] = copies.get(k, 0.0) + share
    nbytes = {k: size.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x)
              for (d, dims), (k, share) in shapes.items() if share == 1.0}
    return {k: copies.get(k, 0.0) for k in nbytes}, nbytes


def reference_memory(batch: int, context: int, model: str = PROBE_MODEL) -> tuple[dict[str, float], dict[str, float]]:
    """The compiled reference decode step of `model` at (batch, context) and its op-by-op
    attention phases, compiled, never run (the programs' structure):
    temporaries per cache byte: the step's temporary allocation (XLA's `memory_analysis`) over the
    bytes of all its caches (the op graph's `cache_bytes`), "step", and each attention phase's
    over its own layer's cache, mean per attention kind, "attention_<kind>";
    stack copies (`stack_copies`): in the step, per layer of each kind in units of that kind's
    stacked caches, "<kind>"; in an attention phase, in units of all caches, mean per kind,
    "attention_<kind>" (a cache named `<kind>_...` belongs to that attention kind)."""
    import jax.numpy as jnp
    from perfmodel_kernels import reference as R
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.loaders import load_model
    spec = load_model(model)
    weights = R.init_weights(spec, 0, dtype=jnp.float32)
    cache = R.init_cache(spec, batch, context + 1)
    args = (weights, cache, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), context, jnp.int32))
    g = build(spec, Deployment(devices=1, tp=1, engine="multikernel", batch=batch, context=context))
    step = R.compiled_step(*args)
    temps = {"step": step.memory_analysis().temp_size_in_bytes / sum(g.cache_bytes.values())}
    n, nbytes = stack_copies(step.as_text())
    layers = {k: spec.count(attention=k) for k in {c.split("_")[0] for c in nbytes}}
    copies = {k: sum(n[c] * nbytes[c] for c in nbytes if c.startswith(k + "_"))
              / (layers[k] * sum(nbytes[c] for c in nbytes if c.startswith(k + "_"))) for k in sorted(layers)}
    phases = R.compiled_attention_phases(*args)
    per: dict[str, list[tuple[float, float]]] = {}
    for layer in spec.layers:
        phase = phases[layer.index]
        n, nbytes = stack_copies(phase.as_text())
        per.setdefault(f"attention_{layer.attention}", []).append(
            (phase.memory_analysis().temp_size_in_bytes / g.cache_bytes[layer.index],
             sum(n[c] * nbytes[c] for c in nbytes) / sum(nbytes.values())))
    temps |= {k: statistics.fmean(t for t, _ in v) for k, v in sorted(per.items())}
    copies |= {k: statistics.fmean(c for _, c in v) for k, v in sorted(per.items())}
    return temps, copies


def _absorbed_kv_b(shape: tuple[int, int, int, int], copies: int, repeats: int) -> Stat:
    """Seconds per kv_b weight of the absorbed MLA as perfmodel_kernels/reference.py runs it at one row:
    kv_b [r, heads * (nope + v)] split into W_uk [r, heads, nope] and W_uv [r, heads, v] (XLA:CPU
    lays each out again for its einsum), q_nope -> latent -> values; `copies` distinct weights in
    one program."""
    import jax
    import jax.numpy as jnp
    r, h, n, v = shape
    ws = [jnp.full((r, h * (n + v)), 1e-3, jnp.float32) for _ in range(copies)]
    q = jnp.ones((1, h, n), jnp.float32)

    @jax.jit
    def absorbed(q, ws):
        out = jnp.zeros((1, h, v), jnp.float32)
        for kv_b in ws:
            w = kv_b.reshape(r, h, n + v)
            lat = jnp.einsum("bhn,rhn->bhr", q, w[..., :n])
            out = out + jnp.einsum("bhr,rhv->bhv", lat, w[..., n:])
        return out

    return Stat.of([t / copies for t in _time(lambda: absorbed(q, ws).block_until_ready(), repeats)])


def _dot_chain(length: int, repeats: int) -> dict[int, Stat]:
    """Seconds per dot of one program chaining `length` dependent (rows x K) @ (K x K) f32 dots
    over distinct weights (K = DOT_CHAIN_K: 4 MiB each), by rows (MATVEC_ROWS)."""
    import jax
    import jax.numpy as jnp
    ws = [jnp.full((DOT_CHAIN_K, DOT_CHAIN_K), 1.0 / DOT_CHAIN_K, jnp.float32) for _ in range(length)]

    @jax.jit
    def chain(x, ws):
        for w in ws:
            x = jnp.dot(x, w, preferred_element_type=jnp.float32)
        return x

    out = {}
    for rows in MATVEC_ROWS:
        x = jnp.ones((rows, DOT_CHAIN_K), jnp.float32)
        out[rows] = Stat.of([t / length for t in _time(lambda: chain(x, ws).block_until_ready(), repeats)])
    return out


def count_thunks(hlo_text: str) -> dict[str | None, int]:
    """Thunks of a compiled XLA:CPU program by named scope (perfmodel.validate.traces.hlo_scopes; None:
    no scope): the instructions of its entry computation that run a kernel (all but
    NOT_THUNKS). A loop, call or conditional counts once (its body is not expanded)."""
    from collections import Counter
    from perfmodel.validate.traces import hlo_scopes
    scopes, out, entry = hlo_scopes(hlo_text), Counter(), False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            entry = True
        elif entry and line.startswith("}"):
            break
        elif entry and " = " in line:
            name, rhs = line.split(" = ", 1)
            name = name.replace("ROOT", "").strip().lstrip("%")
            if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
                depth = 0
                for i, ch in enumerate(rhs):
                    depth += {"(": 1, ")": -1}.get(ch, 0)
                    if depth == 0:
                        rhs = rhs[i + 1:]
                        break
            opcode = rhs.split("(", 1)[0].split()[-1]
            if opcode not in NOT_THUNKS:
                out[scopes.get(name)] += 1
    return dict(out)


def _thunk_chain(repeats: int) -> dict[int, Stat]:
    """Seconds per call of programs of THUNK_LANES independent lanes of THUNK_CHAIN_STEPS
    dependent tiny steps (x = tanh(x @ w), 8 x THUNK_WIDTH f32), by the program's thunk count
    (`count_thunks` of its compiled HLO)."""
    import jax
    import jax.numpy as jnp
    w = jnp.asarray(jax.random.normal(jax.random.key(0), (THUNK_WIDTH, THUNK_WIDTH)), jnp.float32) * 0.2
    x0 = jnp.ones((8, THUNK_WIDTH), jnp.float32)
    out, calls = {}, 20
    for steps in THUNK_CHAIN_STEPS:
        def chain(w, x, steps=steps):
            xs = [x + lane for lane in range(THUNK_LANES)]
            for _ in range(steps):  # unrolled: dependent dots XLA cannot fuse into one kernel
                xs = [jnp.tanh(v @ w) for v in xs]
            return xs
        compiled = jax.jit(chain).lower(w, x0).compile()
        thunks = sum(count_thunks(compiled.as_text()).values())
        def run():  # each call waited on, as a decode step waits for its tokens
            for _ in range(calls):
                jax.block_until_ready(compiled(w, x0))
        out[thunks] = Stat.of([t / calls for t in _time(run, repeats)])
    return out


def reference_thunks(model: str = PROBE_MODEL) -> dict[str, float]:
    """Thunks per phase kind of the compiled reference decode step of `model` at batch 1 (mean
    over its layers of each kind): keys `embed`, `attention_<kind>`, `ffn`, `moe`, `head`, the
    op graph's phases. Compiled, never run: a count of the program's structure."""
    import jax.numpy as jnp
    from perfmodel_kernels import reference as R
    from perfmodel.spec.loaders import load_model
    from perfmodel.validate.traces import scope_of
    spec = load_model(model)
    weights = R.init_weights(spec, 0, dtype=jnp.float32)
    cache = R.init_cache(spec, 1, 64)
    text = R.compiled_step(weights, cache, jnp.zeros((1,), jnp.int32), jnp.full((1,), 32, jnp.int32)).as_text()
    kinds = {l.index: l.attention for l in spec.layers}
    per: dict[str, list[int]] = {}
    for scope, n in count_thunks(text).items():
        s = scope_of(scope) if scope else None
        if s is None:
            continue
        _, layer, phase = s
        key = f"attention_{kinds[layer]}" if phase == "attention" else phase
        per.setdefault(key, []).append(n)
    return {k: statistics.fmean(v) for k, v in sorted(per.items())}


def _expert_loop(k: int, w: int, slabs: int, distinct: int, repeats: int) -> dict[tuple[int, int, int], Stat]:
    """Seconds per expert of a loop over `distinct` of `slabs` stacked experts (gate_up [k, 2w],
    SwiGLU, down [w, k], f32), each applied to all rows, by (k, w, rows) for EXPERT_ROWS."""
    import jax
    import jax.numpy as jnp
    gate_up = jnp.full((slabs, k, 2 * w), 1e-3, jnp.float32)
    down = jnp.full((slabs, w, k), 1e-3, jnp.float32)
    ids = jnp.arange(distinct, dtype=jnp.int32) * (slabs // distinct)  # spread over the stack

    @jax.jit
    def loop(x, gate_up, down, ids):
        def body(j, acc):
            h = jnp.dot(x, gate_up[ids[j]], preferred_element_type=jnp.float32)
            h = h[:, :w] * jax.nn.sigmoid(h[:, :w]) * h[:, w:]
            return acc + jnp.dot(h, down[ids[j]], preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(0, ids.shape[0], body, jnp.zeros_like(x))

    out = {}
    for rows in EXPERT_ROWS:
        x = jnp.ones((rows, k), jnp.float32)
        out[(k, w, rows)] = Stat.of([t / distinct for t in
                             _time(lambda: loop(x, gate_up, down, ids).block_until_ready(), repeats)])
    return out


def _stat_text(s: Stat, unit: float, name: str) -> str:
    return f"{name} min/median/max {s.min / unit:.4g}/{s.median / unit:.4g}/{s.max / unit:.4g}"


def hardware_toml(b: HostBench, name: str = "host-cpu") -> str:
    """The hardware file: every number with a source naming the benchmark, CPU and date."""
    by = f"measured by hostbench on {b.cpu}, {b.date}, {b.repeats} repeats"
    bw, cp = b.stream_bandwidth, b.copy_bandwidth[max(b.copy_bandwidth)]
    big = max(b.read_bandwidth)
    flops = ", ".join(_stat_text(s, 1e9, f"{k} GFLOP/s") for k, v in [("bf16", 0), ("f32", 0)]
                      for s in [b.matmul_flops[k]])
    dec = b.decode_matmul_flops["bf16"]
    src = {
        "cores_per_chip": "the whole CPU is one JAX device",
        "peak_flops_per_s": f"{by}: {MATMUL_N}^3 square matmul, {flops}",
        "hbm_bytes": "MemTotal of /proc/meminfo (RAM)",
        "hbm_bandwidth_bytes_per_s": f"{by}: jitted f32 sum over {big} MiB (streaming read), "
                                     + _stat_text(bw, 1e9, "GB/s")
                                     + f"; copy (read + write) {_stat_text(cp, 1e9, 'GB/s')}",
        "onchip_bytes": "last-level cache size from /sys/devices/system/cpu/cpu0/cache",
        "intra_chip_bandwidth_bytes_per_s": "not applicable (one device); set to the measured copy bandwidth",
        "intra_chip_latency_s": "not applicable (one device)",
        "link_bandwidth_bytes_per_s": "not applicable (one device, no collectives); set to the measured copy bandwidth",
        "link_latency_s": "not applicable (one device)",
        "collective_base_latency_s": "not applicable (one device)",
        "collective_algorithm": "not applicable (one device)",
        "launch_overhead_s": f"{by}: one jitted tiny op called and waited on, "
                             + _stat_text(b.dispatch_s, 1e-6, "us"),
        "dma_latency_s": "assumption, not measured: DRAM load latency about 100 ns",
        "dma_sharing": "assumption: one memory system serving an op's loads in order",
        "dma_tile_bytes": "assumption, not measured: hardware prefetch runs about 64 KiB ahead (pipeline fill)",
        "efficiency.hbm": "1.0: hbm_bandwidth_bytes_per_s is already the measured sustained rate",
        "efficiency.flops": f"{by}: bf16 {DECODE_ROWS}x{DECODE_WIDTH}x{DECODE_WIDTH} matmul "
                            f"{dec.median / 1e9:.4g} GFLOP/s / square-matmul median",
        "efficiency.collective_latency_scale": "not applicable (one device)",
        "efficiency.op_overhead_s": "0: inside a program each op pays its thunks "
                                    "(components.host_program_time, the thunk-chain micro-benchmarks)",
    }
    fields = [
        ("name", f'"{name}"'), ("kind", '"cpu"'), ("cores_per_chip", "1"),
        ("peak_flops_per_s", "{ " + ", ".join(f"{k} = {v.median:.6g}" for k, v in b.matmul_flops.items()) + " }"),
        ("hbm_bytes", f"{b.ram_bytes}"), ("hbm_bandwidth_bytes_per_s", f"{bw.median:.6g}"),
        ("onchip_bytes", f"{b.llc_bytes}"), ("onchip_kind", '"LLC"'),
        ("intra_chip_bandwidth_bytes_per_s", f"{cp.median:.6g}"), ("intra_chip_latency_s", "0.0"),
        ("link_bandwidth_bytes_per_s", f"{cp.median:.6g}"), ("link_latency_s", "0.0"),
        ("collective_base_latency_s", "0.0"), ("collective_algorithm", '"ring"'),
        ("launch_overhead_s", f"{b.dispatch_s.median:.6g}"),
        ("dma_latency_s", f"{DMA_LATENCY_ASSUMED_S:.6g}"), ("dma_sharing", '"fifo"'),
        ("dma_tile_bytes", f"{DMA_TILE_ASSUMED_BYTES}"),
    ]
    lines = [f"# Host CPU measured by `perfmodel hostbench` ({b.cpu}, {b.date}).",
             "# launch_overhead_s is the op-by-op dispatch cost; a single compiled program has no",
             "# launches (use launch_overhead_s = 0); its ops pay their thunks (components)."]
    lines += [f"{k} = {v}" for k, v in fields]
    lines += ["", "[efficiency]", "hbm = 1.0", f"flops = {b.flops_efficiency:.6g}",
              "collective_latency_scale = 1.0", "op_overhead_s = 0.0",
              "", "[sources]"]
    lines += [f'{k if "." not in k else chr(34) + k + chr(34)} = "{v}"' for k, v in src.items()]
    return "\n".join(lines) + "\n"


def microbench(b: HostBench, name: str = "host-cpu") -> dict:
    """The decode-shaped dot and expert-loop figures as component micro-benchmarks
    (perfmodel.fit.microbench format); f32 only: the host models' weights are f32."""
    src = f"perfmodel hostbench on {b.cpu}, {b.date}, {b.repeats} repeats (median)"
    entries = [{"id": f"host-dot-f32-r{rows}", "platform": name, "mechanism": "host_dot",
                "inputs": {"bytes": MATVEC_MIB * MIB, "rows": rows},
                "value": MATVEC_MIB * MIB / s.median / 1e-3, "unit": "ms_per_dot",
                "scope": f"jitted f32 dot, {rows} rows x {MATVEC_K} x {MATVEC_MIB} MiB weight", "source": src}
               for (dt, rows), s in b.matvec_bandwidth.items() if dt == "f32"]
    entries += [{"id": f"host-dot-chain-f32-r{rows}", "platform": name, "mechanism": "host_dot",
                 "inputs": {"bytes": DOT_CHAIN_K**2 * 4, "rows": rows},
                 "value": s.median / 1e-6, "unit": "us_per_dot",
                 "scope": f"one of {DOT_CHAIN_LEN} dependent f32 dots in one program, {rows} rows x "
                          f"{DOT_CHAIN_K} x {DOT_CHAIN_K} distinct weights (4 MiB each)", "source": src}
                for rows, s in b.dot_chain.items()]
    entries += [{"id": f"host-absorbed-kv-b-{'x'.join(map(str, shape))}", "platform": name,
                 "mechanism": "host_absorbed_kv_b", "inputs": {"bytes": shape[0] * shape[1] * (shape[2] + shape[3]) * 4},
                 "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"absorbed MLA at one row over one of {ABSORB_RING_MIB} MiB of distinct f32 kv_b weights "
                          f"(kv_lora, heads, nope, v) = {shape}: split, re-layout, two einsums", "source": src}
                for shape, s in b.absorb_s.items()]
    entries += [{"id": f"host-expert-loop-f32-{k}x{w}-r{rows}", "platform": name, "mechanism": "host_expert_loop",
                 "inputs": {"bytes": 3 * k * w * 4, "rows": rows, "experts": 1},
                 "value": s.median / 1e-6, "unit": "us_per_expert",
                 "scope": f"fori_loop over the stacked f32 experts (gate_up [{k}, {2 * w}], down [{w}, {k}]), "
                          f"{rows} rows, per expert", "source": src}
                for (k, w, rows), s in b.expert_loop.items()]
    entries += [{"id": f"host-convert-bf16-f32-{'x'.join(map(str, shape))}", "platform": name,
                 "mechanism": "host_convert",
                 "inputs": {"values": math.prod(shape), "allocated_bytes": 4 * math.prod(shape)},
                 "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"jitted astype(float32) of a bf16 {list(shape)} array", "source": src}
                for shape, s in b.convert_s.items()]
    entries += [{"id": f"host-temp-pages-f32-{mib}mib", "platform": name, "mechanism": "host_temp_pages",
                 "inputs": {"bytes": mib * MIB}, "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"one call of a jitted program filling a {mib} MiB f32 temporary (optimisation barrier) "
                          f"from an input of the same size", "source": src}
                for mib, s in b.temp_pages_s.items()]
    entries += [{"id": f"host-stack-copy-f32-{'x'.join(map(str, shape))}", "platform": name,
                 "mechanism": "host_stack_copy", "inputs": {"bytes": 4 * math.prod(shape)},
                 "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"one call of a jitted program copying an f32 {list(shape)} stack into a donated "
                          "buffer of its shape (reused pages)", "source": src}
                for shape, s in b.stack_copy_s.items()]
    entries += [{"id": f"host-thunk-chain-t{thunks}", "platform": name, "mechanism": "host_program",
                 "inputs": {"thunks": thunks}, "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"one call of a jitted program of {THUNK_LANES} lanes of tiny dependent steps "
                          f"(8 x {THUNK_WIDTH} f32 matmul + tanh), {thunks} thunks counted in its compiled HLO",
                 "source": src}
                for thunks, s in b.thunk_chain.items()]
    entries += [{"id": f"host-argmax-f32-{'x'.join(map(str, shape))}", "platform": name,
                 "mechanism": "host_argmax", "inputs": {"values": math.prod(shape)},
                 "value": s.median / 1e-6, "unit": "us_per_call",
                 "scope": f"jitted argmax(axis=-1) of an f32 {list(shape)} array", "source": src}
                for shape, s in b.argmax_s.items()]
    return {"what": "host component micro-benchmarks measured by perfmodel hostbench", "platform": name,
            "entries": entries}


def model_suffix(model: str) -> str:
    """The suffix of the components counted in `model`'s own programs (`perfmodel.validate.host.own_structure`)."""
    return "__" + model.replace("-", "_")


def write(b: HostBench, out: str | Path, name: str = "host-cpu") -> Path:
    """Write the hardware file, its components fitted to this run's micro-benchmarks by the same
    code as `perfmodel calibrate` (the micro-benchmark file beside it, `.microbench.json`), and
    the raw figures as JSON beside it."""
    import dataclasses
    import json
    from perfmodel.fit.microbench import calibrated
    from perfmodel.spec.hardware import from_dict, to_toml
    import tomllib
    out = check_outputs(out, name)
    data = microbench(b, name)
    hw = from_dict(tomllib.loads(hardware_toml(b, name)))
    start = {"dot_gemv_bandwidth_bytes_per_s": 2e10, "dot_gemm_bandwidth_bytes_per_s": 2e10,
             "dot_gemm_row_s_per_byte": 1e-12, "dot_fixed_s": 1e-5}
    if b.convert_s or b.temp_pages_s:
        start |= {"host_mmap_threshold_bytes": MMAP_THRESHOLD_BYTES}
    if b.convert_s:
        start |= {"host_convert_values_per_s": 1e9, "host_convert_reused_values_per_s": 5e9}
    if b.temp_pages_s:
        start |= {"host_fill_bytes_per_s": 1e10, "host_page_fault_s": 1e-6, "host_page_bytes": b.page_bytes}
    if b.thunk_chain:
        start |= {"host_call_s": 5e-6, "host_thunk_s": 1e-6}
    if b.stack_copy_s:
        start |= {"host_stack_copy_bytes_per_s": 2e10}
    if b.absorb_s:
        start |= {"host_absorb_fixed_s": 1e-5, "host_absorb_bytes_per_s": 1e10}
    if b.argmax_s:
        start |= {"host_argmax_values_per_s": 1e8}
    if b.expert_loop:
        start |= {"host_expert_fixed_s": 1e-6, "host_expert_bandwidth_bytes_per_s": 2e10,
                  "host_expert_row_s_per_byte": 1e-12}
    hw = dataclasses.replace(hw, components=start, sources={**hw.sources, **{
        f"components.{k}": "starting value" for k in start}, "components.host_mmap_threshold_bytes":
        "glibc malloc's largest dynamic mmap threshold on 64-bit, 4 * 1024 * 1024 * sizeof(long) = "
        "32 MiB: larger blocks are always mmap'd afresh (mallopt(3), M_MMAP_THRESHOLD; "
        "https://man7.org/linux/man-pages/man3/mallopt.3.html); not fitted",
        "components.host_page_bytes": f"the OS page size, os.sysconf('SC_PAGE_SIZE') on {b.cpu}, {b.date}; "
                                      "not fitted"})
    mb = out.with_suffix(".microbench.json")
    hw = calibrated(data, hw, mb.name)
    counted = f"counted by hostbench in the compiled HLO of the {PROBE_MODEL} reference decode step " \
              f"(perfmodel_kernels/reference.py, batch 1; XLA:CPU on {b.cpu}, {b.date}): a structure, not a timing"
    structure = {f"host_thunks_{k}": v for k, v in b.reference_thunks.items()}
    sources = {f"components.host_thunks_{k}": f"{counted}; mean over its {k} layers" for k in b.reference_thunks}
    for model, (temps, copies) in [(PROBE_MODEL, (b.temp_per_cache_byte, b.stack_copies)), *b.model_memory.items()]:
        suffix = "" if model == PROBE_MODEL else model_suffix(model)
        where = (f"counted by hostbench in the compiled reference decode step of {model} at batch {b.memory_probe[0]}, "
                 f"context {b.memory_probe[1]} (perfmodel_kernels/reference.py; XLA:CPU on {b.cpu}, {b.date})")
        for k, v in copies.items():
            structure[f"host_stack_copies_{k}{suffix}"] = v
            sources[f"components.host_stack_copies_{k}{suffix}"] = (
                f"{where}: copies of whole cache stacks (copy instructions of a cache parameter's shape) " + (
                    f"per {k} layer, in units of its stacks" if not k.startswith("attention") else
                    f"in its op-by-op {k} phases, in units of all caches (mean)") + ": a structure, not a timing")
        for k, v in temps.items():
            name = "host_temp_per_cache_byte" + ("" if k == "step" else f"_{k}") + suffix
            structure[name] = v
            sources[f"components.{name}"] = (
                f"{where}: the temporary allocation (memory_analysis) of " + (
                    "the one-program step over all its caches" if k == "step" else
                    f"its op-by-op {k} phases over their layer's cache (mean)")
                + " (cache bytes: perfmodel.graph.ops): a structure, not a timing")
    hw = dataclasses.replace(hw, components={**hw.components, **structure}, sources={**hw.sources, **sources})
    write_all({mb: json.dumps(data, indent=1) + "\n",
               out: to_toml(hw, f"Host CPU measured by `perfmodel hostbench` ({b.cpu}, {b.date}).\n"
                                "launch_overhead_s is the op-by-op dispatch cost; a compiled program "
                                "has no launches\nand its ops pay their thunks (components.host_program_time)."),
               out.with_suffix(".json"): json.dumps(plain(b.json()), indent=1, allow_nan=False) + "\n"},
              parents=True)
    return out


def check_outputs(out: str | Path, name: str) -> Path:
    """The hardware file path and name `write` will use, refused before anything is measured."""
    out = check_output(out, parents=True)
    require(out.suffix == ".toml", "--out", str(out), "the hardware file must end in .toml")
    require(re.fullmatch(r"[A-Za-z0-9][\w.\-]{0,63}", name) is not None, "--name", name,
            "1..64 letters, digits, '.', '-' or '_', starting with a letter or digit")
    return out


def cmd_hostbench(a) -> dict:
    import jax  # noqa: F401  (fail here, with the CLI's hint, when JAX is missing)
    check_outputs(a.out, a.name)
    b = measure(a.repeats, a.quick, progress=not a.json)
    path = write(b, a.out, a.name)
    if not a.json:
        print(f"host: {b.cpu}, {b.devices} JAX device(s), LLC {b.llc_bytes / MIB:.0f} MiB, "
              f"RAM {b.ram_bytes / 2**30:.1f} GiB")
        for mib, s in b.read_bandwidth.items():
            print(f"  read  {mib:5d} MiB: " + _stat_text(s, 1e9, "GB/s"))
        for mib, s in b.copy_bandwidth.items():
            print(f"  copy  {mib:5d} MiB: " + _stat_text(s, 1e9, "GB/s"))
        for k, s in b.matmul_flops.items():
            print(f"  matmul {k}: " + _stat_text(s, 1e9, "GFLOP/s"))
        for k, s in b.decode_matmul_flops.items():
            print(f"  decode-shaped matmul {k}: " + _stat_text(s, 1e9, "GFLOP/s"))
        for (dt, rows), s in b.matvec_bandwidth.items():
            print(f"  decode matmul {dt} {rows:2d} rows x {MATVEC_MIB} MiB weight: "
                  + _stat_text(s, 1e9, "GB/s"))
        print("  dispatch: " + _stat_text(b.dispatch_s, 1e-6, "us"))
        for n_args, s in b.dispatch_by_args.items():
            print(f"  dispatch with {n_args:3d} array arguments: " + _stat_text(s, 1e-6, "us"))
        for thunks, s in b.thunk_chain.items():
            print(f"  program of {thunks:4d} thunks (lanes of tiny steps): " + _stat_text(s, 1e-6, "us per call"))
        for shape, s in b.argmax_s.items():
            print(f"  argmax of f32 {list(shape)}: " + _stat_text(s, 1e-6, "us"))
        print(f"  thunks per phase of the {PROBE_MODEL} reference step (compiled HLO, batch 1): "
              + ", ".join(f"{k} {v:.3g}" for k, v in b.reference_thunks.items()))
        for shape, s in b.convert_s.items():
            print(f"  bf16 -> f32 widening of {list(shape)}: " + _stat_text(s, 1e-6, "us"))
        for (k, w, rows), s in b.expert_loop.items():
            print(f"  expert loop, {k}x{w} experts, {rows:2d} rows: " + _stat_text(s, 1e-6, "us per expert"))
        for mib, s in b.temp_pages_s.items():
            print(f"  program filling a {mib:3d} MiB temporary: " + _stat_text(s, 1e-6, "us per call"))
        print(f"  temporaries per cache byte of the {PROBE_MODEL} reference step at batch {b.memory_probe[0]}, "
              f"context {b.memory_probe[1]}: " + ", ".join(f"{k} {v:.3g}" for k, v in b.temp_per_cache_byte.items())
              + f"; page {b.page_bytes} B; stack copies " + ", ".join(f"{k} {v:.3g}" for k, v in b.stack_copies.items()))
        for model, (temps, copies) in b.model_memory.items():
            print(f"  the same of {model}: " + ", ".join(f"{k} {v:.3g}" for k, v in temps.items())
                  + "; stack copies " + ", ".join(f"{k} {v:.3g}" for k, v in copies.items()))
        for shape, s in b.stack_copy_s.items():
            print(f"  copy of an f32 {list(shape)} stack into a reused buffer: " + _stat_text(s, 1e-6, "us per call"))
        print(f"wrote {path} (+ {path.with_suffix('.json').name})")
    return {"hardware_file": str(path), **b.json()}


def configure_hostbench(p) -> None:
    p.add_argument("--out", default=str(host_hardware_file()),
                   help="hardware file to write (default: %(default)s)")
    p.add_argument("--name", default="host-cpu", help="the hardware name in the file")
    p.add_argument("--repeats", type=count, default=7)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a measurement)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_hostbench)
