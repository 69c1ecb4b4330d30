"""The Muse Spark phase profile under each way the DMA engine may serve its copies, with and without
the kernel's held-back ring refills: which composition puts the phases where the kernel has them?

    python experiments/phase_split.py

For the chip's two DMA services (`dma_sharing`: shared among the copies in flight, as tpu-v7's
preset reads Inferact's design notes; fifo, in issue order, as the kernel's comments describe its
DMA queue) and the final kernel with and without `defer_refills_rows = 4` (decode_megakernel.py
`defer=next`, its default at batch <= 4; the first kernel predates it, REPORT.md s.4.1), prints
each profiled phase, predicted and measured (perfmodel.step.phases.compare), and how many are
within the profile test's tolerances. Nothing is fitted.
"""
import copy

from perfmodel.spec.hardware import load_hardware
from perfmodel.step.phases import compare, load_profile
from perfmodel.step.report import table


def main() -> None:
    profile = load_profile("musespark")
    rows = []
    for sharing in ("shared", "fifo"):
        hw = load_hardware("tpu-v7").replace(dma_sharing=sharing)
        for held in (0, 4):
            p = copy.deepcopy(profile)
            p["kernels"]["final"]["megakernel"] = {**p["kernels"]["final"]["megakernel"], "defer_refills_rows": held}
            if held:
                del p["kernels"]["first"]
            for kernel, out in compare(p, hw).items():
                within = sum(r["within"] for r in out["phases"])
                rows.append([sharing, held, kernel, f"{within}/{len(out['phases'])}"]
                            + [f"{round(r['predicted_us'], 3):.3g} ({100 * r['error']:+.0f} %)" for r in out["phases"]])
    for kernel in profile["kernels"]:
        phases = profile["kernels"][kernel]["phases"]
        print(f"\n{kernel} kernel, measured: " + ", ".join(f"{e['phase']} {e['value_us']:g} us" for e in phases))
        print(table(["dma_sharing", "defer_refills_rows", "kernel", "within"] + [e["phase"] for e in phases],
                    [r for r in rows if r[2] == kernel]))


if __name__ == "__main__":
    main()
