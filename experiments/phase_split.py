"""The Muse Spark phase profile under each DMA service, with and without the kernel's held-back
ring refills, and the fit of tpu-v7's `dma_concurrent_copies` to it (the profile is its only
training data):

    python experiments/phase_split.py

The DMA engine serves at most K copies at once, round-robin among them, the other started copies
waiting in issue order (Inferact: it "round-robins among outstanding descriptors", and the kernel's
comments speak of its "(FIFO) DMA queue"; docs/sources.md "Muse Spark"). K = 1 is FIFO, no limit
the shared service. For K in 1..16 and no limit, and the final kernel with and without
`defer_refills_rows = 4` (decode_megakernel.py `defer=next`, its default at batch <= 4), prints each
profiled phase, predicted and its error against the measured one (perfmodel.step.phases.compare);
the first kernel runs without held refills (it predates them). The fit: the (K, held refills) with
the most phases of both kernels within the profile test's tolerances, ties broken by the least sum
of squared relative errors. (Least squares alone would pick no limit: it is dominated by the
attention and routing phases of about 1 us, which every K predicts at -50 to -100 %.)
"""
import copy

from perfmodel.engine import megakernel_sim
from perfmodel.spec.hardware import load_hardware
from perfmodel.step.phases import compare, load_profile
from perfmodel.step.report import table

LIMITS = (0, *range(1, 17))
HELD = (0, 4)


def profile_with(profile: dict, held: int) -> dict:
    p = copy.deepcopy(profile)
    for kernel, rows in (("final", held), ("first", 0)):
        entry = p["kernels"][kernel]
        entry["megakernel"] = {**entry["megakernel"], "defer_refills_rows": rows}
    return p


def main() -> None:
    megakernel_sim.compile_loops()
    profile = load_profile("musespark")
    rows, score = [], {}
    for k in LIMITS:
        hw = load_hardware("tpu-v7").replace(dma_sharing="shared", dma_concurrent_copies=k)
        for held in HELD:
            out = compare(profile_with(profile, held), hw)
            phases = [r for kernel in out.values() for r in kernel["phases"]]
            score[k, held] = (-sum(r["within"] for r in phases), sum(r["error"] ** 2 for r in phases))
            for kernel, o in out.items():
                within = sum(r["within"] for r in o["phases"])
                rows.append([k or "none", held, kernel, f"{within}/{len(o['phases'])}"]
                            + [f"{round(r['predicted_us'], 3):.3g} ({100 * r['error']:+.0f} %)" for r in o["phases"]])
    for kernel in profile["kernels"]:
        phases = profile["kernels"][kernel]["phases"]
        print(f"\n{kernel} kernel, measured: " + ", ".join(f"{e['phase']} {e['value_us']:g} us" for e in phases))
        print(table(["dma_concurrent_copies", "defer_refills_rows", "kernel", "within"] + [e["phase"] for e in phases],
                    [r for r in rows if r[2] == kernel]))
    print("\nphases within tolerance (sum of squared relative errors), both kernels:")
    print(table(["dma_concurrent_copies"] + [f"defer_refills_rows = {h}" for h in HELD],
                [[k or "none"] + [f"{-score[k, h][0]} ({score[k, h][1]:.3f})" for h in HELD] for k in LIMITS]))
    (k, held), (within, sq) = min(score.items(), key=lambda kv: kv[1])
    print(f"\nfit: dma_concurrent_copies = {k}, defer_refills_rows = {held}: {-within} phases within tolerance, "
          f"sum of squared relative errors {sq:.3f}")


if __name__ == "__main__":
    main()
