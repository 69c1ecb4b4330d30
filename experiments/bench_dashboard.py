"""Server-side re-render time of the dashboard after a widget change (streamlit.testing.v1.AppTest).

    .venv/bin/python experiments/bench_dashboard.py [--rounds 3] [--json]

Opens the What-if and Compare views for Kimi K3 and changes one widget at a time (batch, engine,
prefetch depth, expert slots, VMEM size, context, speculative decoding, acceptance length, the
ring x slots and timeline tabs with a batch and a layer range there; batch sizes, spec decode,
platform layout). Round 1 meets each value for the first time
(cold: the model runs); later rounds revisit values already computed (warm: cached). Prints the
median re-render time per view and over all changes (the target is <= 300 ms), and the model runs
each change costs (perfmodel.step.predict.predict calls, plus one per configuration of the batched
perfmodel.search.batch.evaluate behind the ring x slots map), which do not depend on the machine or its load.
AppTest runs the script in-process, as the server does, minus the websocket and the browser: this is
the server's share only. The time a user sees is measured by experiments/bench_dashboard_browser.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import perfmodel.search.batch
import perfmodel.step.predict
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[1] / "dashboards" / "app.py"
TARGET_S = 0.300

WHATIF = [("text_input", "wi_batch", "8"), ("text_input", "wi_batch", "1"),
          ("radio", "wi_engine", "multikernel"), ("radio", "wi_engine", "megakernel"),
          ("text_input", "wi_prefetch", "16"), ("text_input", "wi_prefetch", ""),
          ("text_input", "wi_slots", "8"), ("text_input", "wi_slots", ""),
          ("text_input", "wi_vmem", "48"), ("text_input", "wi_vmem", ""),
          ("text_input", "wi_context", "32768"), ("text_input", "wi_context", "4096"),
          ("toggle", "wi_spec", True), ("slider", "wi_acc", 4.0), ("slider", "wi_acc", 6.0),
          ("toggle", "wi_spec", False), ("state", "wi_tab", "Ring x expert slots"), ("text_input", "wi_batch", "2"),
          ("text_input", "wi_batch", "1"), ("state", "wi_tab", "Timeline"), ("select_slider", "wi_layers_95", (1, 8)),
          ("select_slider", "wi_layers_95", (0, 94)), ("state", "wi_tab", "Step breakdown")]
COMPARE = [("radio", "cmp_spec", "on"), ("radio", "cmp_spec", "off"),
           ("text_input", "cmp_batches", "1, 2, 4, 8"), ("text_input", "cmp_batches", "1, 2, 4, 8, 16, 32, 64"),
           ("text_input", "cmp_A_ep", "16"), ("text_input", "cmp_A_ep", "8"),
           ("radio", "cmp_B_engine", "megakernel"), ("radio", "cmp_B_engine", "multikernel")]


MODEL_RUNS = [0]
_predict, _evaluate = perfmodel.step.predict.predict, perfmodel.search.batch.evaluate


def _counted(*args, **kwargs):
    MODEL_RUNS[0] += 1
    return _predict(*args, **kwargs)


def _counted_batch(model, chip, settings):
    MODEL_RUNS[0] += len(settings)  # the ring x slots map: one configuration each, simulated in batches
    return _evaluate(model, chip, settings)


# before the app's modules are imported (AppTest imports them on the first run), so theirs are these
perfmodel.step.predict.predict = _counted
perfmodel.search.batch.evaluate = _counted_batch


def drive(view: str, changes: list, rounds: int) -> dict:
    at = AppTest.from_file(str(APP), default_timeout=600)
    at.session_state["view"] = view
    t = time.perf_counter()
    at.run()
    first = time.perf_counter() - t
    times: dict[int, list[float]] = {r: [] for r in range(rounds)}
    runs: dict[int, list[int]] = {r: [] for r in range(rounds)}
    for r in range(rounds):
        for kind, key, value in changes:
            if kind == "state":  # a lazy tab: its state, then a rerun (as the browser's click does)
                at.session_state[key] = value
                widget = at
            else:
                widget = getattr(at, kind)(key=key)
                widget = widget.input(value) if kind == "text_input" else widget.set_value(value)
            n0, t = MODEL_RUNS[0], time.perf_counter()
            widget.run()
            times[r].append(time.perf_counter() - t)
            runs[r].append(MODEL_RUNS[0] - n0)
            if at.exception:
                raise SystemExit(f"{view}: {key}={value!r} raised {[e.value for e in at.exception]}")
    warm = [x for r in range(1, rounds) for x in times[r]]
    return {"view": view, "first_load_s": first, "changes": len(changes),
            "cold_median_s": statistics.median(times[0]), "cold_max_s": max(times[0]),
            "warm_median_s": statistics.median(warm) if warm else None,
            "warm_max_s": max(warm) if warm else None,
            "model_runs_first_round": dict(zip((f"{k}={v!r}" for _, k, v in changes), runs[0])),
            "model_runs_later_rounds": sum(sum(runs[r]) for r in range(1, rounds)),
            "all": [x for r in range(rounds) for x in times[r]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="passes over the widget changes (>= 2)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    load = os.getloadavg()
    results = [drive("What-if", WHATIF, a.rounds), drive("Compare", COMPARE, a.rounds)]
    allt = [x for r in results for x in r["all"]]
    out = {"command": "python experiments/bench_dashboard.py" + (f" --rounds {a.rounds}" if a.rounds != 3 else ""),
           "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
           "load_average_before": [round(x, 2) for x in load],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "target_s": TARGET_S, "median_s": statistics.median(allt),
           "views": [{k: v for k, v in r.items() if k != "all"} for r in results]}
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(f"{out['when']}, {out['machine']}, load average {out['load_average_before']} before, "
              f"{out['load_average_after']} after")
        for r in out["views"]:
            print(f"{r['view']:8s}: first load {r['first_load_s'] * 1e3:7.0f} ms; {r['changes']} widget changes: "
                  f"cold median {r['cold_median_s'] * 1e3:6.0f} ms (max {r['cold_max_s'] * 1e3:.0f}), "
                  f"warm median {r['warm_median_s'] * 1e3:6.0f} ms (max {r['warm_max_s'] * 1e3:.0f})")
            n = list(r["model_runs_first_round"].values())
            print(f"          model runs per change, first round: median {statistics.median(n):g}, max {max(n)}, "
                  f"total {sum(n)} over {len(n)} changes; later rounds: {r['model_runs_later_rounds']} in all")
            print("          " + ", ".join(f"{k}: {v}" for k, v in r["model_runs_first_round"].items()))
        print(f"median re-render after a widget change (all views, all rounds): {out['median_s'] * 1e3:.0f} ms "
              f"(target <= {TARGET_S * 1e3:.0f} ms: {'met' if out['median_s'] <= TARGET_S else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
