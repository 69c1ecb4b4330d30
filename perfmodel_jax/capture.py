"""Record profiler traces of the pure-JAX reference decode step, or of its prefill of whole
prompts (mode `prefill`, `perfmodel_kernels.prefill.prefill_step`: the run's context is the prompt
length), as `perfmodel capture`. A prefill run's capture.json also holds the structure counted
in its compiled program (`prefill_structure`), which the host model uses for it.

The layout of what it writes, and how `perfmodel.validate.traces` parses it, is in that module's
docstring. Needs the [jax] extra; imports JAX only inside the functions that run it.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from perfmodel.cli.args import context_list, count, int_list, str_list
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError, positive_int
from perfmodel.util.files import write_atomic
from perfmodel.validate.traces import HLO_SUFFIX, PREFILL_STEP_NAME, STEP_NAME, parse_trace

DECODE_MODES = ("compiled", "op_by_op")
MODES = DECODE_MODES + ("prefill",)  # prefill: the run's context is its prompt (perfmodel_kernels.prefill)
UNTRACED_STEPS_PER_STEP = 2  # untraced wall-time steps per traced step, modes interleaved


def run_name(model: str, batch: int, context: int, mode: str) -> str:
    return f"{model}_b{batch}_c{context}_{mode}"


def _capture_worker(model: str, batches: list[int], contexts: list[int], modes: list[str],
                    steps: int, out: Path, hlo: str, dtype: str, command: str) -> None:
    """In this process (XLA_FLAGS must already dump HLO to out/hlo): record every run."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from perfmodel_kernels import prefill as P
    from perfmodel_kernels import reference as R
    from perfmodel_jax.hostbench import cpu_model
    spec = load_model(model)
    dev = jax.devices()[0]
    machine = cpu_model() if dev.platform == "cpu" else f"{dev.device_kind} ({cpu_model()} host)"
    weights = R.init_weights(spec, 0, dtype=getattr(jnp, {"f32": "float32"}.get(dtype, dtype)))
    fns = {"compiled": R.decode_step, "op_by_op": R.decode_step_op_by_op}
    todo = [(c, b) for c in contexts for b in batches]
    meta_of = lambda mode, batch, context, host: {
        "model": spec.name, "batch": batch, "context": context, "mode": mode, "steps": steps, "weights_dtype": dtype,
        "host_step_s": host, "hlo_dir": f"../{hlo}", "machine": machine, "jax": jax.__version__,
        "command": command, "load_average_1min": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if "prefill" in modes:
        for context, batch in tqdm(todo, desc=f"capture {model} prefill", file=sys.stderr):
            prompts = (jnp.arange(batch * context, dtype=jnp.int32) % spec.vocab).reshape(batch, context)
            run = lambda: P.prefill_step(weights, prompts, context)[0].block_until_ready()
            run(), run()  # compile and warm up
            host = []
            for _ in range(UNTRACED_STEPS_PER_STEP * steps):
                t = time.perf_counter()
                run()
                host.append(time.perf_counter() - t)
            run_dir = out / run_name(spec.name, batch, context, "prefill")
            with jax.profiler.trace(str(run_dir)):
                for i in range(steps):
                    with jax.profiler.StepTraceAnnotation(PREFILL_STEP_NAME, step_num=i):
                        run()
            structure = prefill_structure(P.compiled_prefill(weights, prompts, context).as_text(), spec)
            write_atomic(run_dir / "capture.json", json.dumps(meta_of("prefill", batch, context, host)
                                                              | {"prompt": context, "structure": structure},
                                                              indent=1) + "\n")
    modes = [m for m in modes if m != "prefill"]
    for context, batch in tqdm(todo if modes else [], desc=f"capture {model}", file=sys.stderr):
        cache = R.init_cache(spec, batch, context + 1)  # passed through every mode's steps
        tokens = jnp.arange(batch, dtype=jnp.int32) % spec.vocab
        positions = jnp.full((batch,), context, jnp.int32)  # every step rewrites the same slot

        def step(mode):
            nonlocal cache
            nxt, _, cache = fns[mode](weights, cache, tokens, positions)
            nxt.block_until_ready()

        for mode in modes:  # compile and warm up
            step(mode), step(mode)
        host = {m: [] for m in modes}
        for _ in range(UNTRACED_STEPS_PER_STEP * steps):
            for mode in modes:  # interleaved: drifts in machine load hit every mode alike
                t = time.perf_counter()
                step(mode)
                host[mode].append(time.perf_counter() - t)
        for mode in modes:
            run_dir = out / run_name(spec.name, batch, context, mode)
            with jax.profiler.trace(str(run_dir)):
                for i in range(steps):
                    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                        step(mode)
            write_atomic(run_dir / "capture.json", json.dumps(meta_of(mode, batch, context, host[mode]), indent=1) + "\n")
        del cache
    for f in (out / hlo).iterdir():  # keep only the optimised HLO text the parser reads
        if f.is_dir():
            shutil.rmtree(f)
        elif not f.name.endswith(HLO_SUFFIX):
            f.unlink()


def prefill_structure(hlo_text: str, spec) -> dict[str, float]:
    """What the host model needs of a compiled prefill program that a decode program lacks
    (structure, never a timing): per layer phase (`host_thunks_<phase>[_<kind>]`, the keys
    hostbench writes for the decode step) its thunks with every loop of a known trip count
    expanded (the KDA recurrence runs its body once per token), and
    (`host_loop_bytes_<phase>[_<kind>]`) the bytes those loop bodies' thunks read and write in
    all their iterations (operands and results, from the HLO shapes). Means over the layers of
    each kind."""
    import re
    from perfmodel.validate.traces import hlo_scopes, scope_of
    from perfmodel_jax.hostbench import NOT_THUNKS
    comps, comp, entry = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            comp = head.group(2)
            comps[comp] = []
            entry = comp if head.group(1) else entry
        elif comp and line.startswith("}"):
            comp = None
        elif comp and " = " in line:
            name, rhs = line.split(" = ", 1)
            name = name.replace("ROOT", "").strip().lstrip("%")
            shape, _, rest = rhs.partition(" ")
            if rhs.startswith("("):  # a tuple shape
                depth = 0
                for i, ch in enumerate(rhs):
                    depth += {"(": 1, ")": -1}.get(ch, 0)
                    if depth == 0:
                        shape, rest = rhs[:i + 1], rhs[i + 1:].strip()
                        break
            opcode = rest.split("(", 1)[0].strip()
            comps[comp].append((name, opcode, shape, rest))
    shapes = {name: shape for instrs in comps.values() for name, _, shape, _ in instrs}
    memo: dict[str, tuple[float, float]] = {}

    def instruction(opcode: str, rest: str) -> tuple[float, float]:
        """(thunks run, bytes of the thunks run inside loops) of one instruction: a loop of a
        known trip count is its thunk plus its body's and condition's per iteration."""
        if opcode in NOT_THUNKS:
            return 0.0, 0.0
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        body = re.search(r"body=%?([\w.\-]+)", rest)
        if opcode != "while" or not (trip and body):
            return 1.0, 0.0
        n, cond = int(trip.group(1)), re.search(r"condition=%?([\w.\-]+)", rest)
        t_body, b_body = computation(body.group(1))
        t_cond = computation(cond.group(1))[0] if cond else 0.0
        return 1 + n * t_body + (n + 1) * t_cond, n * (b_body + _thunk_bytes(comps[body.group(1)], shapes, n))

    def computation(c: str) -> tuple[float, float]:
        if c not in memo:
            memo[c] = (0.0, 0.0)  # a cycle guard
            costs = [instruction(opcode, rest) for _, opcode, _, rest in comps.get(c, [])]
            memo[c] = (sum(t for t, _ in costs), sum(b for _, b in costs))
        return memo[c]

    scopes = hlo_scopes(hlo_text)
    kinds = {l.index: l.attention for l in spec.layers}
    per: dict[str, list[float]] = {}
    by_scope: dict[str, list[float]] = {}
    for name, opcode, _, rest in comps[entry]:
        s = scope_of(scopes.get(name, ""))
        if s is not None:
            t, b = instruction(opcode, rest)
            acc = by_scope.setdefault(s[0], [0.0, 0.0])
            acc[0] += t
            acc[1] += b
    for scope, (t, b) in by_scope.items():
        _, layer, phase = scope_of(scope)
        key = f"{phase}_{kinds[layer]}" if phase == "attention" else phase
        per.setdefault(f"host_thunks_{key}", []).append(t)
        per.setdefault(f"host_loop_bytes_{key}", []).append(b)
    return {k: sum(v) / len(v) for k, v in sorted(per.items())}


_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def _shape_bytes(shape: str, stacked: int = 0) -> float:
    """Bytes of an HLO shape (a tuple: the sum of its elements); an array whose leading dimension
    is `stacked` (a scan's per-iteration inputs or outputs) counts one slice."""
    import re
    total = 0.0
    for dt, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape):
        n, dims = 1, [int(x) for x in dims.split(",") if x]
        for x in dims:
            n *= x
        total += n * _DTYPE_BYTES.get(dt, 4) / (stacked if stacked and dims and dims[0] == stacked else 1)
    return total


