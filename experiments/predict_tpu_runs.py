"""Predict the megakernel and XLA steps of runs not made yet on the TPU v5e, to commit before a
device call measures them (docs/tpu.md, "Predicted before it ran"). No TPU needed.

    python experiments/predict_tpu_runs.py --slices k3-tp32-core --formats int8 --batches 1,8
        [--depth N] [--expert-slots N] [--bank-rows N]

Each run is the kernel config and expert decode `tpu_megakernel.py` would run for the slice
(its tuned ring and slots; the options override them). What a run will pick is unknown
until it runs: each prediction takes the expert picks and positions of the latest committed speed
run of that slice and batch (any format; each of its steps' picks where it kept them) and names
that run's commit. `experiments/validate_tpu.py` predicts the measured run at its own picks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tpu_megakernel as tm  # noqa: E402
import validate_tpu as vt  # noqa: E402


def template(runs: list[dict], slice_: str, batch: int) -> dict:
    """The latest committed speed run of the slice at the batch: its picks and positions."""
    for r in reversed(runs):
        if r["kind"] == "megakernel" and r["slice"] == slice_ and r["batch"] == batch and not r.get("sweep"):
            return r
    raise vt.SpecError("batch", batch, f"no committed speed run of {slice_} at this batch to take expert picks "
                       "and positions from")


def planned(base: dict, fmt: str, overrides: dict) -> dict:
    """The run `base` would be with format `fmt` and the config tpu_megakernel.py runs (overrides
    applied), on base's chip, at its batch, picks and positions; SpecError (field `vmem`) where
    the kernel would refuse that config for the chip's VMEM, as tpu_megakernel.py skips it."""
    from perfmodel_kernels import plan, vmem
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec(base["slice"], fmt)
    over = {k: v for k, v in overrides.items() if v is not None}
    cfg = tm.kernel_cfg(spec, base["batch"], False, chip=base["config"]["chip"], **over)
    vmem.check_vmem(spec, cfg)
    return {**base, "format": fmt, "config": tm.config_dict(cfg),
            "expert_decode": plan.settings(spec, cfg).get("expert_decode")}


def predict(run: dict, hw: str = "tpu-v5e") -> tuple[float, float]:
    """(megakernel, XLA) device time a step of `run`, s: the mean over its template's steps' picks
    (the step alone: no op graph or phases, which validate_tpu builds for a measured run)."""
    from perfmodel.spec.hardware import load_hardware
    p = vt.kernel_step(run, hw, run["distinct_experts"])[3]
    t0 = vt.dispatch_s(load_hardware(hw), p.deployment)
    xla = dict(run, kind="xla")
    return (vt.megakernel_step_s(run, hw, p.step_s - t0, t0),
            vt.predict_xla(xla, vt.reference_context(xla), hw)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", default="k3-tp32-core")
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--batches", default="1,8")
    for knob in ("depth", "expert-slots", "bank-rows"):
        ap.add_argument(f"--{knob}", type=int, help=f"{knob.replace('-', ' ')} instead of the tuned one")
    ap.add_argument("--results", default=str(vt.DEFAULT_RESULTS), help="the committed runs (picks, positions)")
    a = ap.parse_args(argv)
    try:
        runs = json.loads(Path(a.results).read_text())["runs"]
        batches = [int(b) for b in a.batches.split(",")]
        from perfmodel_kernels.specs import SLICES
        for s in a.slices.split(","):
            if s not in SLICES:
                raise vt.SpecError("slices", s, f"not one of {', '.join(SLICES)}")
            for fmt in a.formats.split(","):
                for b in batches:
                    base = template(runs, s, b)
                    try:
                        run = planned(base, fmt, {"depth": a.depth, "expert_slots": a.expert_slots,
                                                  "bank_rows": a.bank_rows})
                    except vt.SpecError as e:   # the kernel would refuse it: no run to predict
                        print(f"{s} {fmt} b{b}: not run (tpu_megakernel.py skips it): {e}", flush=True)
                        continue
                    mk, xla = predict(run)
                    c = run["config"]
                    picks = "each step's" if base.get("distinct_experts_steps") else "the last step's"
                    print(f"{s} {fmt} b{b} (depth {c['depth']}, {c['expert_slots']} slots, {c['bank_rows']}-row "
                          f"banks, decode {run['expert_decode']}): megakernel {mk * 1e6:.1f} us, XLA "
                          f"{xla * 1e6:.1f} us a step ({picks} picks of the {base.get('commit')} run)", flush=True)
    except (vt.SpecError, ValueError, OSError) as e:
        print(f"predict_tpu_runs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
