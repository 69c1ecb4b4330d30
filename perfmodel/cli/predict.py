"""`perfmodel list`, `predict`, `trace` and `explain`: presets, one prediction, its timeline, one layer."""
from __future__ import annotations

import dataclasses

from perfmodel.cli.args import count, int_list, integer, refuse_unused
from perfmodel.util.checks import MAX_LAYERS
from perfmodel.cli.inputs import add_deployment_args, add_prefill_args, inputs_json, load_inputs
from perfmodel.spec import arch, hardware, loaders
from perfmodel.step.report import SCHEMA_VERSION, json_text, layer_summary, plain, prediction_json, table
from perfmodel.util import limits
from perfmodel.util.errors import SpecError
from perfmodel.util.files import check_output, write_atomic


def cmd_list(a) -> dict:
    out = {"schema_version": SCHEMA_VERSION, "models": [], "hardware": []}
    for name in arch.list_presets():
        m = loaders.load_model(name)
        out["models"].append({"name": name, "layers": len(m.layers), "params": m.total_params,
                              "weight_bytes": m.weight_bytes()})
    for name in hardware.list_presets():
        h = hardware.load_hardware(name)
        out["hardware"].append({"name": name, "kind": h.kind, "cores_per_chip": h.cores_per_chip,
                                "bf16_flops_per_s": h.peak_flops_per_s["bf16"],
                                "hbm_bandwidth_bytes_per_s": h.hbm_bandwidth_bytes_per_s,
                                "onchip_bytes": h.onchip_bytes, "domain_devices": h.domain_devices,
                                "assumed": h.assumed})
    if not a.json:
        print(table(["model", "layers", "params (B)", "weights (GB)"],
                    [[m["name"], m["layers"], m["params"] / 1e9, m["weight_bytes"] / 1e9] for m in out["models"]]))
        print()
        print(table(["hardware", "kind", "cores/chip", "bf16 TFLOP/s", "HBM GB/s", "on-chip MiB", "domain",
                     "assumed components"],
                    [[h["name"], h["kind"], h["cores_per_chip"], h["bf16_flops_per_s"] / 1e12,
                      h["hbm_bandwidth_bytes_per_s"] / 1e9, h["onchip_bytes"] / 2**20, h["domain_devices"] or "-",
                      ", ".join(k.removeprefix("components.") for k in h["assumed"] if k.startswith("components."))
                      or "-"] for h in out["hardware"]]))
    return out


KERNEL_PLAN_OPTIONS = ("kernel_plan", "hardware", "steps_per_call")  # the rest comes from the plan file


