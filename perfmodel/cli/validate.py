"""`perfmodel validate`: per-layer predicted vs measured from profiler traces of this machine."""
from __future__ import annotations

from perfmodel.cli.args import context, count
from perfmodel.util.files import host_hardware_file


def _pct(x: float) -> str:
    return f"{x:+.1%}" if x == x else "n/a"


def cmd_validate(a) -> dict:
    from perfmodel.step.report import table
    from perfmodel.validate.host import summary, validate
    results = validate(a.trace, a.model, a.hardware, a.batch, a.context, a.mode,
                       a.matched_efficiency)
    s = summary(results)
    if not a.json:
        for c in results:
            print(f"{c.run}: {c.model} on {c.hardware}, {c.mode}, batch {c.batch}, context "
                  f"{c.context}, efficiency.hbm {c.hbm_efficiency:.3g}")
            print(table(["layer", "kind", "predicted ms", "measured ms", "min..max ms", "error",
                         "model ops", "traced ops"],
                        [[r.layer, r.kind, r.predicted_s * 1e3, r.measured_s * 1e3,
                          f"{r.measured_min_s * 1e3:.3f}..{r.measured_max_s * 1e3:.3f}",
                          _pct(r.rel_error), r.predicted_ops, r.measured_ops] for r in c.layers]))
            print(f"step: predicted {c.predicted_step_s * 1e3:.3f} ms, measured "
                  f"{c.measured_step_s * 1e3:.3f} ms (traced {c.traced_step_s * 1e3:.3f} ms), "
                  f"error {_pct(c.step_error)}; layer MAPE {c.layer_mape:.1%}; unattributed "
                  f"{c.unattributed_share:.2%} of traced op time\n")
        for g in s["gaps"]:
            print(f"op-by-op gap {g['model']} b{g['batch']} c{g['context']}: measured "
                  f"{g['measured_gap_s'] * 1e3:.3f} ms, predicted {g['predicted_gap_s'] * 1e3:.3f} ms, "
                  f"error {_pct(g['gap_error'])}")
        print(f"{s['runs']} runs: median |step error| {s['median_abs_step_error']:.1%}, median "
              f"|layer error| {s['median_abs_layer_error']:.1%}, median |gap error| "
              f"{s['median_abs_gap_error']:.1%}")
    return {"command": "validate", "summary": s, "results": [c.json() for c in results]}


def configure_validate(p) -> None:
    p.add_argument("--trace", required=True, help="a captured run, a directory of runs, or a .xplane.pb")
    p.add_argument("--model", default=None, help="default: the capture's model")
    p.add_argument("--hardware", default=str(host_hardware_file()), help="preset or .toml (hostbench output)")
    p.add_argument("--batch", type=count, default=None, help="default: the capture's")
    p.add_argument("--context", type=context, default=None, help="default: the capture's")
    p.add_argument("--mode", choices=("compiled", "op_by_op", "megakernel"), default=None,
                   help="default: the capture's; megakernel: a TPU trace, one device")
    p.add_argument("--matched-efficiency", action="store_true",
                   help="efficiency.hbm from hostbench's decode-matmul curve at the run's batch")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
