"""`perfmodel serve`: a serving simulation (arrivals, continuous batching, paged KV cache,
optionally disaggregated prefill and decode pools) on the engines' step costs (docs/serving.md)."""
from __future__ import annotations

import argparse
import dataclasses

from perfmodel.cli.args import count, given, integer, number, positive
from perfmodel.cli.inputs import add_deployment_args, add_prefill_args, inputs_json, load_inputs
from perfmodel.spec.deployment import ENGINES
from perfmodel.util.errors import SpecError
from perfmodel.util.limits import MAX_REQUESTS

# deployment options a serving simulation has no use for: each request brings its own context
# (its prompt and the tokens it has generated), and the simulator runs one step per device call
UNUSED = {"context": "each request's cache holds its own prompt and output: the traffic sets the context "
                     "(--input-len, --output-len, --trace)",
          "steps_per_call": "the serving simulator runs one step per device call (its scheduler decides each step)"}


def configure_serve(p) -> None:
    add_deployment_args(p)
    w = p.add_argument_group("traffic")
    w.add_argument("--requests", type=lambda t: integer(t, 1, MAX_REQUESTS), default=1000,
                   help=f"requests to simulate (default 1000, at most {MAX_REQUESTS:,})")
    arr = w.add_mutually_exclusive_group()
    arr.add_argument("--rate", type=positive, default=None, help="Poisson arrivals, requests per second")
    arr.add_argument("--concurrency", type=count, default=None,
                     help="closed loop: this many clients, each sending its next request when the last completes")
    w.add_argument("--input-len", default=None, metavar="N|LO:HI",
                   help="prompt tokens: fixed, or uniform over LO..HI (default 1024, or the trace's)")
    w.add_argument("--output-len", default=None, metavar="N|LO:HI",
                   help="generated tokens per request: fixed or uniform (default 256, or the trace's)")
    w.add_argument("--trace", metavar="FILE", default=None,
                   help="CSV / JSON-lines of input_len, output_len [, arrival_s] (docs/serving.md)")
    w.add_argument("--seed", type=lambda t: integer(t, 0, 2**32 - 1), default=0, help="random seed (default 0)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-batch", type=count, default=None, help="running requests at most (default 256)")
    s.add_argument("--max-tokens-per-step", type=count, default=None,
                   help="new tokens per step at most: decode rows plus prompt chunks (default 8192)")
    add_prefill_args(s, prompt=False)
    s.add_argument("--no-chunked-prefill", action="store_true", help="a prompt is scheduled whole or waits")
    s.add_argument("--block-tokens", type=count, default=None, help="tokens per KV block (default 16)")
    s.add_argument("--memory-utilization", type=lambda t: number(t, 0, True, 1.0), default=None,
                   help="share of each device's HBM for weights and KV cache (default 0.9)")
    g = p.add_argument_group("disaggregated prefill")
    g.add_argument("--prefill-devices", type=count, default=None,
                   help="a separate prefill pool of this many devices (the deployment flags are the decode pool)")
    g.add_argument("--prefill-tp", type=count, default=None, help="prefill pool tensor parallel (default: its devices)")
    g.add_argument("--prefill-ep", type=count, default=None, help="prefill pool expert groups (default: its devices)")
    g.add_argument("--prefill-engine", choices=ENGINES, default="multikernel",
                   help="prefill pool engine (default multikernel; a megakernel prefills in XLA anyway)")
    g.add_argument("--compare-aggregated", action="store_true",
                   help="also serve the same traffic aggregated on all the devices (decode pool's tp and ep)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_serve)


def workload(a: argparse.Namespace):
    from perfmodel.serve.workload import Lengths, Workload, read_trace
    trace = read_trace(a.trace) if a.trace else None
    length = lambda text, field, default: (Lengths.parse(text, field) if text is not None
                                           else None if trace else Lengths.parse(default, field))
    return Workload(a.requests, length(a.input_len, "--input-len", "1024"), length(a.output_len, "--output-len", "256"),
                    a.rate, a.concurrency, trace, a.seed)


def scheduler(a: argparse.Namespace):
    from perfmodel.serve.scheduler import Scheduler
    given = {"max_batch": a.max_batch, "max_tokens_per_step": a.max_tokens_per_step,
             "prefill_chunk": a.prefill_chunk, "block_tokens": a.block_tokens,
             "memory_utilization": a.memory_utilization}
    return Scheduler(**{k: v for k, v in given.items() if v is not None}, chunked_prefill=not a.no_chunked_prefill)


def cmd_serve(a: argparse.Namespace) -> dict:
    from perfmodel.serve.simulate import simulate
    from perfmodel.spec.deployment import Deployment
    for dest, why in UNUSED.items():
        if given(a, dest):
            raise SpecError(a.given[dest], getattr(a, dest), f"serve does not use it: {why}")
    model, hw, d = load_inputs(a)
    if d.spec is not None:
        raise SpecError("--draft-rows", a.draft_rows, "serve simulates steps without speculative decoding")
    w, sched = workload(a), scheduler(a)
    prefill = None
    if a.prefill_devices:
        prefill = Deployment(devices=a.prefill_devices, tp=a.prefill_tp or a.prefill_devices, ep=a.prefill_ep,
                             engine=a.prefill_engine, routing_skew=d.routing_skew,
                             routing_correlation=d.routing_correlation)
    else:
        for flag in ("prefill_tp", "prefill_ep", "compare_aggregated", "prefill_engine"):
            if given(a, flag):
                raise SpecError(f"--{flag.replace('_', '-')}", getattr(a, flag), "needs --prefill-devices")
    show = False if (a.json or a.no_progress) else None
    r = simulate(model, hw, d, w, sched, prefill, progress=show)
    out = {"inputs": inputs_json(a, model, hw, d, workload=w.describe(), scheduler=dataclasses.asdict(sched),
                                 prefill=None if prefill is None else {"devices": prefill.devices, "tp": prefill.tp,
                                                                       "ep": prefill.expert_groups,
                                                                       "engine": prefill.engine}),
           "method": "continuous-batching simulation on the engines' step costs (perfmodel.serve)",
           **r.json()}
    if a.compare_aggregated:
        both = dataclasses.replace(d, devices=d.devices + prefill.devices)
        agg = simulate(model, hw, both, w, sched, progress=show)
        out["aggregated"] = {"devices": both.devices, "tp": both.tp, "ep": both.expert_groups,
                             **{k: v for k, v in agg.json(series=False).items() if k != "pools"}}
    if not a.json:
        print_serve(out, model.name, hw.name, d, prefill)
    return out


def print_serve(out: dict, model: str, hw: str, d, prefill) -> None:
    from perfmodel.step.report import table
    w = out["inputs"]["workload"]
    arrivals = (f"Poisson {w['rate']:g}/s" if w["arrivals"] == "poisson" else
                f"{w['concurrency']} concurrent clients" if w["arrivals"] == "concurrency" else "the trace's arrival times")
    where = (f"prefill {prefill.devices} devices (tp={prefill.tp} ep={prefill.expert_groups}, {prefill.engine}) + "
             f"decode {d.devices} (tp={d.tp} ep={d.expert_groups}, {d.engine})" if prefill
             else f"{d.devices} devices, tp={d.tp} ep={d.expert_groups}, {d.engine}")
    print(f"{model} on {hw}: {where}")
    print(f"{w['requests']} requests, {arrivals}, input {w['input_len']}, output {w['output_len']} tokens, seed {w['seed']}\n")
    runs = [("", out)] + ([("aggregated", out["aggregated"])] if "aggregated" in out else [])
    rows = []
    for label, r in runs:
        for key, unit, scale in (("ttft_s", "s", 1), ("tpot_s", "ms", 1e3), ("e2e_s", "s", 1)):
            s = r[key]
            rows.append([f"{label} {key[:-2].upper()} {unit}".strip()] +
                        [None if s[k] is None else s[k] * scale for k in ("p50", "p90", "p99", "mean")])
    print(table(["", "p50", "p90", "p99", "mean"], [[c if c is not None else "n/a" for c in r] for r in rows]))
    for label, r in runs:
        print(f"\n{label + ': ' if label else ''}throughput {r['throughput_tokens_per_s']:.1f} tokens/s "
              f"({r['tokens_per_s_per_chip']:.1f} per chip, {r['chips']} chips), {r['requests_per_s']:.3g} requests/s "
              f"over {r['duration_s']:.1f} s; {r['preemptions']} preemptions")
    for p in out["pools"]:
        print(f"{p['name']} pool: {p['steps']} steps of {1e3 * (p['mean_step_s'] or 0):.2f} ms on average, "
              f"{p['mean_decode_rows'] or 0:.1f} decode rows per step; KV cache "
              f"{p['kv']['capacity_bytes_per_device'] / 1e9:.1f} GB per device, occupancy mean "
              f"{p['kv']['occupancy_mean']:.0%} max {p['kv']['occupancy_max']:.0%}")
    if "kv_transfer_s_mean" in out:
        print(f"KV transfer prefill -> decode: {1e3 * out['kv_transfer_s_mean']:.2f} ms per request on average")
    ll = out["littles_law"]
    print(f"Little's law: {ll['in_system_mean']:.2f} requests in the system on average; "
          f"throughput x mean E2E = {ll['throughput_x_mean_e2e']:.2f}")
