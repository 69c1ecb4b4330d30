"""Record profiler traces of the pure-JAX reference decode step (`perfmodel capture`).

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
from perfmodel.validate.traces import HLO_SUFFIX, STEP_NAME, parse_trace

MODES = ("compiled", "op_by_op")
UNTRACED_STEPS_PER_STEP = 2  # untraced wall-time steps per traced step, modes interleaved


def run_name(model: str, batch: int, context: int, mode: str) -> str:
    return f"{model}_b{batch}_c{context}_{mode}"


def _capture_worker(model: str, batches: list[int], contexts: list[int], modes: list[str],
                    steps: int, out: Path, hlo: str, dtype: str, command: str) -> None:
    """In this process (XLA_FLAGS must already dump HLO to out/hlo): record every run."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from kernels import reference as R
    from perfmodel_jax.hostbench import cpu_model
    spec = load_model(model)
    weights = R.init_weights(spec, 0, dtype=getattr(jnp, {"f32": "float32"}.get(dtype, dtype)))
    fns = {"compiled": R.decode_step, "op_by_op": R.decode_step_op_by_op}
    todo = [(c, b) for c in contexts for b in batches]
    for context, batch in tqdm(todo, desc=f"capture {model}", file=sys.stderr):
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
            meta = {"model": spec.name, "batch": batch, "context": context, "mode": mode,
                    "steps": steps, "weights_dtype": dtype, "host_step_s": host[mode],
                    "hlo_dir": f"../{hlo}", "machine": cpu_model(), "jax": jax.__version__,
                    "command": command, "load_average_1min": os.getloadavg()[0],
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            write_atomic(run_dir / "capture.json", json.dumps(meta, indent=1) + "\n")
        del cache
    for f in (out / hlo).iterdir():  # keep only the optimised HLO text the parser reads
        if f.is_dir():
            shutil.rmtree(f)
        elif not f.name.endswith(HLO_SUFFIX):
            f.unlink()


def capture_reference(model: str, out_dir: str | Path, batches=(1,), contexts=(64,),
                      modes=MODES, steps: int = 5, dtype: str = "f32",
                      timeout_s: float = 3600) -> list[Path]:
    """Record traces of the reference decode step (module doc); returns the run directories.

    Runs in a subprocess so that XLA_FLAGS can dump the HLO (flags are read once per process)."""
    for b in batches:
        positive_int("batch", b)
    for m in modes:
        if m not in MODES:
            raise SpecError("mode", m, f"one of {MODES}")
    positive_int("steps", steps)
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
    p.add_argument("--modes", type=lambda s: str_list(s, MODES), default=list(MODES))
    p.add_argument("--steps", type=count, default=5)
    p.add_argument("--dtype", choices=("f32", "bfloat16"), default="f32", help="weight dtype")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_capture)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    _capture_worker(a["model"], a["batches"], a["contexts"], a["modes"], a["steps"],
                    Path(a["out"]), a["hlo"], a["dtype"], a["command"])
