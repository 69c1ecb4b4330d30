"""The megakernel on the attached TPU in one command: right, fast, traced, beside XLA.

    python experiments/tpu_megakernel.py                 # on a TPU VM: every part (see below)
    python experiments/tpu_megakernel.py --only check,speed --slices k3-tp32-core
    python experiments/tpu_megakernel.py --report        # the committed results, no TPU needed
    python experiments/tpu_megakernel.py --dry-run       # CPU: the pipeline in interpret mode

Per slice and expert format the weights are drawn and packed once, and every program the
parts need is compiled ahead in parallel threads (`warm_compile`: lower and compile time of
each recorded with its run). On the lent v5e a K3 slice's kernel takes 20-26 s to lower, one
at a time, so a 10-minute call holds about 15 programs: the default set (about 40) stops at
`--budget-s` and needs three calls split by `--only` / `--slices` / `--formats`. Parts
(`--only`):
- check: greedy tokens of the megakernel and of the pure-JAX reference (`reference.decode_step`,
  one XLA program) on the same chip and weights, for MINI and the Kimi K3 slices in their first
  two expert formats (or `--formats`; the reference uses the dequantised experts), step by step:
  tokens must be equal where the reference's top-2 logits are clear (`TOKEN_MARGIN`), logits
  within `LOGIT_TOL` on the steps whose routing is decided (`ROUTER_MARGIN`); at
  `--check-batches` (default 4);
- speed: per slice, expert format and batch: the kernel's time per step as the slope of a
  call's wall time over the steps it runs (`megakernel.make_loop`: 1 and 1 + `--steps` steps in
  one program, median of `--repeats` calls each), so the ~0.5 ms host dispatch of a call cancels;
  the XLA reference the same way (`reference.make_loop`); the distinct experts each MoE layer
  picked in each of the steps the slope spans (`distinct_experts_steps`: the run is predicted as
  their mean); the bytes the step's DMA plan moves and their rate against the chip's in-kernel
  stream bandwidth measured by tpu_microbench.py; packing time;
- xla: the XLA reference alone at `--xla-batches` (those speed does not run);
- sweep: ring depth (`--depths`), expert slots (`--slots`) and bank rows (`--bank-rows`), each
  around the tuned config, and rings of a given depth and bank size together (`--rings`), on the
  first slice in its first format at `--sweep-batches`; `--expert-slots` runs every part at those
  slots instead of the tuned ones;
- trace: a `jax.profiler` trace of each slice at the first and last batch with the kernel's
  named scopes as in-kernel markers (the libtpu flags of experiments/profile_megakernel.py),
  per-layer and per-phase times by `perfmodel.validate.traces`; the first trace is kept
  (--keep-trace);
- xla_trace: a trace of the XLA reference at `--xla-trace-batches`, its device ops listed by time
  (`traces.op_table`); `--keep-xla-traces` keeps them for validate_tpu.py's per-layer reading.
Results: experiments/results/tpu_megakernel.json (machine, chip, JAX, libtpu, date, command,
one record a run; rewritten after every run, so a cut-short call keeps what it measured) and
`--report`'s summary. `experiments/validate_tpu.py` compares them with the model.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import profile_megakernel  # noqa: E402,F401  (sets the libtpu trace flags before jax is imported)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "tpu_megakernel.json"
PARTS = ("check", "speed", "xla", "sweep", "trace", "xla_trace")
SLICES = ("k3-tp32-core", "k3-tp8-core", "k3-tp8-dense")
FORMATS = {"k3-tp32-core": ("mxfp4", "int8", "bf16"), "k3-tp8-core": ("mxfp4", "int4"),
           "k3-tp8-dense": ("bf16",)}   # no routed experts: the format names nothing
BATCHES = (1, 2, 4, 8)
CONTEXT, POSITION = 2048, 1024    # MLA cache capacity; cached tokens per sequence at the start
# logits of kernel and reference differ by f32 accumulation order over bf16 products and by
# where each rounds activations to bf16 (the kernel's stream: inputs of every dot); relative to
# the logits' spread: 2^-8 (bf16's half ulp) times a few roundings in series per layer
LOGIT_TOL = 0.05
# a step's tokens are compared where the reference's top-2 logits are further apart than both
# may move (each by LOGIT_TOL); its logits are bounded where each MoE layer's router decides:
# the reference's k-th and next biased expert scores at least a quarter of bf16's step between
# 0.5 and 1 apart (2^-10), more than different bf16 roundings of the router's input move them.
# Closer, the kernel may route a token elsewhere: on the v5e a TP32-core int4 step at a router
# margin of 2.8e-4 differed by 0.43 of the spread, its neighbours at 1.6e-3 and more by 0.02
TOKEN_MARGIN, ROUTER_MARGIN = 2 * LOGIT_TOL, 2.0 ** -10


T0 = time.perf_counter()


def say(*a):
    """Print with the seconds since the script started."""
    print(f"[{time.perf_counter() - T0:5.0f} s]", *a, flush=True)


class Recorder:
    """The results file, rewritten (atomically) after every run. Each run names the code it ran
    (the header's commit and kernel_source), so runs merged from several calls keep it."""

    def __init__(self, path: Path, header: dict):
        self.path, self.res = path, dict(header, runs=[])

    def add(self, run: dict):
        from perfmodel.util.files import write_atomic
        self.res["runs"].append({"commit": self.res.get("commit"), "kernel_source": self.res.get("kernel_source"),
                                 **run})
        write_atomic(self.path, json.dumps(self.res, indent=1) + "\n")


def header(jax, chip_name: str) -> dict:
    import importlib.metadata as md
    try:
        libtpu = md.version("libtpu")
    except md.PackageNotFoundError:
        libtpu = None
    dev = jax.devices()[0]
    return {"machine": dev.device_kind, "chip": chip_name, "jax": jax.__version__,
            "libtpu": libtpu, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": source_commit(), "kernel_source": kernel_source(),
            "command": "python experiments/tpu_megakernel.py " + " ".join(sys.argv[1:])}


def source_commit() -> str | None:
    """The commit the code ran from: $PERFMODEL_COMMIT where the tree was copied (a TPU VM's
    copy may hold a stale .git), else git's."""
    import os
    import subprocess
    if os.environ.get("PERFMODEL_COMMIT"):
        return os.environ["PERFMODEL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def kernel_source(files: dict[str, bytes] | None = None) -> str:
    """A hash of the kernel's code (perfmodel_kernels/*.py, or `files`: name -> bytes): runs with
    the same hash ran the same kernel, whatever commit they came from. A what-if compares only
    such runs (validate_tpu.whatif)."""
    import hashlib
    if files is None:
        files = {p.name: p.read_bytes() for p in (ROOT / "perfmodel_kernels").glob("*.py")}
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    return h.hexdigest()[:12]


def stream_bandwidth(chip: str) -> float | None:
    """The chip's in-kernel HBM -> VMEM stream bandwidth from its committed micro-benchmarks:
    the median of the ring entries of copies >= 1 MiB with >= 2 in flight."""
    path = ROOT / "experiments" / "results" / f"tpu_{chip}_microbench.json"
    if not path.exists():
        return None
    rates = []
    for e in json.loads(path.read_text())["entries"]:
        i = e.get("inputs", {})
        if e.get("mechanism") == "dma_ring" and i.get("bytes", 0) >= 1 << 20 \
                and i.get("in_flight", 0) >= 2:
            rates.append(i["bytes"] / (e["value"] * 1e-6))
    return statistics.median(rates) if rates else None


def timed(fn, *args, repeats: int):
    """Median wall time of fn(*args) (blocked), after one untimed call; the last result."""
    import jax
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class Slice:
    """A slice's weights on the chip: reference (bf16; the experts dequantised when the format
    is quantised) and packed for the kernel, with how long packing took."""

    def __init__(self, name, fmt, cfg0, interpret):
        import jax
        from perfmodel_kernels import layout, quant, reference
        from perfmodel_kernels.specs import slice_spec
        self.name, self.fmt, self.spec = name, fmt, slice_spec(name, fmt)
        t0 = time.perf_counter()
        w = reference.init_weights(self.spec, 0)
        jax.block_until_ready(w.params)
        self.init_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.packed = layout.pack_weights(w, cfg0)
        jax.block_until_ready(self.packed)
        self.pack_s = time.perf_counter() - t0
        if fmt != "bf16":   # the reference runs the dequantised experts, replaced in place
            for lw in w["layers"]:
                for k in quant.EXPERT_KEYS:
                    if k in lw:
                        lw[k] = quant.dequantized_experts(lw[k], fmt, cfg0.tile)
        self.weights, self.interpret = w, interpret
        self._by_banks = {self.packed.banks: self.packed}

    def packed_for(self, cfg):
        """The packed weights laid out in cfg's banks: the static stream packed again per bank
        size (from the reference's weights: only their experts were dequantised above)."""
        from perfmodel_kernels import layout
        key = (cfg.tile, cfg.bank_rows)
        if key not in self._by_banks:
            self._by_banks[key] = layout.with_banks(self.packed, self.weights, cfg)
        return self._by_banks[key]


def kernel_cfg(spec, batch, interpret, **over):
    from perfmodel_kernels import layout, tuned
    t = tuned.tuned(spec.name, 1)
    base = dict(batch=batch, max_context=64 if interpret else CONTEXT,
                depth=3 if interpret else t.depth, expert_slots=t.expert_slots,
                cache_block=16 if interpret else 256,
                bank_rows=256 if interpret else t.bank_rows)
    base.update(over)
    return layout.KernelConfig(**base)


def start_state(sl, cfg):
    import jax.numpy as jnp
    from perfmodel_kernels import reference
    pos = start_position(cfg)
    return (reference.init_cache(sl.spec, cfg.batch, cfg.max_context),
            jnp.arange(cfg.batch, dtype=jnp.int32) % sl.spec.vocab,
            jnp.full((cfg.batch,), pos, jnp.int32), pos)


def start_position(cfg) -> int:
    """Each sequence's cached tokens at the start of a run."""
    return min(POSITION, cfg.max_context // 2)


def check(sl, cfg, steps=4, exe=None) -> dict:
    """Greedy tokens of kernel and reference from the same start, `steps` steps (exe: the
    kernel's step program compiled ahead, `warm_compile`); per step the logit error, whether the
    tokens agree, and the reference's margins: top-2 logits over their spread, and the smallest
    `reference.router_margin` of its MoE layers (near 0 the kernel, rounding otherwise, may
    route a token to another expert, and the logits then differ by more than rounding)."""
    import functools
    import jax.numpy as jnp
    import numpy as np
    from perfmodel_kernels import megakernel, reference
    step = functools.partial(megakernel.verify_step, exe, cfg) if exe else \
        megakernel.make_step(sl.spec, cfg, sl.interpret)
    kc, tok, pos, _ = start_state(sl, cfg)
    weights = sl.packed_for(cfg)
    rc = {k: v.copy() for k, v in kc.items()}
    rt, per_step = tok, []
    for _ in range(steps):
        margins = np.asarray(reference.router_margins(sl.weights, rc, rt, pos))
        tok, klog, kc, _ = step(weights, kc, tok, pos)
        rt, rlog, rc = reference.decode_step(sl.weights, rc, rt, pos)
        spread = float(jnp.std(rlog)) or 1.0
        top2 = np.sort(np.asarray(rlog), axis=-1)[..., -2:]
        per_step.append({"logit_error": float(jnp.max(jnp.abs(klog - rlog))) / spread,
                         "tokens_equal": bool(np.array_equal(np.asarray(tok), np.asarray(rt))),
                         "top2_margin": float(np.min(top2[..., 1] - top2[..., 0])) / spread,
                         "router_margin": float(margins.min()) if margins.size else None})
        tok = rt   # both continue from the reference's tokens
        pos = pos + 1
    return verdict(per_step)


def verdict(per_step: list[dict]) -> dict:
    """A check's record from its steps: tokens equal and the largest logit error over all steps;
    `ok` when tokens agree wherever the reference's top-2 margin exceeds TOKEN_MARGIN and the
    logits are within LOGIT_TOL on every step whose routing is decided (router margin at least
    ROUTER_MARGIN; a dense model's always), at least one such step."""
    decided = [s for s in per_step if s["router_margin"] is None or s["router_margin"] >= ROUTER_MARGIN]
    clear = [s for s in per_step if s["top2_margin"] > TOKEN_MARGIN]
    worst_decided = max((s["logit_error"] for s in decided), default=None)
    return {"tokens_equal": all(s["tokens_equal"] for s in per_step),
            "logit_error": max(s["logit_error"] for s in per_step), "logit_tolerance": LOGIT_TOL,
            "logit_error_decided": worst_decided, "decided_steps": len(decided),
            "ok": bool(decided) and worst_decided <= LOGIT_TOL and all(s["tokens_equal"] for s in clear),
            "steps": per_step}


def slope(fn, weights, cache, tok, pos, steps: int, repeats: int):
    """fn(weights, cache, tok, pos, n) -> (tok, cache, ...) runs n steps in one call (the cache
    donated and threaded through): (time per step, the slope of the median call time between
    1 and 1 + steps steps; one-step call's wall time; the first call's time, compile included;
    the last output)."""
    import jax
    import jax.numpy as jnp
    state = [cache]

    def call(n):
        out = jax.block_until_ready(fn(weights, state[0], tok, pos, jnp.int32(n)))
        state[0] = out[1]
        return out

    def median_of(n):
        times, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = call(n)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out
    t0 = time.perf_counter()
    call(1)
    first = time.perf_counter() - t0
    t1, _ = median_of(1)
    tn, out = median_of(1 + steps)
    return (tn - t1) / steps, t1, first, out


def slope_picks(picks, steps: int) -> list[list[int]]:
    """The distinct experts per MoE layer of the steps a slope's time per step is the mean of: the
    longer call's steps after its first (which the one-step call also runs), from the loop's
    per-step picks (`reference.make_loop`). A run is predicted as the mean over these steps, where
    one step's picks had set a batch-4 prediction up to 7.6 % apart (12 or 14 experts a layer)."""
    return [[int(d) for d in row] for row in picks[1:1 + steps]]


def speed(sl, cfg, steps, repeats, with_xla=True, exes=None) -> list[dict]:
    """The kernel's (and the XLA reference's) time per step on this slice and config (exes:
    programs compiled ahead, `warm_compile`)."""
    from perfmodel_kernels import megakernel, plan
    exes = exes or {}
    cache, tok, pos, p0 = start_state(sl, cfg)
    loop = exes.get(("loop", cfg)) or megakernel.make_loop(sl.spec, cfg, sl.interpret)
    step_s, wall, first, res = slope(loop, sl.packed_for(cfg), cache, tok, pos, steps, repeats)
    picks = slope_picks(res[2], steps)
    mid = p0 + steps // 2     # the loop's positions run p0 .. p0 + steps
    nbytes = statistics.mean(sum(c.bytes for c in plan.dma_plan(sl.spec, cfg, ndist, [mid] * cfg.batch))
                             for ndist in picks)
    out = [{"kind": "megakernel", "slice": sl.name, "format": sl.fmt, "batch": cfg.batch,
            "config": config_dict(cfg), "positions": [mid] * cfg.batch,
            "distinct_experts": picks[-1], "distinct_experts_steps": picks,
            "step_s": step_s, "wall_step_s": wall,
            "first_call_s": first, "plan_bytes": nbytes,
            "plan_bytes_per_s": nbytes / step_s if step_s > 0 else None,
            "feed": feed_of(sl.spec, cfg),
            "expert_decode": plan.settings(sl.spec, cfg).get("expert_decode")}]
    return out + ([xla_speed(sl, cfg, steps, repeats, exes.get(("xla", cfg.batch)))]
                  if with_xla else [])


def xla_speed(sl, cfg, steps, repeats, exe=None) -> dict:
    """The XLA reference's time per step (one XLA program a step) on the slice's weights."""
    from perfmodel_kernels import reference
    cache, tok, pos, p0 = start_state(sl, cfg)
    step_s, wall, first, res = slope(exe or reference.make_loop(), sl.weights, cache, tok, pos,
                                     steps, repeats)
    picks = slope_picks(res[2], steps)
    return {"kind": "xla", "slice": sl.name, "format": sl.fmt, "batch": cfg.batch,
            "positions": [p0 + steps // 2] * cfg.batch, "cache_tokens": cfg.max_context,
            "distinct_experts": picks[-1], "distinct_experts_steps": picks, "step_s": step_s,
            "wall_step_s": wall, "first_call_s": first}


def slice_work(a, parts, name, k, fmt, batches, interpret, sweep) -> dict:
    """The kernel configs each part runs on slice `name` in its k-th expert format `fmt`."""
    fixed = {"expert_slots": a.expert_slots} if a.expert_slots else {}
    cfg = lambda b, **over: kernel_cfg_for(name, b, interpret, **{**fixed, **over})  # noqa: E731
    first = k == 0 or bool(a.formats)
    work = {"check": ([cfg(2)] if interpret else [cfg(int(b)) for b in a.check_batches.split(",")])
            if "check" in parts and (a.formats or k < 2) else [],
            "speed": [cfg(b) for b in batches if first or b in (batches[0], batches[-1])]
            if "speed" in parts else [],
            "xla": [b for b in ([4] if interpret else map(int, a.xla_batches.split(",")))
                    if b not in batches] if "xla" in parts and k == 0 else [],
            "sweep": [], "trace": [], "with_xla": k == 0,
            "xla_trace": [b for b in ([2] if interpret else map(int, a.xla_trace_batches.split(",")))]
            if "xla_trace" in parts and k == 0 else []}
    if "sweep" in parts and sweep:
        t = cfg(1)   # the tuned depth, slots and bank rows (the slots of --expert-slots)
        for b in ((2,) if interpret else [int(x) for x in a.sweep_batches.split(",")]):
            work["sweep"] += [cfg(b, depth=int(d)) for d in a.depths.split(",") if d]
            work["sweep"] += [cfg(b, expert_slots=int(x)) for x in a.slots.split(",")
                              if x and int(x) != t.expert_slots]
            work["sweep"] += [cfg(b, bank_rows=int(x)) for x in a.bank_rows.split(",")
                              if x and int(x) != t.bank_rows]
            work["sweep"] += [cfg(b, depth=d, bank_rows=r) for d, r in rings(a.rings)]
    if "trace" in parts and k == 0:
        work["trace"] = [cfg(b) for b in dict.fromkeys((batches[0], batches[-1]))]
    return without_invalid(name, fmt, work)


def without_invalid(name, fmt, work) -> dict:
    """`work` less the kernel configs the slice's kernel refuses (more expert slots than a step's
    picks, buffers beyond the chip's VMEM), each named as it is dropped: before any weight is
    drawn."""
    from perfmodel.util.errors import SpecError
    from perfmodel_kernels import vmem
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec(name, fmt)

    def valid(cfg) -> bool:
        try:
            vmem.check_vmem(spec, cfg)
            return True
        except SpecError as e:
            say(f"{name}: skipped {cfg_name(cfg)}: {e}")
            return False
    return {key: [c for c in v if valid(c)] if key in ("check", "speed", "sweep", "trace") else v
            for key, v in work.items()}


def cfg_name(c) -> str:
    """A kernel config as the logs name it."""
    return f"batch {c.batch} depth {c.depth} slots {c.expert_slots} bank rows {c.bank_rows}"


def compiled_ahead(work, compiled) -> dict:
    """`work` less the programs `warm_compile` stopped short of for the budget, each named as it
    is dropped: compiling one inside its part would run past --budget-s."""
    def kept(key, label) -> bool:
        if key in compiled:
            return True
        say(f"  budget: {label} not compiled ahead, skipped")
        return False
    loop = lambda part: [c for c in work[part] if kept(("loop", c), f"{part} {cfg_name(c)}")]  # noqa: E731
    return {**work, "check": [c for c in work["check"] if kept(("step", c), f"check {cfg_name(c)}")],
            "speed": [c for c in loop("speed") if not work["with_xla"] or kept(("xla", c.batch), f"xla batch {c.batch}")],
            "sweep": loop("sweep"), "trace": loop("trace"),
            "xla": [b for b in work["xla"] if kept(("xla", b), f"xla batch {b}")],
            "xla_trace": [b for b in work["xla_trace"] if kept(("xla", b), f"xla_trace batch {b}")]}


def rings(text: str) -> list[tuple[int, int]]:
    """--rings "16x16384,8x32768" -> [(16, 16384), (8, 32768)]."""
    out = []
    for item in filter(None, text.split(",")):
        d, _, r = item.partition("x")
        if not (d.isdigit() and r.isdigit() and int(d) > 0 and int(r) > 0):
            raise SystemExit(f"tpu_megakernel: --rings: {item!r} is not DEPTHxBANK_ROWS (e.g. 16x16384)")
        out.append((int(d), int(r)))
    return out


def warm_compile(sl, work, budget_left) -> tuple[dict, dict]:
    """Compile every program `work` needs ahead: traced and lowered one at a time here
    (tracing holds Python's lock; on the lent v5e's host a Kimi K3 slice's kernel takes ~20 s
    to lower), compiled in threads (Mosaic and XLA release the lock and compile on one core
    each, a VM has cores to spare). No job starts with less than 120 s of the budget left.
    (timings {key: {"lower_s", "compile_s", "compiled_beside"}}, executables {key: compiled}),
    key ("loop" | "step", cfg) or ("xla", batch)."""
    import concurrent.futures as cf
    import os
    import jax.numpy as jnp
    from perfmodel_kernels import megakernel, reference

    def loop(cfg):
        return lambda: megakernel.make_loop(sl.spec, cfg, sl.interpret).lower(
            sl.packed_for(cfg), *start_state(sl, cfg)[:3], jnp.int32(1))

    def xla(b):
        cfg = kernel_cfg_for(sl.name, b, sl.interpret is not None)
        return lambda: reference.make_loop().lower(sl.weights, *start_state(sl, cfg)[:3],
                                                   jnp.int32(1))

    def step(cfg):
        return lambda: megakernel.lower_step(sl.spec, cfg, sl.packed_for(cfg),
                                             *start_state(sl, cfg)[:3], interpret=sl.interpret)
    # in the order the parts need them, should the budget cut the list short
    jobs = {("loop", c): loop(c) for c in work["speed"]}
    jobs.update({("xla", c.batch): xla(c.batch) for c in work["speed"] if work["with_xla"]})
    jobs.update({("step", c): step(c) for c in work["check"]})
    jobs.update({("loop", c): loop(c) for c in work["sweep"] + work["trace"]})
    jobs.update({("xla", b): xla(b) for b in work["xla"] + work["xla_trace"]})
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    say(f"  compiling {len(jobs)} programs ahead, {workers} at a time")
    out, exes, running, t0 = {}, {}, {}, time.perf_counter()

    def compile_one(key, lowered, beside):
        t = time.perf_counter()
        exes[key] = lowered.compile()
        return key, time.perf_counter() - t, beside

    with cf.ThreadPoolExecutor(workers) as pool:
        for key, lower in jobs.items():
            if budget_left() < 120:
                say("  budget: no more compiles started")
                break
            t = time.perf_counter()
            lowered = lower()
            out[key] = {"lower_s": time.perf_counter() - t}
            beside = min(sum(not f.done() for f in running), workers - 1)
            running[pool.submit(compile_one, key, lowered, beside)] = key
        for f in cf.as_completed(running):
            key, dt, beside = f.result()
            out[key].update(compile_s=dt, compiled_beside=beside)
            name = f"{key[0]} " + (f"batch {key[1]}" if key[0] == "xla" else cfg_name(key[1]))
            say(f"    {name}: lowered in {out[key]['lower_s']:.1f} s, compiled in {dt:.1f} s "
                f"(beside {beside} others; {time.perf_counter() - t0:.0f} s in)")
    return out, exes


def run_check(res, sl, cfg, interpret, exe=None) -> None:
    r = check(sl, cfg, steps=2 if interpret else 4, exe=exe)
    res.add(dict(kind="check", slice=sl.name, format=sl.fmt, batch=cfg.batch, config=config_dict(cfg), **r))
    decided = "-" if r["logit_error_decided"] is None else f"{r['logit_error_decided']:.4f}"
    say(f"check {sl.name} {sl.fmt} batch {cfg.batch} slots {cfg.expert_slots}: tokens equal "
        f"{r['tokens_equal']}, logit error {r['logit_error']:.4f} of their spread, {decided} on the "
        f"{r['decided_steps']} of {len(r['steps'])} steps whose routing is decided (bound {LOGIT_TOL}): "
        f"{'ok' if r['ok'] else 'FAILED'}")
    for i, s in enumerate(r["steps"]):
        router = "-" if s["router_margin"] is None else f"{s['router_margin']:.2e}"
        say(f"  step {i}: logit error {s['logit_error']:.4f}, tokens equal {s['tokens_equal']}; the "
            f"reference's top-2 logit margin {s['top2_margin']:.4f} of the spread, router margin {router}")


def run_trace(res, sl, cfg, keep: str | None, interpret, loop=None) -> None:
    """A trace of a few steps at cfg, parsed and recorded; the first one kept at `keep`."""
    import shutil
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="tpu_trace_"))
    tr = trace_run(sl, cfg, 3 if interpret else 5, d, loop)
    res.add({"kind": "trace", "slice": sl.name, "format": sl.fmt, "batch": cfg.batch,
             "config": config_dict(cfg), **tr})
    say(f"  trace {sl.name} batch {cfg.batch}: " + (f"step {tr['step_s'] * 1e6:.1f} us, "
        f"{len(tr['phases_s'])} phases" if "step_s" in tr else tr["error"]))
    if keep and not any(r["kind"] == "trace" for r in res.res["runs"][:-1]):
        for f in d.rglob("*.xplane.pb"):
            shutil.copy(f, keep)
            break
    shutil.rmtree(d, ignore_errors=True)


def run_xla_trace(res, sl, cfg, exe=None, keep: str | None = None) -> None:
    """A trace of a few one-step calls of the XLA reference and its device ops by time,
    recorded (keep: a folder the trace's .xplane.pb is copied to). This libtpu's XLA ops carry
    no named scopes: validate_tpu.py reads a kept trace per layer with the program's HLO
    (experiments/xla_reference_hlo.py)."""
    import shutil
    import tempfile
    from perfmodel_kernels import reference
    from perfmodel.validate.traces import op_table
    d = Path(tempfile.mkdtemp(prefix="xla_trace_"))
    steps = 3
    picked = profiled(exe or reference.make_loop(), sl.weights, sl, cfg, steps, d)[1][-1]
    ops = [{"name": o.name, "category": o.category, "per_step": o.count / steps,
            "s_per_step": o.total_s / steps, "hlo": o.hlo[:200]} for o in op_table(d, 25)]
    if keep:
        for f in d.rglob("*.xplane.pb"):
            shutil.copy(f, Path(keep) / f"xla_{sl.name}_{sl.fmt}_b{cfg.batch}.xplane.pb")
    shutil.rmtree(d, ignore_errors=True)
    res.add({"kind": "xla_trace", "slice": sl.name, "format": sl.fmt, "batch": cfg.batch,
             "distinct_experts": [int(x) for x in picked], "ops": ops})
    say(f"  xla trace {sl.name} batch {cfg.batch}: {len(ops)} ops")
    for o in ops[:15]:
        say(f"    {o['s_per_step'] * 1e6:8.1f} us x{o['per_step']:<5g} {o['name']} [{o['category']}] "
            f"{o['hlo'][:120]}")


def profiled(loop, weights, sl, cfg, steps: int, out_dir: Path, hlo: bool = True):
    """`steps` one-step calls of `loop` (a make_loop program) from the start state, traced into
    `out_dir` each inside a `decode_step` annotation, after one untimed call: (the last call's
    outputs, each traced call's distinct experts per MoE layer). hlo: the trace carries the HLO of
    the programs compiled in this process, which XLA's op table reads. A megakernel's HLO holds its
    Mosaic body: on the VM, traces after a fresh compile were over 16 MB and took the profiler
    26-242 s, those of programs from the compile cache (no HLO in the process) 0.8 MB and 3-6 s;
    kernel traces leave it out (hlo=False): the first after a fresh compile then took 35 s, the next
    1 s (call k)."""
    import jax
    import jax.numpy as jnp
    from perfmodel.validate.traces import STEP_NAME
    cache, tok, pos, _ = start_state(sl, cfg)
    one = jnp.int32(1)
    out = jax.block_until_ready(loop(weights, cache, tok, pos, one))
    picks = []
    options = jax.profiler.ProfileOptions()
    options.enable_hlo_proto = hlo
    with jax.profiler.trace(str(out_dir), profiler_options=options):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                out = jax.block_until_ready(loop(weights, out[1], out[0], pos, one))
            picks.append([int(d) for d in out[2][0]])
    return out, picks


def config_dict(cfg) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg)


def feed_of(spec, cfg) -> str | None:
    """How the routed experts reach the MXU on this chip, in words."""
    from perfmodel_kernels import layout, quant
    if not spec.count(ffn="moe"):
        return None
    f = layout.expert_layout(spec, cfg).fmt
    why = "" if cfg.target.fp8 or quant.feed(f) != "bf16" or f.name in ("bf16", "int8") else \
        f" (TPU {cfg.target.version} has no fp8 MXU)"
    return f"{f.name} fed to the MXU as {quant.feed(f)}{why}"


def trace_run(sl, cfg, steps, out_dir: Path, loop=None) -> dict:
    """Per-layer and per-phase times of `steps` traced one-step calls (loop: the program
    compiled ahead), and what the validation predicts the trace with: the distinct experts each
    traced step picked per MoE layer (other tokens than the speed run's), the steps' positions
    (each call starts from the same ones) and the kernel's expert decode."""
    from perfmodel_kernels import megakernel, plan
    from perfmodel.util.errors import SpecError
    _, picks = profiled(loop or megakernel.make_loop(sl.spec, cfg, sl.interpret), sl.packed_for(cfg),
                        sl, cfg, steps, out_dir, hlo=False)
    try:
        return dict(trace_record(out_dir, len(sl.spec.layers)), distinct_experts_steps=picks,
                    positions=[start_position(cfg)] * cfg.batch,
                    expert_decode=plan.settings(sl.spec, cfg).get("expert_decode"))
    except SpecError as e:
        return {"error": str(e)}


def trace_record(path, n_layers: int) -> dict:
    """A trace's medians over its steps (`perfmodel.validate.traces.parse_trace`): the step, each
    layer and phase, the markers nested in a phase, and the parser's notes."""
    from perfmodel.validate.traces import parse_trace
    tr = parse_trace(path, n_layers=n_layers)
    return {"step_s": tr.step_s.median, "unattributed_share": tr.unattributed_share,
            "phases_s": {k: v.median for k, v in tr.phase_s.items()},
            "layers_s": {str(k): v.median for k, v in tr.layer_s.items()},
            "sub_phases_s": {k: v.median for k, v in tr.sub_phase_s.items()},
            "notes": tr.notes}


def summary_line(res: dict) -> str:
    """One line over a results file: slices, formats, batches, batch-1 stream share, speed-up
    over XLA at batches 1 and 8, compile and packing time, of the latest run of each point (as
    `table`: the current kernel)."""
    runs = res["runs"]
    mk = list({_point(r): r for r in runs if r["kind"] == "megakernel" and "step_s" in r
               and not r.get("sweep")}.values())
    xla = {_point(r): r["step_s"] for r in runs if r["kind"] == "xla"}
    share = [r["plan_bytes_per_s"] / res["stream_bytes_per_s"] for r in mk
             if r["batch"] == 1 and res.get("stream_bytes_per_s") and r.get("plan_bytes_per_s")]

    def speedup(b):
        v = [xla[_point(r)] / r["step_s"] for r in mk if r["batch"] == b and _point(r) in xla]
        return f"{min(v):.2f}-{max(v):.2f}x" if v else "-"
    def compile_s(r):
        return r["lower_s"] + r["compile_s"] if "compile_s" in r else r.get("first_call_s")
    comp = [c for r in mk if (c := compile_s(r))]
    pack = list({(r["slice"], r["format"]): r["pack_s"] for r in runs if r["kind"] == "packing"}.values())
    # the largest slice (the most bytes a batch-1 step streams): its own compile and packing times
    big = max((r for r in mk if r["batch"] == 1 and r.get("plan_bytes")),
              key=lambda r: r["plan_bytes"], default=None)
    largest = "-"
    if big is not None:
        own = [c for r in mk if r["slice"] == big["slice"] and (c := compile_s(r))]
        packs = [r["pack_s"] for r in runs if r["kind"] == "packing" and r["slice"] == big["slice"]]
        largest = (f"{big['slice']}: trace + compile <= {max(own):.0f} s, packing "
                   + (f"<= {max(packs):.1f} s" if packs else "-"))
    checks = [r for r in runs if r["kind"] == "check"]
    return (f"{res['machine']} ({res['date'][:10]}, jax {res['jax']}): "
            f"{len({r['slice'] for r in mk})} slices, {len({r['format'] for r in mk})} formats, "
            f"batches {sorted({r['batch'] for r in mk})}; greedy tokens equal in "
            f"{sum(c['tokens_equal'] for c in checks)}/{len(checks)} checks, passed in "
            f"{sum(c['ok'] for c in checks)}; batch-1 stream share "
            + (f"{min(share):.1%}-{max(share):.1%}" if share else "-")
            + f"; speed-up over XLA batch 1 {speedup(1)}, batch 8 {speedup(8)}; trace + compile "
            + (f"<= {max(comp):.0f} s" if comp else "-") + "; packing "
            + (f"<= {max(pack):.1f} s" if pack else "-") + f"; largest slice {largest}")


def _point(r: dict) -> tuple:
    return r["slice"], r["format"], r["batch"]


def table(res: dict) -> str:
    """The measured runs as a markdown table: per slice, format and batch (the latest run of
    each: the current kernel) the kernel's time per step and tokens/s, the XLA reference's time on
    the same chip and weights, the speed-up and the share of the chip's measured stream bandwidth
    the step's DMA plan moves, and the commit it ran (the sweeps' points are validate_tpu's)."""
    xla = {_point(r): r["step_s"] for r in res["runs"] if r["kind"] == "xla"}
    latest = {_point(r): r for r in res["runs"] if r["kind"] == "megakernel" and not r.get("sweep")}
    lines = ["| slice | experts | batch | kernel us/step | tok/s | XLA us/step | speed-up | "
             "stream share | commit |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for key in sorted(latest):
        r = latest[key]
        x = xla.get(key)
        share = (r["plan_bytes_per_s"] / res["stream_bytes_per_s"]
                 if res.get("stream_bytes_per_s") and r.get("plan_bytes_per_s") else None)
        experts = f"{r['format']} as {r['feed'].split(' as ')[1].split()[0]}" if r.get("feed") \
            else "none (dense)"
        lines.append(f"| {r['slice']} | {experts}"
                     f" | {r['batch']} | {r['step_s'] * 1e6:.0f} | {r['batch'] / r['step_s']:.0f}"
                     f" | {x * 1e6:.0f} | {x / r['step_s']:.2f}x |" if x else
                     f"| {r['slice']} | {experts} | {r['batch']} | {r['step_s'] * 1e6:.0f} | "
                     f"{r['batch'] / r['step_s']:.0f} | - | - |")
        lines[-1] += (f" {share:.1%} |" if share else " - |") + f" {r.get('commit') or '-'} |"
    kernel = {_point(r) for r in res["runs"] if r["kind"] == "megakernel"}
    lines += [f"| {r['slice']} | (XLA alone) | {r['batch']} | - | {r['batch'] / r['step_s']:.0f} "
              f"| {r['step_s'] * 1e6:.0f} | - | - | {r.get('commit') or '-'} |" for r in res["runs"]
              if r["kind"] == "xla" and _point(r) not in kernel]
    checks = {_point(r): r for r in res["runs"] if r["kind"] == "check"}   # the latest of each
    lines += ["", "| check on the chip (the latest of each) | experts | batch | greedy tokens equal | "
              "max logit error / spread | on steps whose routing is decided | passed | commit |",
              "|---|---|---:|---|---:|---:|---|---|"]
    lines += [f"| {c['slice']} | {c['format']} | {c['batch']} | {'yes' if c['tokens_equal'] else 'NO'} | "
              f"{c['logit_error']:.3f} | "
              + ("-" if c.get("logit_error_decided") is None else
                 f"{c['logit_error_decided']:.3f} ({c['decided_steps']} of {len(c['steps'])} steps)")
              + f" | {'yes' if c['ok'] else 'NO'} | {c.get('commit') or '-'} |" for c in checks.values()]
    calls = len({r.get("command", res["command"]) for r in res["runs"]})
    return "\n".join(lines) + f"\n\n{summary_line(res)}; {calls} commands, each run's in " \
        "`experiments/results/tpu_megakernel.json`, the calls' logs in " \
        "`experiments/results/tpu_v5e/`.\n"


def report(path: Path) -> int:
    print(table(json.loads(path.read_text())))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python experiments/tpu_megakernel.py",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true",
                    help="print the committed results' table and summary line (no TPU)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no TPU: MINI in interpret mode through every part (timings mean nothing)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts: {','.join(PARTS)}")
    ap.add_argument("--slices", default=",".join(SLICES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--formats", help="expert formats of every slice (default: per slice, "
                    "FORMATS)")
    ap.add_argument("--steps", type=int, default=8, help="extra steps a call for the slope")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per point (median)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--keep-trace", help="copy the first trace's .xplane.pb here")
    ap.add_argument("--depths", default="1,2,4,8,16", help="sweep: ring depths (at the tuned slots)")
    ap.add_argument("--slots", default="1,2,3,4", help="sweep: expert slots (at the tuned depth)")
    ap.add_argument("--bank-rows", default="4096,8192,32768",
                    help="sweep: ring bank rows (at the tuned depth and slots)")
    ap.add_argument("--rings", default="",
                    help="sweep: rings DEPTHxBANK_ROWS (e.g. 16x16384), depth and bank rows changed together")
    ap.add_argument("--sweep-batches", default="1", help="sweep: batches")
    ap.add_argument("--check-batches", default="4", help="check: batches the tokens are compared at")
    ap.add_argument("--expert-slots", type=int,
                    help="expert slots of every run instead of the tuned ones (--slots still sweeps)")
    ap.add_argument("--xla-batches", default="1,2,4,8,16,32,64",
                    help="xla: batches of the XLA reference alone (those not run by speed)")
    ap.add_argument("--xla-trace-batches", default="1,8,64", help="xla_trace: batches")
    ap.add_argument("--keep-xla-traces", help="xla_trace: copy each trace's .xplane.pb to this folder")
    ap.add_argument("--cache-dir", default="/tmp/perfmodel_jax_cache",
                    help="JAX's persistent compilation cache on a TPU (unless JAX already has one)")
    ap.add_argument("--budget-s", type=float, default=540,
                    help="start no new run after this many seconds")
    a = ap.parse_args(argv)
    if a.report:
        return report(Path(a.out))
    parts = a.only.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {', '.join(bad)}; known: {', '.join(PARTS)}")
    rings(a.rings)   # a malformed --rings fails before the TPU is opened
    if a.expert_slots is not None and a.expert_slots < 1:
        ap.error(f"--expert-slots: {a.expert_slots} is not a positive number of slots")
    from perfmodel_kernels.reference import PICKS_KEPT
    if not 1 <= a.steps < PICKS_KEPT:
        ap.error(f"--steps: {a.steps}; the slope's longer call keeps the picks of {PICKS_KEPT} steps, "
                 f"so 1 to {PICKS_KEPT - 1}")
    if not all(b.strip().isdigit() and int(b) > 0 for b in a.check_batches.split(",")):
        ap.error(f"--check-batches: {a.check_batches!r} is not a comma-separated list of batches")
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from perfmodel_kernels import chip as chip_mod
    on_tpu = pltpu.is_tpu_device()
    if on_tpu and not jax.config.jax_compilation_cache_dir:
        # each run compiles the kernel, the reference and the weights' drawing programs anew; a
        # later run on the same VM (another part, slice or call) reads them from disk: on the
        # v5e a slice's weights took 56 s to draw cold, the whole traced run 56 s warm
        jax.config.update("jax_compilation_cache_dir", str(Path(a.cache_dir)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not on_tpu and not a.dry_run:
        print("tpu_megakernel: no TPU attached; run it on a TPU VM, --dry-run for the CPU "
              "interpret-mode smoke test, or --report for the committed results",
              file=sys.stderr)
        return 2
    interpret = None if on_tpu else pltpu.InterpretParams(detect_races=True)
    target = chip_mod.chip()
    t_start = time.perf_counter()
    res = Recorder(Path(a.out), header(jax, target.version))
    res.res["stream_bytes_per_s"] = stream_bandwidth(target.version)
    res.res["note"] = ("interpret mode on CPU: a smoke test; no timing means anything"
                       if interpret else "measured on the attached TPU")
    slices = ["kimi-k3-mini"] if interpret else a.slices.split(",")
    batches = [2] if interpret else [int(b) for b in a.batches.split(",")]
    steps, repeats = (1, 1) if interpret else (a.steps, a.repeats)
    if interpret:   # the dry run: one point of each sweep
        a.depths, a.slots, a.bank_rows = "2", "1", "512"
    say(f"{res.res['machine']}: jax {jax.__version__}, libtpu {res.res['libtpu']}; stream "
        f"bandwidth {res.res['stream_bytes_per_s'] or 0:.3g} B/s (micro-benchmarks)")

    def over_budget():
        return time.perf_counter() - t_start > a.budget_s

    if "check" in parts and not a.formats and not interpret:   # MINI first: a quick signal
        for fmt in ("bf16", "mxfp4"):
            cfg = kernel_cfg_for("kimi-k3-mini", 4, interpret)
            run_check(res, Slice("kimi-k3-mini", fmt, cfg, interpret), cfg, interpret)
    for name in slices:
        fmts = ["mxfp4"] if interpret else (a.formats.split(",") if a.formats
                                            else list(FORMATS[name]))
        for k, fmt in enumerate(fmts):
            if over_budget():
                break
            work = slice_work(a, parts, name, k, fmt, batches, interpret,
                              sweep=name == slices[0] and k == 0)
            if not any(v for key, v in work.items() if key != "with_xla"):
                continue
            sl = Slice(name, fmt, kernel_cfg_for(name, 1, interpret), interpret)
            res.add({"kind": "packing", "slice": name, "format": fmt,
                     "init_s": sl.init_s, "pack_s": sl.pack_s})
            say(f"{name} {fmt}: weights drawn in {sl.init_s:.1f} s, packed in {sl.pack_s:.1f} s")
            compiled, exes = warm_compile(sl, work, budget_left=lambda: (
                a.budget_s - (time.perf_counter() - t_start)))
            work = compiled_ahead(work, compiled)
            for cfg in work["check"]:
                if not over_budget():
                    run_check(res, sl, cfg, interpret, exes.get(("step", cfg)))
            for cfg in work["speed"]:
                if over_budget():
                    break
                for r in speed(sl, cfg, steps, repeats, work["with_xla"], exes):
                    r.update(compiled.get(("loop", cfg) if r["kind"] == "megakernel"
                                          else ("xla", cfg.batch), {}))
                    res.add(r)
                    say(f"  {r['kind']:>10} batch {cfg.batch}: {r['step_s'] * 1e6:9.1f} us/step "
                        f"(one-step call {r['wall_step_s'] * 1e3:.2f} ms)"
                        + (f", {r['plan_bytes_per_s'] / 1e9:.0f} GB/s of plan bytes, experts "
                           f"{r['distinct_experts']}, {r['feed']}" if r["kind"] == "megakernel"
                           else ""))
            for b in work["xla"]:
                if over_budget():
                    break
                r = xla_speed(sl, kernel_cfg_for(name, b, interpret), steps, repeats,
                              exes.get(("xla", b)))
                r.update(compiled.get(("xla", b), {}))
                res.add(r)
                say(f"         xla batch {b}: {r['step_s'] * 1e6:9.1f} us/step")
            for cfg in work["sweep"]:
                if over_budget():
                    break
                r = speed(sl, cfg, steps, repeats, with_xla=False, exes=exes)[0]
                r.update(compiled.get(("loop", cfg), {}))
                res.add(dict(r, sweep=True))
                say(f"  sweep batch {cfg.batch} depth {cfg.depth:2d} slots {cfg.expert_slots} "
                    f"bank rows {cfg.bank_rows}: {r['step_s'] * 1e6:9.1f} us/step")
            for cfg in work["trace"]:
                if not over_budget():
                    run_trace(res, sl, cfg, a.keep_trace, interpret, exes.get(("loop", cfg)))
            for b in work["xla_trace"]:
                if not over_budget():
                    run_xla_trace(res, sl, kernel_cfg_for(name, b, interpret), exes.get(("xla", b)),
                                  a.keep_xla_traces)
            del sl
            gc.collect()
    say(summary_line(res.res))
    say(f"wrote {a.out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


def kernel_cfg_for(name, batch, interpret, **over):
    from perfmodel_kernels.specs import slice_spec
    return kernel_cfg(slice_spec(name), batch, interpret, **over)


if __name__ == "__main__":
    sys.exit(main())
