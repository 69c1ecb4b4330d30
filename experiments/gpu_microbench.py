"""GPU component micro-benchmarks on the GPU at hand (PyTorch with CUDA), one mechanism each:

    python experiments/gpu_microbench.py [--out experiments/results/gpu_microbench.json]

- `kernel_launch`: the time per kernel node of a CUDA graph that replays a chain of N trivial
  kernels (an in-place add on one element, each depending on the last), as the slope between
  N = 1000 and N = 2000 nodes (the graph's own launch cancels out): what a decode engine's
  CUDA graph pays per kernel when a kernel has almost no work (the preset's
  `components.kernel_launch_s`);
- `gemv_bandwidth`: bf16 `[1, K] @ [K, N]` (cuBLAS) at decode shapes, bytes of the weight over
  the time per call (a CUDA graph of 20 calls), as a fraction of the datasheet HBM bandwidth;
- `copy_bandwidth`: a device-to-device copy of 1 GiB, bytes read plus written per second.

Each figure is the median of `--repeats` timed replays (CUDA events) after warm-up. The output
holds entries in the layout of `perfmodel/data/microbench/gpu.json` (id, platform, mechanism,
inputs, value, unit, scope, source) and the machine it ran on. Without a CUDA GPU it exits
with status 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEMV_SHAPES = ((8192, 8192), (4096, 14336), (14336, 4096), (8192, 28672))  # (K, N)
CHAIN = (1000, 2000)


def timed(fn, repeats: int) -> list[float]:
    """Seconds per call of `fn` (CUDA events around each call), after two warm-up calls."""
    import torch
    fn(), fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def graph_of(body):
    """A CUDA graph replaying `body` (warmed up on a side stream first, as capture requires)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def launch_per_node(repeats: int) -> dict:
    import torch
    x = torch.zeros(1, device="cuda")

    def chain(n):
        def body():
            for _ in range(n):
                x.add_(1.0)
        return graph_of(body)

    t = {n: statistics.median(timed(chain(n).replay, repeats)) for n in CHAIN}
    slope = (t[CHAIN[1]] - t[CHAIN[0]]) / (CHAIN[1] - CHAIN[0])
    return {"per_node_s": slope, "replay_s": {str(n): v for n, v in t.items()}}


def gemv(k: int, n: int, repeats: int, calls: int = 20) -> float:
    """Seconds per bf16 [1, K] @ [K, N] call."""
    import torch
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def body():
        for _ in range(calls):
            torch.matmul(x, w, out=y)
    return statistics.median(timed(graph_of(body).replay, repeats)) / calls


def copy_bandwidth(repeats: int, nbytes: int = 1 << 30) -> float:
    import torch
    a = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * nbytes / statistics.median(timed(lambda: b.copy_(a), repeats))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "gpu_microbench.json"))
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--platform", default="h200", help="the hardware preset the entries are for")
    ap.add_argument("--hbm-bytes-per-s", type=float, default=4.8e12,
                    help="datasheet HBM bandwidth the GEMV fractions are of (H200 SXM: 4.8e12)")
    a = ap.parse_args(argv)
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:  # no torch, or no GPU
        print(f"gpu_microbench: needs PyTorch with a CUDA GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    source = f"this project: python experiments/gpu_microbench.py on one {name}, {date[:10]} (torch {torch.__version__})"
    launch = launch_per_node(a.repeats)
    entries = [{"id": f"{a.platform}-cuda-graph-launch-measured", "platform": a.platform, "mechanism": "kernel_launch",
                "inputs": {}, "value": launch["per_node_s"] * 1e6, "unit": "us_per_kernel",
                "scope": f"kernel node of a CUDA graph replaying a chain of trivial kernels "
                         f"(slope between {CHAIN[0]} and {CHAIN[1]} nodes), {name}",
                "source": source}]
    for k, n in GEMV_SHAPES:
        t = gemv(k, n, a.repeats)
        entries.append({"id": f"{a.platform}-gemv-bf16-{k}x{n}", "platform": a.platform, "mechanism": "gemv_bandwidth",
                        "inputs": {"k": k, "n": n, "dtype": "bf16", "rows": 1}, "value": 2 * k * n / t / a.hbm_bytes_per_s,
                        "unit": "fraction_of_hbm_bandwidth",
                        "scope": f"cuBLAS bf16 [1, {k}] @ [{k}, {n}] in a CUDA graph of 20 calls, "
                                 f"{t * 1e6:.2f} us a call, {name}", "source": source})
    copy = copy_bandwidth(a.repeats)
    entries.append({"id": f"{a.platform}-copy-d2d-1gib", "platform": a.platform, "mechanism": "copy_bandwidth",
                    "inputs": {"bytes": 1 << 30}, "value": copy / a.hbm_bytes_per_s, "unit": "fraction_of_hbm_bandwidth",
                    "scope": f"device-to-device copy of 1 GiB, bytes read plus written, {copy / 1e12:.2f} TB/s, {name}",
                    "source": source})
    doc = {"machine": name, "date": date, "torch": torch.__version__, "repeats": a.repeats,
           "command": "python " + " ".join(["experiments/gpu_microbench.py", *(argv or sys.argv[1:])]),
           "launch_replay_s": launch["replay_s"], "entries": entries}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for e in entries:
        print(f"{e['id']}: {e['value']:.4g} {e['unit']} ({e['scope']})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
