"""`perfmodel` command line: list, predict, sweep, trace, reproduce (and validate, hostbench).

Every command takes --json for a stable, documented output (docs/json-schema.md). Bad input
exits with status 2 and one line naming the field and value, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import traceback

from perfmodel.cli.args import (Parser, UsageError, choice, context, count, int_list, integer, items, mib,
                                nonnegative, number, positive, skew)
from perfmodel.report import (SCHEMA_VERSION, deployment_json, json_text, layer_summary, plain,
                              prediction_json, table)
from perfmodel.spec import arch, hardware
from perfmodel.spec.deployment import ENGINES, Deployment, SpecDecode
from perfmodel.util.checks import one_line
from perfmodel.util.errors import SpecError, require
from perfmodel.util.files import check_path, write_atomic

MAX_STREAM_TILES = 2**22  # ring tiles the megakernel simulator walks per step (memory and time)


def routing_arg(text: str) -> float:
    named = {"independent": 0.0, "identical": 1.0}
    return named[text] if text in named else number(text, hi=1.0)


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kimi-k3", help="preset name or .toml / config.json path")
    p.add_argument("--hardware", default="tpu-v7", help="preset name or .toml path")
    p.add_argument("--devices", type=count, default=32, help="JAX devices (TPU v7: 2 per chip) or GPUs")
    p.add_argument("--tp", type=count, default=None, help="tensor parallel degree (default: devices)")
    p.add_argument("--ep", type=count, default=None, help="expert-parallel groups (default: devices)")
    p.add_argument("--engine", choices=ENGINES, default="megakernel")
    p.add_argument("--context", type=context, default=4096, help="tokens already in each sequence's cache")
    p.add_argument("--prefetch-mib", type=mib, default=None,
                   help="megakernel ring depth in MiB (default: half the on-chip buffer)")
    p.add_argument("--expert-slots", type=count, default=None,
                   help="megakernel expert buffers (default: as many as fit, at most top-k)")
    p.add_argument("--vmem-mib", type=mib, default=None,
                   help="override the on-chip buffer per core (VMEM / shared memory), MiB")
    p.add_argument("--routing-skew", type=skew, default=None,
                   help="Zipf exponent of expert popularity (default: the model preset's)")
    p.add_argument("--routing", dest="routing_correlation", type=routing_arg, default=None,
                   help="rows of a batch: independent, identical (every row the same experts) or a "
                        "correlation in [0, 1] (default: the model preset's)")
    p.add_argument("--steps-per-call", type=count, default=1,
                   help="decode steps one device call runs (its host dispatch is shared by them)")
    p.add_argument("--draft-rows", type=lambda t: integer(t, 0), default=0,
                   help="speculative decoding: drafted rows per step")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--acceptance-length", type=positive, default=None, help="tokens per step (tau)")
    acc.add_argument("--acceptance-prob", type=nonnegative, default=None, help="per-token acceptance a")
    p.add_argument("--draft-cost", type=lambda v: number(v, hi=100), default=0.05,
                   help="drafter time / verification time")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def load_inputs(a: argparse.Namespace):
    model, hw = arch.load_model(a.model), hardware.load_hardware(a.hardware)
    if a.vmem_mib is not None:
        hw = hw.replace(onchip_bytes=a.vmem_mib * 2**20)
    spec = None
    if a.draft_rows:
        if a.acceptance_length is None and a.acceptance_prob is None:
            raise SpecError("--acceptance-length", None, "speculative decoding needs an acceptance")
        spec = SpecDecode(a.draft_rows, a.acceptance_prob, a.acceptance_length, a.draft_cost)
    d = Deployment(devices=a.devices, tp=a.tp or a.devices, engine=a.engine, ep=a.ep,
                   context=a.context, spec=spec, routing_skew=a.routing_skew, routing_correlation=a.routing_correlation,
                   expert_slots=a.expert_slots, steps_per_call=a.steps_per_call,
                   prefetch_bytes=a.prefetch_mib * 2**20 if a.prefetch_mib is not None else None)
    tiles = model.weight_bytes() / (d.tp * hw.dma_tile_bytes)
    if d.engine == "megakernel" and tiles > MAX_STREAM_TILES:
        raise SpecError("dma_tile_bytes", hw.dma_tile_bytes,
                        f"streams {model.name} in {tiles:.3g} tiles per step; the simulator takes at most "
                        f"{MAX_STREAM_TILES}: use tiles of at least "
                        f"{model.weight_bytes() / (d.tp * MAX_STREAM_TILES):.0f} B")
    return model, hw, d


def inputs_json(a, model, hw, d, **extra) -> dict:
    return {"model": model.name, "hardware": hw.name, **deployment_json(d), **extra}


def cmd_list(a) -> dict:
    out = {"schema_version": SCHEMA_VERSION, "models": [], "hardware": []}
    for name in arch.list_presets():
        m = arch.load_model(name)
        out["models"].append({"name": name, "layers": len(m.layers), "params": m.total_params,
                              "weight_bytes": m.weight_bytes()})
    for name in hardware.list_presets():
        h = hardware.load_hardware(name)
        out["hardware"].append({"name": name, "kind": h.kind, "cores_per_chip": h.cores_per_chip,
                                "bf16_flops_per_s": h.peak_flops_per_s["bf16"],
                                "hbm_bandwidth_bytes_per_s": h.hbm_bandwidth_bytes_per_s,
                                "onchip_bytes": h.onchip_bytes})
    if not a.json:
        print(table(["model", "layers", "params (B)", "weights (GB)"],
                    [[m["name"], m["layers"], m["params"] / 1e9, m["weight_bytes"] / 1e9] for m in out["models"]]))
        print()
        print(table(["hardware", "kind", "cores/chip", "bf16 TFLOP/s", "HBM GB/s", "on-chip MiB"],
                    [[h["name"], h["kind"], h["cores_per_chip"], h["bf16_flops_per_s"] / 1e12,
                      h["hbm_bandwidth_bytes_per_s"] / 1e9, h["onchip_bytes"] / 2**20] for h in out["hardware"]]))
    return out


def cmd_predict(a) -> dict:
    from perfmodel.predict import expert_tiling_cost, predict
    model, hw, d = load_inputs(a)
    preds = [predict(model, hw, dataclasses.replace(d, batch=b)) for b in a.batch]
    out = {"schema_version": SCHEMA_VERSION, "command": "predict",
           "inputs": inputs_json(a, model, hw, d, batch=a.batch),
           "method": f"{d.engine} timeline simulation (perfmodel.engine.{d.engine})",
           "results": [prediction_json(p, layers=True) for p in preds]}
    if a.gain:
        from perfmodel.predict import prefetch_gain
        for r, p in zip(out["results"], preds):
            r["prefetch_gain"] = prefetch_gain(model, hw, p.deployment)
    tiling = expert_tiling_cost(model, hw, preds[0])
    if tiling:
        out["expert_tiling"] = {**tiling, "batch": preds[0].deployment.batch}
    if not a.json:
        print(f"{model.name} on {a.devices} x {hw.name} devices, tp={d.tp} ep={d.expert_groups}, "
              f"{d.engine}, context {d.context}" + (f", spec decode {d.spec}" if d.spec else ""))
        print(f"method: {out['method']}\n")
        print(f"per layer kind at batch {preds[0].deployment.batch}:")
        print(layer_summary(preds[0]))
        print()
        print(table(["batch", "step ms", "tokens/s", "GB/device", "HBM floor ms", "HBM util",
                     "bound"], [[p.deployment.batch, p.step_s * 1e3, p.tokens_per_s,
                                 p.bytes_per_device / 1e9, p.hbm_floor_s * 1e3, p.hbm_utilisation,
                                 p.bound] for p in preds]))
        if tiling:
            print(f"\nrouted experts ({tiling['expert_bytes'] / 2**20:.1f} MiB each) stream through "
                  f"{tiling['expert_slots']} buffers in {tiling['tiles_per_expert']} tiles; against whole-expert "
                  f"buffers this costs {tiling['cost_s'] * 1e6:+.1f} us per step at batch {preds[0].deployment.batch}")
        if a.gain:
            g0 = out["results"][0]["prefetch_gain"]
            causes = list(g0["by_cause_s"])
            print("\nprefetch gain (multikernel - megakernel, same chips and layout), ms:")
            print(table(["batch", "multikernel", "megakernel", "gain", "speedup"] + causes,
                        [[r["batch"], g["multikernel_step_s"] * 1e3, g["megakernel_step_s"] * 1e3,
                          g["gain_s"] * 1e3, g["speedup"]] + [g["by_cause_s"][c] * 1e3 for c in causes]
                         for r in out["results"] for g in [r["prefetch_gain"]]]))
    return out


def cmd_trace(a) -> dict:
    from perfmodel.predict import predict
    from perfmodel.timeline import chrome_trace
    model, hw, d = load_inputs(a)
    p = predict(model, hw, dataclasses.replace(d, batch=a.batch), record=True)
    trace = chrome_trace(p)
    out = {"schema_version": SCHEMA_VERSION, "command": "trace", "out": a.out,
           "events": len(trace["traceEvents"]), "step_s": p.step_s}
    json_text(out)  # the output is complete before anything is written
    write_atomic(a.out, json.dumps(plain(trace), allow_nan=False))
    if not a.json:
        print(f"wrote {a.out}: {out['events']} events, step {p.step_s * 1e3:.3f} ms "
              f"(open in ui.perfetto.dev or chrome://tracing)")
    return out


def cmd_reproduce(a) -> dict:
    from perfmodel.fit.seed import reproduce, write_presets
    if a.write is not None:  # before the fit, which takes a while
        require(check_path("--write", a.write).is_dir(), "--write", a.write, "not an existing directory")
    out = reproduce(fit_parameters=not a.no_fit)
    out["command"] = "reproduce"
    updates = write_presets(out, a.write) if a.write is not None else {}
    if a.write is not None:
        out["written"] = [{"path": str(path), "changes": changes}
                          for path, (_, changes) in updates.items()]
    json_text(out)  # the output is complete before anything is written
    for path, (text, _) in updates.items():
        write_atomic(path, text, "--write", parents=True)
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
    print(table(["platform", "batch", "spec decode", "predicted", "reported", "error %", "no-fit %", "step ms",
                 "role", "target"],
                [[p["platform"], p["batch"], "7 rows, tau 6" if p["spec_decode"] else "-",
                  p["predicted_tokens_per_s"], p["reported_tokens_per_s"], 100 * p["error"],
                  100 * p["no_fit_error"] if "no_fit_error" in p else "-",
                  p["predicted_step_ms"], p["role"],
                  ("met" if p["within_target"] else "MISSED") + f" (<= {100 * r['targets'][p['role']]:.0f} %)"]
                 for p in r["points"]]))
    print()
    print(table(["batch", "TPU/GB200 predicted", "TPU/GB200 reported"],
                [[t["batch"], t["predicted_ratio"], t["reported_ratio"]] for t in r["trend"]]))
    missed = [p for p in r["points"] if not p["within_target"]]
    if missed:
        print("\nmissed targets: " + "; ".join(
            f"{p['platform']} batch {p['batch']}{' spec' if p['spec_decode'] else ''} "
            f"({100 * p['error']:+.1f} %, {p['role']})" for p in missed) + " (see README 'Seed table')")
    for w in r.get("written", []):
        print(f"wrote {w['path']}: " + "; ".join(w["changes"]))


# Modules that add their own subcommands: each has add_parser(subparsers) setting `func`.
EXTENSIONS: tuple[str, ...] = ("perfmodel_jax.hostbench", "perfmodel_jax.capture", "perfmodel.validate.host",
                               "perfmodel.cli.dashboard", "perfmodel.fit.microbench", "perfmodel.explain",
                               "perfmodel.search.sweep")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="perfmodel", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of internal errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="show model and hardware presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("predict", help="predict decode step time and tokens/s")
    add_deployment_args(p)
    p.add_argument("--batch", type=int_list, default=[1], help="comma-separated batch sizes")
    p.add_argument("--gain", action="store_true", help="also the prefetch gain over the other engine, by cause")
    p.set_defaults(func=cmd_predict)
    p = sub.add_parser("trace", help="export the simulated step as Perfetto / Chrome trace JSON")
    add_deployment_args(p)
    p.add_argument("--batch", type=count, default=1)
    p.add_argument("--out", default="predicted_trace.json", help="trace file to write")
    p.set_defaults(func=cmd_trace)
    p = sub.add_parser("reproduce", help="the seed table: fit on batch 1 and 8, predict the rest")
    p.add_argument("--no-fit", action="store_true", help="physical defaults only, nothing fitted")
    p.add_argument("--write", metavar="PRESETS_DIR", default=None,
                   help="store the fitted values as preset defaults in PRESETS_DIR/models/*.toml and "
                        "PRESETS_DIR/hardware/*.toml (an existing directory, e.g. perfmodel/presets of "
                        "a checkout); prints what it changed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_reproduce)
    for name in EXTENSIONS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit 0; 2 with one line on stderr for bad input (or a missing optional
    dependency); 1 with one line for an internal error (`--debug` adds the traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [x for x in argv if x != "--debug"]
    command = "perfmodel"
    if hasattr(sys.stdout, "reconfigure"):  # echoed paths may hold undecodable bytes
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        a = build_parser().parse_args(argv)
        command = f"perfmodel {a.command}"
        out = {"schema_version": SCHEMA_VERSION, "command": a.command, **a.func(a)}
        if getattr(a, "json", False):
            sys.stdout.write(json_text(out))
        sys.stdout.flush()
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        return _fail(str(e), 2)
    except SpecError as e:
        return _fail(f"{command}: error: {e}", 2)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            return _fail(f"{command}: needs {e.name.split('.')[0]}, which is not installed: "
                         f"pip install 'perfmodel[{OPTIONAL[e.name.split('.')[0]]}]'", 2)
        return _internal(command, e, debug)
    except BrokenPipeError:  # output piped into head and the like
        sys.stderr.close()
    except KeyboardInterrupt:
        return _fail(f"{command}: interrupted", 130)
    except Exception as e:
        return _internal(command, e, debug)
    return 0


# optional dependency (top-level module) -> the extra that installs it
OPTIONAL = {"jax": "jax", "jaxlib": "jax", "streamlit": "dashboard", "plotly": "dashboard",
            "pandas": "dashboard"}


def _fail(message: str, code: int) -> int:
    print(one_line(message), file=sys.stderr)
    return code


def _internal(command: str, e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(e)
    return _fail(f"{command}: internal error: {type(e).__name__}: {e} (please report it; "
                 f"--debug shows the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
