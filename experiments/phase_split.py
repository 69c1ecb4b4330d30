"""The Muse Spark phase profile under each DMA service and first-byte latency, with and without
the kernel's held-back ring refills, and the fit of tpu-v7's `dma_concurrent_copies` and
`components.dma_latency_s` to it (the profile is their only training data):

    python experiments/phase_split.py

The DMA engine serves at most K copies at once, round-robin among them, the other started copies
waiting in issue order (Inferact: it "round-robins among outstanding descriptors", and the kernel's
comments speak of its "(FIFO) DMA queue"; docs/sources.md "Muse Spark"). K = 1 is FIFO, no limit
the shared service. A copy starts after the engine's first-byte latency, which the stream
micro-benchmarks do not determine: they are timed as whole 16-layer calls and as differences of
calls (perfmodel.fit.microbench.weight_stream_time). For each latency in LATENCIES, K in 1..16 and
no limit, and the final kernel with and without `defer_refills_rows = 4` (decode_megakernel.py
`defer=next`, its default at batch <= 4), prints the phases within tolerance and the profile's
errors (perfmodel.step.phases.compare); the first kernel runs without held refills (it predates
them). The fit: the (latency, K, held refills) with the most phases of both kernels within the
profile test's tolerances, ties broken by the least sum of squared relative errors. (Least squares
alone is dominated by the attention and routing phases of about 1 us.)
At the fit it then prints the slack the final kernel's composition holds around its attention: its
attention phase (what skipping the attention saves) as `components.attention_core_s` grows past
the calibrated 1.5 us, nothing else changed; and, as a check that nothing is fitted to, what a
layer gains from issuing its KV tiles at the layer's start rather than inside the attention
(`perfmodel.step.phases.kv_prefetch_gain`) beside the gain the profile's source states for it.
"""
import copy

import numpy as np

from perfmodel.engine import megakernel_sim
from perfmodel.spec.hardware import load_hardware
from perfmodel.step.phases import compare, kv_prefetch_gain, load_profile
from perfmodel.step.report import table

LIMITS = (0, *range(1, 17))
HELD = (0, 4)
LATENCIES = tuple(round(x, 2) for x in np.arange(0.2, 2.01, 0.1))  # us
CORES = tuple(round(x, 1) for x in np.arange(1.5, 8.01, 0.5))  # us, attention_core_s of the slack scan


def profile_with(profile: dict, held: int) -> dict:
    p = copy.deepcopy(profile)
    for kernel, rows in (("final", held), ("first", 0)):
        entry = p["kernels"][kernel]
        entry["megakernel"] = {**entry["megakernel"], "defer_refills_rows": rows}
    return p


def engine(base, lat: float, k: int):
    """`base` with a DMA engine serving at most `k` copies at once (0: any), first byte `lat` us."""
    return base.replace(dma_sharing="shared", dma_concurrent_copies=k).with_components(dma_latency_s=lat * 1e-6)


def main() -> None:
    megakernel_sim.compile_loops()
    profile = load_profile("musespark")
    base = load_hardware("tpu-v7")
    score, errors = {}, {}
    for lat in LATENCIES:
        for k in LIMITS:
            hw = engine(base, lat, k)
            for held in HELD:
                out = compare(profile_with(profile, held), hw)
                phases = [r for kernel in out.values() for r in kernel["phases"]]
                score[lat, k, held] = (-sum(r["within"] for r in phases), sum(r["error"] ** 2 for r in phases))
                errors[lat, k, held] = out
    for held in HELD:
        print(f"\nphases within tolerance (of 16), defer_refills_rows = {held}; rows: first-byte latency us, "
              "columns: dma_concurrent_copies")
        print(table(["latency"] + [str(k or "none") for k in LIMITS],
                    [[f"{lat:.1f}"] + [-score[lat, k, held][0] for k in LIMITS] for lat in LATENCIES]))
    (lat, k, held), (within, sq) = min(score.items(), key=lambda kv: kv[1])
    print(f"\nfit: dma_latency_s = {lat:.1f} us, dma_concurrent_copies = {k}, defer_refills_rows = {held}: "
          f"{-within} phases within tolerance, sum of squared relative errors {sq:.3f}")
    for kernel, o in errors[lat, k, held].items():
        print(f"  {kernel}: " + ", ".join(f"{r['phase']} {r['predicted_us']:.3g} us ({100 * r['error']:+.0f} %)"
                                          for r in o["phases"]))
    fit = engine(base, lat, k)
    rows = []
    for core in CORES:
        out = compare(profile_with(profile, held), fit.with_components(attention_core_s=core * 1e-6))["final"]
        att = next(r for r in out["phases"] if r["phase"] == "attention")
        rows.append([f"{core:.1f}", f"{att['predicted_us']:.2f}", f"{att['measured_us']:g}"])
    print("\nslack around the final kernel's attention at the fit: its attention phase as the attention "
          "core's time grows\n" + table(["attention_core_s us", "attention phase us", "measured us"], rows))
    on = profile["stated"]["kv_prefetch_gain_kernel"]
    print(f"\nthe KV prefetch's gain at the fit (a layer of the {on['kernel']} kernel with {on['megakernel']} on top, "
          f"its KV tiles issued inside the attention, less as issued at the layer's start): "
          f"{kv_prefetch_gain(profile, fit) * 1e6:.1f} us; stated: "
          f"{profile['stated']['kv_prefetch_gain_us_per_layer']:g} us (a check, nothing fitted to it)")


if __name__ == "__main__":
    main()