def _thunk_bytes(instrs, shapes: dict[str, str], trip: int) -> float:
    """Bytes one iteration of a loop body's thunks reads (operands) and writes (results), the
    loop's stacked arrays (leading dimension = its `trip` count) one slice each."""
    import re
    from perfmodel_jax.hostbench import NOT_THUNKS
    total = 0.0
    for name, opcode, _, rest in instrs:
        if opcode in NOT_THUNKS or opcode == "while":
            continue
        args = rest.split("(", 1)[1].split(")", 1)[0] if "(" in rest else ""
        total += sum(_shape_bytes(shapes.get(x, ""), trip) for x in [name, *re.findall(r"%([\w.\-]+)", args)])
    return total


def capture_reference(model: str, out_dir: str | Path, batches=(1,), contexts=(64,),
                      modes=DECODE_MODES, steps: int = 5, dtype: str = "f32",
                      timeout_s: float = 3600) -> list[Path]:
    """Record traces of the reference decode step (module doc); returns the run directories.

    Runs in a subprocess so that XLA_FLAGS can dump the HLO (flags are read once per process)."""
    for b in batches:
        positive_int("batch", b)
    for m in modes:
        if m not in MODES:
            raise SpecError("mode", m, f"one of {MODES}")
    positive_int("steps", steps)
    if "prefill" in modes:
        for c in contexts:
            positive_int("context", c)  # a prefill run's prompt
    if dtype not in ("f32", "bfloat16"):
        raise SpecError("dtype", dtype, "f32 or bfloat16")
    name = load_model(model).name
    out = Path(out_dir).resolve()
    # program ids restart in every process: one HLO directory per capture process
    hlo = f"hlo_{name}_{datetime.datetime.now():%Y%m%d%H%M%S%f}"
    try:
        (out / hlo).mkdir(parents=True)
    except OSError as e:
        raise SpecError("--out", str(out_dir), f"cannot create a directory there: {e.strerror}") from None
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_dump_to={out / hlo} --xla_dump_hlo_as_text").strip()
    args = {"model": model, "batches": list(batches), "contexts": list(contexts),
            "modes": list(modes), "steps": steps, "out": str(out), "hlo": hlo, "dtype": dtype,
            "command": " ".join(sys.argv)}
    r = subprocess.run([sys.executable, "-m", "perfmodel_jax.capture", json.dumps(args)], env=env,
                       timeout=timeout_s, stdout=subprocess.PIPE, stderr=None, text=True)
    if r.returncode:
        raise SpecError("capture", model, f"capture subprocess failed with status {r.returncode}")
    return [out / run_name(name, b, c, m) for c in contexts for b in batches for m in modes]