def cmd_predict(a) -> dict:
    from perfmodel.step.predict import expert_tiling_cost, predict
    if a.kernel_plan:
        refuse_unused(a, KERNEL_PLAN_OPTIONS, "--kernel-plan predicts the plan file's own model and deployment; "
                      "with it only --hardware and --steps-per-call apply")
        return kernel_plans(a)
    if a.prefill_chunk is not None and a.prompt is None:
        raise SpecError("--prefill-chunk", a.prefill_chunk, "needs --prompt")
    model, hw, d = load_inputs(a)
    batches = list(dict.fromkeys(a.batch))  # each distinct batch predicted once
    check_predict_work(a, model, batches)
    preds_by_batch = {}
    timelines = len(batches) * predict_timelines(a)
    with limits.progress(timelines, "predict") as step:
        for b in batches:
            p = predict(model, hw, dataclasses.replace(d, batch=b))
            step()
            if a.prompt is not None:
                from perfmodel.step.prefill import with_ttft
                p = with_ttft(model, hw, p, a.prompt, a.prefill_chunk, on_chunk=step)
            preds_by_batch[b] = p
    preds = [preds_by_batch[b] for b in a.batch]
    prompt = {"prompt": a.prompt, "prefill_chunk": a.prefill_chunk or a.prompt} if a.prompt is not None else {}
    method = (f"{d.serving_engine} kernels replayed back to back, shared experts beside the routed ones where "
              "the engine runs them on a second stream (perfmodel.engine.serving)" if d.serving_engine
              else f"{d.engine} timeline simulation (perfmodel.engine.{d.engine})")
    out = {"schema_version": SCHEMA_VERSION, "command": "predict",
           "inputs": inputs_json(a, model, hw, d, batch=a.batch, **prompt), "method": method,
           "results": [prediction_json(p, layers=True) for p in preds],
           "assumed": [k for k in hw.assumed if k.startswith("components.") or k in ("fabric_bandwidth_bytes_per_s",)]}
    if d.serving_engine:
        from perfmodel.step.serving_report import kernel_summary
        for r, p in zip(out["results"], preds):
            r["kernels"] = kernel_summary(model, hw, p.deployment)
    if a.gain:
        from perfmodel.step.predict import prefetch_gain
        gains = {}
        for r, p in zip(out["results"], preds):
            if p.deployment.batch not in gains:
                gains[p.deployment.batch] = prefetch_gain(model, hw, p.deployment)
            r["prefetch_gain"] = gains[p.deployment.batch]
    tiling = expert_tiling_cost(model, hw, preds[0])
    if tiling:
        out["expert_tiling"] = {**tiling, "batch": preds[0].deployment.batch}
    if not a.json:
        chosen = " (--devices not given: the fewest that hold it)" if a.devices is None else ""
        print(f"{model.name} on {d.devices} x {hw.name} devices{chosen}, tp={d.tp} ep={d.expert_groups}, "
              f"{d.engine}, context {d.context}" + (f", spec decode {d.spec}" if d.spec else ""))
        print(f"method: {out['method']}")
        if out["assumed"]:
            print("rests on assumed components (no measurement): " + ", ".join(out["assumed"]))
        if d.serving_engine:
            k = out["results"][0]["kernels"]
            print(f"kernels per step: {k['count']}, {100 * k['measured_share']:.0f} % of the time from measured "
                  f"tables, the rest physical (perfmodel explain --layer N lists each)"
                  + (f"; {1e6 * k['hidden_s']:.0f} us of shared experts on a second stream hidden beside the "
                     f"routed experts" if k["hidden_s"] else "")
                  + (f"; {1e3 * k['overlap_hidden_s']:.2f} ms hidden under the kernel before each "
                     f"(components.graph_kernel_overlap_s = {1e6 * hw.components['graph_kernel_overlap_s']:.2f} us, "
                     f"{hw.sources.get('components.graph_kernel_overlap_s', 'no source')})"
                     if k["overlap_hidden_s"] else ""))
        print()
        print(f"per layer kind at batch {preds[0].deployment.batch}:")
        print(layer_summary(preds[0]))
        print()
        ttft = ["TTFT ms"] if a.prompt is not None else []
        print(table(["batch", "step ms", "tokens/s", "GB/device", "HBM floor ms", "HBM util",
                     "bound"] + ttft, [[p.deployment.batch, p.step_s * 1e3, p.tokens_per_s,
                                        p.bytes_per_device / 1e9, p.hbm_floor_s * 1e3, p.hbm_utilisation,
                                        p.bound] + ([p.ttft_s * 1e3] if ttft else []) for p in preds]))
        if ttft:
            how = "one program" if d.engine == "multikernel" else "a separate XLA program (multi-kernel engine)"
            print(f"\nTTFT: the batch's prompts of {a.prompt} tokens prefilled together in chunks of "
                  f"{a.prefill_chunk or a.prompt} tokens, each chunk {how} (perfmodel.step.prefill)")
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


