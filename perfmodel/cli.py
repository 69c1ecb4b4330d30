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

from . import arch, hardware
from .deployment import Deployment, SpecDecode
from .errors import SpecError
from .report import SCHEMA_VERSION, deployment_json, layer_summary, prediction_json, table


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kimi-k3", help="preset name or .toml / config.json path")
    p.add_argument("--hardware", default="tpu-v7", help="preset name or .toml path")
    p.add_argument("--devices", type=int, default=32, help="JAX devices (TPU v7: 2 per chip) or GPUs")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel degree (default: devices)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel groups (default: devices)")
    p.add_argument("--engine", choices=("megakernel", "multikernel"), default="megakernel")
    p.add_argument("--context", type=int, default=4096, help="tokens already in each sequence's cache")
    p.add_argument("--prefetch-mib", type=float, default=None,
                   help="megakernel ring depth in MiB (default: half the on-chip buffer)")
    p.add_argument("--expert-slots", type=int, default=None,
                   help="megakernel expert buffers (default: as many as fit, at most top-k)")
    p.add_argument("--vmem-mib", type=float, default=None,
                   help="override the on-chip buffer per core (VMEM / shared memory), MiB")
    p.add_argument("--routing-skew", type=float, default=None,
                   help="Zipf exponent of expert popularity (default: the model preset's)")
    p.add_argument("--draft-rows", type=int, default=0, help="speculative decoding: drafted rows per step")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--acceptance-length", type=float, default=None, help="tokens per step (tau)")
    acc.add_argument("--acceptance-prob", type=float, default=None, help="per-token acceptance a")
    p.add_argument("--draft-cost", type=float, default=0.05, help="drafter time / verification time")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def load_inputs(a: argparse.Namespace):
    model, hw = arch.load_model(a.model), hardware.load_hardware(a.hardware)
    if a.vmem_mib is not None:
        if a.vmem_mib <= 0:
            raise SpecError("--vmem-mib", a.vmem_mib, "must be > 0")
        hw = hw.replace(onchip_bytes=a.vmem_mib * 2**20)
    spec = None
    if a.draft_rows:
        if a.acceptance_length is None and a.acceptance_prob is None:
            raise SpecError("--acceptance-length", None, "speculative decoding needs an acceptance")
        spec = SpecDecode(a.draft_rows, a.acceptance_prob, a.acceptance_length, a.draft_cost)
    d = Deployment(devices=a.devices, tp=a.tp or a.devices, engine=a.engine, ep=a.ep,
                   context=a.context, spec=spec, routing_skew=a.routing_skew,
                   expert_slots=a.expert_slots,
                   prefetch_bytes=a.prefetch_mib * 2**20 if a.prefetch_mib is not None else None)
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
    from .predict import predict
    model, hw, d = load_inputs(a)
    preds = [predict(model, hw, dataclasses.replace(d, batch=b)) for b in a.batch]
    out = {"schema_version": SCHEMA_VERSION, "command": "predict",
           "inputs": inputs_json(a, model, hw, d, batch=a.batch),
           "method": f"{d.engine} timeline simulation (perfmodel.schedule)",
           "results": [prediction_json(p, layers=True) for p in preds]}
    if a.gain:
        from .predict import prefetch_gain
        for r, p in zip(out["results"], preds):
            r["prefetch_gain"] = prefetch_gain(model, hw, p.deployment)
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
    from .predict import predict
    from .timeline import chrome_trace
    model, hw, d = load_inputs(a)
    p = predict(model, hw, dataclasses.replace(d, batch=a.batch), record=True)
    trace = chrome_trace(p)
    with open(a.out, "w") as f:
        json.dump(trace, f)
    out = {"schema_version": SCHEMA_VERSION, "command": "trace", "out": a.out,
           "events": len(trace["traceEvents"]), "step_s": p.step_s}
    if not a.json:
        print(f"wrote {a.out}: {out['events']} events, step {p.step_s * 1e3:.3f} ms "
              f"(open in ui.perfetto.dev or chrome://tracing)")
    return out


def cmd_reproduce(a) -> dict:
    from .calibrate import reproduce, write_presets
    out = reproduce(fit_parameters=not a.no_fit)
    out["command"] = "reproduce"
    if a.write:
        out["written"] = write_presets(out)
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
    print(table(["platform", "batch", "spec decode", "predicted", "reported", "error %", "step ms", "role",
                 "target"],
                [[p["platform"], p["batch"], "7 rows, tau 6" if p["spec_decode"] else "-",
                  p["predicted_tokens_per_s"], p["reported_tokens_per_s"], 100 * p["error"],
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
    for path in r.get("written", []):
        print(f"wrote fitted defaults into {path}")


# Modules that add their own subcommands: each has add_parser(subparsers) setting `func`.
EXTENSIONS: tuple[str, ...] = ("perfmodel.hostbench", "perfmodel.traces", "perfmodel.validate", "perfmodel.sweep")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfmodel", description=__doc__.splitlines()[0])
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
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default="predicted_trace.json")
    p.set_defaults(func=cmd_trace)
    p = sub.add_parser("reproduce", help="the seed table: fit on batch 1 and 8, predict the rest")
    p.add_argument("--no-fit", action="store_true", help="physical defaults only, nothing fitted")
    p.add_argument("--write", action="store_true", help="store the fitted values as preset defaults")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_reproduce)
    for name in EXTENSIONS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        out = a.func(a)
        if getattr(a, "json", False):
            json.dump(out, sys.stdout, indent=1)
            print()
    except SpecError as e:
        print(f"perfmodel {a.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head and the like
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