def cmd_capture(a) -> dict:
    import jax  # noqa: F401  (fail here, with the CLI's hint, when JAX is missing)
    runs = capture_reference(a.model, a.out, a.batch, a.context, a.modes, a.steps, a.dtype)
    out = {"runs": []}
    for r in runs:
        t = parse_trace(r)
        out["runs"].append({"dir": str(r), "step_s": t.step_s.json(),
                            "unattributed_share": t.unattributed_share})
        if not a.json:
            print(f"{r}: step {t.step_s.median * 1e3:.3f} ms (median of {len(t.steps)}), "
                  f"unattributed {t.unattributed_share:.2%}")
    return out


def configure_capture(p) -> None:
    p.add_argument("--model", default="kimi-k3-host-small")
    p.add_argument("--out", default="traces", help="output directory")
    p.add_argument("--batch", type=int_list, default=[1])
    p.add_argument("--context", type=context_list, default=[64])
    p.add_argument("--modes", type=lambda s: str_list(s, MODES), default=list(DECODE_MODES),
                   help="compiled, op_by_op (decode steps) and prefill (whole prompts of --context tokens)")
    p.add_argument("--steps", type=count, default=5)
    p.add_argument("--dtype", choices=("f32", "bfloat16"), default="f32", help="weight dtype")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_capture)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    _capture_worker(a["model"], a["batches"], a["contexts"], a["modes"], a["steps"],
                    Path(a["out"]), a["hlo"], a["dtype"], a["command"])