def predict_timelines(a) -> int:
    """Step timelines one batch size of `perfmodel predict` simulates at most: its step, the
    prefetch gain's two engines, its prompt's chunks, and the expert tiling's comparison."""
    chunks = -(-a.prompt // (a.prefill_chunk or a.prompt)) if a.prompt is not None else 0
    return 1 + 2 * bool(a.gain) + chunks + 1


def check_predict_work(a, model, batches: list[int]) -> None:
    """Refuse, before any step is simulated, a prediction whose batch sizes, prompt and chunks ask
    for more than MAX_LAYER_STEPS of simulation (perfmodel.util.limits)."""
    layers = len(model.layers) + 2
    n = len(batches) * predict_timelines(a)
    what = f"{len(batches)} batch sizes x {predict_timelines(a)} step timelines each"
    if a.prompt is not None:
        chunk = a.prefill_chunk or a.prompt
        what += f" (a {a.prompt}-token prompt in {-(-a.prompt // chunk):,} chunks of {chunk})"
        field, value = ("--prefill-chunk", a.prefill_chunk) if a.prefill_chunk else ("--prompt", a.prompt)
        limits.check_layer_steps(field, value, n, layers, what, "a larger --prefill-chunk or fewer --batch values")
    limits.check_layer_steps("--batch", ",".join(map(str, batches)) if len(batches) <= 8 else f"{len(batches)} values",
                             n, layers, what, "fewer --batch values")
    from perfmodel.engine import megakernel_sim
    megakernel_sim.expect(n * layers)   # a small one-off answers before numba would have loaded


def kernel_plans(a) -> dict:
    """--kernel-plan FILE ...: per plan file, the model's own megakernel and the plan's kernel on
    the plan's deployment, side by side, and what makes them differ."""
    from perfmodel.graph.dmaplan import load_plan
    from perfmodel.step.explain import kernel_plan_comparison
    limits.refuse("--kernel-plan", a.kernel_plan[-1], "plan files given", len(a.kernel_plan), limits.MAX_PLANS, "files")
    hw = hardware.load_hardware(a.hardware)
    out = {"schema_version": SCHEMA_VERSION, "command": "predict", "kernel_plans": []}
    for path in a.kernel_plan:
        plan = load_plan(path)
        model = loaders.load_model(plan.model)
        c = kernel_plan_comparison(model, hw, plan, a.steps_per_call)
        out["kernel_plans"].append({"plan": path, **{k: v for k, v in c.items() if k not in ("schema_version", "command")}})
    if not a.json:
        print_kernel_plans(out["kernel_plans"])
    return out


def print_kernel_plans(plans: list[dict]) -> None:
    print(table(["plan", "model", "devices", "batch", "context", "recipe step ms", "recipe tok/s",
                 "kernel step ms", "kernel tok/s", "kernel / recipe"],
                [[p["plan"], p["model"], p["deployment"]["devices"], p["deployment"]["batch"], p["deployment"]["context"],
                  p["recipe_step_s"] * 1e3, p["recipe_tokens_per_s"], p["kernel_step_s"] * 1e3,
                  p["kernel_tokens_per_s"], p["kernel_step_s"] / p["recipe_step_s"]] for p in plans]))
    print("\nrecipe: the model's own megakernel ([megakernel] of its model file) on its uniform stream; kernel: "
          "the plan's copies and settings replayed (perfmodel.graph.dmaplan)")
    for p in plans:
        print(f"\n{p['plan']}: what differs")
        print(table(["", "recipe", "kernel"], [[r["what"], r["recipe"], r["kernel"]] for r in p["differences"]]))
        print(table(["cause", "recipe ms", "kernel ms", "kernel - recipe ms"],
                    [[c, v["recipe"] * 1e3, v["kernel"] * 1e3, (v["kernel"] - v["recipe"]) * 1e3]
                     for c, v in p["by_cause_s"].items()]))


def cmd_trace(a) -> dict:
    import json
    from perfmodel.step.predict import predict
    from perfmodel.step.timeline import chrome_trace
    check_output(a.out)
    model, hw, d = load_inputs(a)
    p = predict(model, hw, dataclasses.replace(d, batch=a.batch), record=True)
    trace = chrome_trace(p)
    out = {"schema_version": SCHEMA_VERSION, "command": "trace", "out": a.out,
           "events": len(trace["traceEvents"]), "step_s": p.step_s}
    json_text(out)  # the output is complete before anything is written
    write_atomic(a.out, json.dumps(plain(trace), allow_nan=False), last=True)
    if not a.json:
        print(f"wrote {a.out}: {out['events']} events, step {p.step_s * 1e3:.3f} ms "
              f"(open in ui.perfetto.dev or chrome://tracing)")
    return out


def cmd_explain(a) -> dict:
    from perfmodel.step.explain import explain, explain_profile
    from perfmodel.step.phases import load_profile
    from perfmodel.step.report import table
    if a.profile is not None:
        refuse_unused(a, ("profile", "hardware"), "--profile predicts the profile file's own kernels and deployment; "
                      "with it only --hardware applies")
        out = explain_profile(load_profile(a.profile), hardware.load_hardware(a.hardware))
        if not a.json:
            print_profile(out["phase_profile"])
        return out
    if a.kernel_plan is not None:
        refuse_unused(a, KERNEL_PLAN_OPTIONS, "--kernel-plan explains the plan file's own model and deployment; "
                      "with it only --hardware and --steps-per-call apply")
        from perfmodel.graph.dmaplan import load_plan
        from perfmodel.step.explain import kernel_plan_comparison
        plan = load_plan(a.kernel_plan)
        out = {**kernel_plan_comparison(loaders.load_model(plan.model), hardware.load_hardware(a.hardware), plan,
                                        a.steps_per_call), "plan": a.kernel_plan}
        if not a.json:
            print_kernel_plans([out])
        return out
    if a.layer is None:
        raise SpecError("--layer", None, "give a layer to explain (0 = embedding, n + 1 = head), --profile NAME "
                        "or --kernel-plan FILE")
    model, hw, d = load_inputs(a)
    out = explain(model, hw, dataclasses.replace(d, batch=a.batch), a.layer, a.op)
    if not a.json:
        print(f"{out['model']} on {out['hardware']}, {d.engine}, batch {a.batch}: layer {a.layer} "
              f"({out['kind']}), {1e6 * (out['layer_time_s'] or 0):.2f} us of a "
              f"{1e3 * out['step_s']:.3f} ms step\n")
        print(table(["op", "MFLOP", "static KB", "routed KB", "kv KB", "start us", "end us", "waited on"],
                    [[r["op"], r["flops"] / 1e6, r["static_bytes"] / 1e3, r["routed_bytes"] / 1e3,
                      r["kv_bytes"] / 1e3, r["start_s"] * 1e6, r["end_s"] * 1e6, r["waited_on"]]
                     for r in out["ops"]]))
        if d.serving_engine:
            print(f"\n{d.serving_engine} kernels (table = measured, interpolated in the table's axes; physical = "
                  "extrapolated by the fitted or generic components):")
            print(table(["op", "kernel", "class", "us", "from", "stream", "source"],
                        [[r["op"], k["kernel"], k["class"], k["seconds"] * 1e6, "table" if k["measured"] else "physical",
                          f"{k.get('stream', 'main')} ({1e6 * k['exposed_s']:.2f} us exposed)"
                          if k["exposed_s"] < k["seconds"] else k.get("stream", "main"),
                          k["source"] if len(k["source"]) <= 90 else k["source"][:87] + "..."]
                         for r in out["ops"] for k in r.get("kernels", [])]))
        print("\nterms (each op in isolation; full sources with --json):")
        for r in out["ops"]:
            for t in r["terms"]:
                src = t["source"] if len(t["source"]) <= 110 else t["source"][:107] + "..."
                print(f"  {r['op']}: {t['term']} = {1e6 * t['seconds']:.3f} us  [{t['mechanism']}]  "
                      f"source: {src}")
    return out


def print_profile(pp: dict) -> None:
    """The phase comparison of explain_profile as text, one table per kernel."""
    from perfmodel.step.phases import attention_parts_text, harness_text, settings_text
    print(f"phase profile ({pp['source']}); {harness_text(pp['harness'])}")
    print("a phase's time is what skipping it saves, the dense ring's the ring alone (the kernel cannot skip it); "
          "per decoder layer, lm_head and fixed per step; each the mean over the timed steps\n")
    for name, k in pp["kernels"].items():
        settings = settings_text(k["megakernel"]) or "the preset's kernel"
        print(f"{name} kernel ({k['model']}: {settings}), predicted step {k['step_us']:.1f} us")
        print(table(["phase", "per", "measured us", "predicted us", "error %", "within"],
                    [[r["phase"], r["per"], r["measured_us"], r["predicted_us"], 100 * r["error"],
                      f"{'yes' if r['within'] else 'no'} ({100 * r['tolerance']:.0f} %)"] for r in k["phases"]]))
        for r in k["phases"]:
            if r.get("megakernel"):
                own = settings_text(r["megakernel"])
                print(f"  {r['phase']}: predicted with {own} as well: {r['reading']}")
        print(f"  {attention_parts_text(k['attention_parts_us'])}")
        print()
    if pp["checks"]:
        print("stated gains of single changes (checks, nothing fitted to them)")
        print(table(["change", "kernel", "per", "measured us", "predicted us", "error %"],
                    [[c["what"], ", ".join(filter(None, [c["kernel"], settings_text(c["megakernel"])])),
                      c["per"], c["measured_us"], c["predicted_us"], 100 * c["error"]] for c in pp["checks"]]))


def configure_list(p) -> None:
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)


