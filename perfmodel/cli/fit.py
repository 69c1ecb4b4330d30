"""`perfmodel reproduce` (the seed table) and `perfmodel calibrate` (components <- micro-benchmarks)."""
from __future__ import annotations

from pathlib import Path

from perfmodel.step.report import table
from perfmodel.util.errors import require
from perfmodel.util.files import check_output, write_atomic


def cmd_reproduce(a) -> dict:
    from perfmodel.fit.seed import reproduce
    out = reproduce(fit_parameters=not a.no_fit)
    out["command"] = "reproduce"
    if not a.json:
        print_reproduce(out)
    return out


def print_reproduce(r: dict) -> None:
    print(f"{r['model']}: seed table, predicted vs reported tokens/s (fit on {r['fit_on']})\n")
    if r["fitted_parameters"]:
        print(table(["fitted parameter", "value", "plausible range", "plausible"],
                    [[k, v["value"], f"{v['plausible_range'][0]} .. {v['plausible_range'][1]}",
                      "yes" if v["plausible"] else "NO"] for k, v in r["fitted_parameters"].items()]))
        print()
    print(table(["platform", "engine", "batch", "spec decode", "predicted", "reported", "error %", "no-fit %",
                 "step ms", "role", "target"],
                [[p["platform"], p.get("serving_engine", "megakernel"), p["batch"],
                  "7 rows, tau 6" if p["spec_decode"] else "-",
                  p["predicted_tokens_per_s"], p["reported_tokens_per_s"], 100 * p["error"],
                  100 * p["no_fit_error"] if "no_fit_error" in p else "-",
                  p["predicted_step_ms"], p["role"],
                  ("met" if p["within_target"] else "MISSED") + f" (<= {100 * r['targets'][p['role']]:.0f} %)"]
                 for p in r["points"]]))
    if any("serving_engine" in p for p in r["points"]):
        print("vllm: the run's serving engine replayed kernel by kernel from measured kernel tables "
              "(perfmodel predict --serving-engine; docs/gpu.md)")
    print()
    print(table(["batch", "TPU/GB200 predicted", "TPU/GB200 reported"],
                [[t["batch"], t["predicted_ratio"], t["reported_ratio"]] for t in r["trend"]]))
    missed = [p for p in r["points"] if not p["within_target"]]
    if missed:
        print("\nmissed targets: " + "; ".join(
            f"{p['platform']} batch {p['batch']}{' spec' if p['spec_decode'] else ''} "
            f"({100 * p['error']:+.1f} %, {p['role']})" for p in missed) + " (see README 'Seed table')")


def cmd_calibrate(a) -> dict:
    require(not a.write or a.kernels, "--write", True, "needs --kernels (--out writes a calibrated hardware file)")
    require(not (a.kernels and a.microbench), "--microbench", a.microbench, "not with --kernels")
    require(not (a.kernels and a.out), "--out", a.out, "not with --kernels (--write writes its fits)")
    if a.out:
        check_output(a.out, parents=True)
    if a.kernels:
        return calibrate_kernels_cmd(a)
    require(a.microbench is not None, "--microbench", None, "give --microbench FILE (or --kernels)")
    from perfmodel.fit.microbench import calibrated, load, residual_table, target
    from perfmodel.spec.hardware import load_hardware, to_toml
    from perfmodel.step.report import SCHEMA_VERSION
    data = load(a.microbench)
    platform = a.hardware or data.get("platform")
    require(platform is not None, "--hardware", None, "the file names no platform: give --hardware")
    hw = load_hardware(platform)
    new = calibrated(data, hw, Path(a.microbench).name)
    rows = residual_table(data, new)
    out = {"schema_version": SCHEMA_VERSION, "command": "calibrate", "microbench": str(a.microbench),
           "hardware": new.name, "target": target(data), "components": new.components, "residuals": rows,
           "out": a.out}
    if a.out:
        write_atomic(a.out, to_toml(new, f"{new.name}: components fitted by perfmodel calibrate "
                                                f"--microbench {Path(a.microbench).name}"), parents=True, last=True)
    if not a.json:
        print(f"{new.name}: component parameters fitted to their own micro-benchmarks "
              f"({a.microbench})\n")
        print(table(["parameter", "value"], [[k, f"{v:.4g}"] for k, v in new.components.items()]))
        print()
        print(table(["micro-benchmark", "group", "measured", "predicted", "unit", "error %", "target"],
                    [[r["id"], r["group"] or "-", r["measured"],
                      "-" if r["predicted"] is None else f"{r['predicted']:.4g}", r["unit"],
                      "-" if r["error"] is None else f"{100 * r['error']:+.1f}",
                      "not fitted, no target" if r["within_target"] is None
                      else ("met" if r["within_target"] else "MISSED") + f" (<= {100 * out['target']:g} %)"]
                     for r in rows]))
        for r in rows:
            if r["within_target"] is None:
                print(f"not modelled: {r['id']}: {r['not_modelled']}")
        fitted = [r for r in rows if r["within_target"] is not None]
        print(f"\n{sum(r['within_target'] for r in fitted)} of {len(fitted)} fitted entries within "
              f"{100 * out['target']:g} %")
        if a.out:
            print(f"\nwrote {a.out}")
    return out


def calibrate_kernels_cmd(a) -> dict:
    """`perfmodel calibrate --kernels [--hardware GPU] [--write]`: the physical kernel components
    fitted to the imported kernel tables, and their residuals per engine and GPU."""
    from perfmodel.cost.gpu_kernels import gpus_with_tables
    from perfmodel.fit.kernels import TARGET, calibrate_kernels
    from perfmodel.step.report import SCHEMA_VERSION
    gpus = gpus_with_tables()
    require(a.hardware is None or a.hardware in gpus, "--hardware", a.hardware,
            f"no kernel tables for it; tables: {', '.join(gpus)}")
    fits = calibrate_kernels([a.hardware] if a.hardware else None, write=a.write)
    rows = [{"gpu": g, "engine": e, **v} for g, doc in fits.items() for e, v in doc["summary"].items()]
    out = {"schema_version": SCHEMA_VERSION, "command": "calibrate", "kernels": True, "target": TARGET,
           "residuals": rows, "fits": fits, "written": bool(a.write)}
    if not a.json:
        print("physical kernel components fitted to the measured kernel tables (aiconfigurator-core), "
              "residual = fitted / measured - 1 over every table cell\n")
        print(table(["gpu", "engine", "cells", "median |residual| %", "worst %", "within 10 %", "median target"],
                    [[r["gpu"], r["engine"], r["cells"], 100 * r["median_abs_residual"], 100 * r["worst_residual"],
                      f"{100 * r['within_10_percent']:.0f} %",
                      ("met" if r["median_abs_residual"] <= TARGET else "MISSED") + f" (<= {100 * TARGET:.0f} %)"]
                     for r in rows]))
        if a.write:
            print("\nwrote perfmodel/data/kernels/<gpu>/fit.json")
    return out


def configure_reproduce(p) -> None:
    p.add_argument("--no-fit", action="store_true", help="the presets as shipped, nothing fitted on the seed table")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_reproduce)


def configure_calibrate(p) -> None:
    p.add_argument("--microbench", default=None, help="micro-benchmark JSON (e.g. tpu7x.json)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: fit the GPU kernel components to the imported kernel tables (docs/gpu.md)")
    p.add_argument("--write", action="store_true", help="with --kernels: write perfmodel/data/kernels/<gpu>/fit.json")
    p.add_argument("--hardware", default=None, help="preset or .toml to start from (default: the file's platform)")
    p.add_argument("--out", default=None, help="write the calibrated hardware file here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)