def configure_predict(p) -> None:
    add_deployment_args(p)
    p.add_argument("--batch", type=int_list, default=[1], help="comma-separated batch sizes")
    p.add_argument("--gain", action="store_true", help="also the prefetch gain over the other engine, by cause")
    add_prefill_args(p)
    p.add_argument("--kernel-plan", action="append", default=[], metavar="PLAN.json",
                   help="a kernel's DMA plan file (python -m perfmodel_kernels.run ... --plan-out): its deployment predicted "
                        "as the model's own megakernel and as that kernel, side by side (repeatable)")
    p.set_defaults(func=cmd_predict)


def configure_trace(p) -> None:
    add_deployment_args(p)
    p.add_argument("--batch", type=count, default=1)
    p.add_argument("--out", default="predicted_trace.json", help="trace file to write")
    p.set_defaults(func=cmd_trace)


def configure_explain(p) -> None:
    add_deployment_args(p)
    p.add_argument("--batch", type=count, default=1)
    p.add_argument("--layer", type=lambda t: integer(t, 0, MAX_LAYERS + 1), default=None,
                   help="0 = embedding, n + 1 = head")
    p.add_argument("--kernel-plan", default=None, metavar="PLAN.json",
                   help="a kernel's DMA plan file: what makes it differ from the model's own megakernel")
    p.add_argument("--profile", default=None,
                   help="a published phase profile (bundled name, e.g. musespark, or a .json): its kernels "
                        "phase by phase, predicted beside measured, on --hardware")
    p.add_argument("--op", default=None, help="one op of the layer (e.g. routed_experts)")
    p.set_defaults(func=cmd_explain)
