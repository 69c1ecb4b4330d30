"""experiments/validate_gpu.py, the prepared GPU run (and experiments/gpu_microbench.py): it refuses to run on a machine without a GPU
(exit 2, one line saying why), and its CPU smoke run goes through capture, attribution and
comparison and writes both result files (their numbers compare a CPU trace with a GPU
prediction and mean nothing)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "validate_gpu.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_refuses_without_a_gpu():
    import jax
    if jax.devices()[0].platform == "gpu":
        pytest.skip("this machine has a GPU")
    r = run()
    # libtpu, where installed without a chip (make test-oldest), writes its own warnings first
    ours = [ln for ln in r.stderr.strip().splitlines() if "TPU" not in ln and "libtpu" not in ln
            and not ln.startswith(("E0000", "WARNING: Logging", "=== Source", "learning/"))]
    assert r.returncode == 2 and "needs a GPU" in r.stderr and len(ours) == 1, r.stderr


def test_cpu_smoke_run_writes_its_results(tmp_path):
    r = run("--allow-cpu", "--quick", "--steps", "1", "--traces", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert doc["meta"]["note"].startswith("smoke test") and doc["meta"]["captured"] == [["kimi-k3-host-small", 1]]
    s = doc["summary"]["preset"]
    assert s["runs"] == 2 and s["max_unattributed_share"] < 0.01  # compiled and op by op, attributed
    lines = (tmp_path / "gpu_validation.csv").read_text().splitlines()
    assert lines[0].startswith("# machine:") and any(",step,step," in line for line in lines)


def test_compare_only_on_a_recorded_h200_run(h200_runs):
    """--compare-only recompares runs captured on a GPU, here on any machine: the recorded H200
    run of tests/data (kimi-k3-host-small, batch 1, context 256, compiled)."""
    r = run("--compare-only", "--quick", "--traces", str(h200_runs))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((h200_runs / "gpu_validation.json").read_text())
    assert doc["meta"]["machine"].startswith("NVIDIA H200") and not doc["meta"]["note"].startswith("smoke")
    (c,) = doc["runs"]
    assert c["platform"] == "gpu" and 0.5 < c["idle_share"] < 1
    assert 0 < c["traced_busy_s"] < c["measured_step_s"]  # the GPU's kernel time within the wall step
    lines = (h200_runs / "gpu_validation.csv").read_text().splitlines()
    assert sum(",kernels,kernels," in line for line in lines) == 1
    assert "GPU idle for" in r.stdout


def test_compare_only_without_captures_exits_clearly(tmp_path):
    r = run("--compare-only", "--traces", str(tmp_path))
    assert r.returncode == 2 and "no captured run" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_gpu_microbench_refuses_without_a_gpu():
    """experiments/gpu_microbench.py (the H200 component measurements): one line and status 2
    where PyTorch has no CUDA GPU."""
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_microbench.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs PyTorch with a CUDA GPU" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_gpu_trace_counts_on_the_recorded_h200_run(h200_runs):
    """experiments/gpu_trace_counts.py on the recorded H200 run: its per-step counts and the share
    of the wall step the measured host costs and the GPU's busy time account for."""
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_trace_counts.py"), "--traces",
                        str(h200_runs)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = next(line.split() for line in r.stdout.splitlines() if line.strip().startswith("kimi-k3-host-small"))
    events, d2h, busy = int(row[3]), int(row[4]), float(row[6])
    assert events > 100 and 0 < d2h < events and busy > 0
    assert "accounted:" in r.stdout and "%" in row[-1]
    none = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_trace_counts.py"), "--traces",
                           str(h200_runs), "--mode", "op_by_op"], capture_output=True, text=True, timeout=300)
    assert none.returncode == 2 and "no op_by_op run" in none.stderr


def test_gpu_jax_overheads_runs_on_any_device(tmp_path):
    """experiments/gpu_jax_overheads.py measures on whatever JAX device there is and says which."""
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_jax_overheads.py"), "--repeats", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["device"].split(":")[0] in ("cpu", "gpu", "tpu")
    assert {m: v["arrays"] for m, v in doc["dispatch"].items()} == {"kimi-k3-host-small": 81, "kimi-k3-host-large": 165}
    assert all(v["call_s"] > 0 for v in doc["dispatch"].values()) and "per_trip_s" in doc["loop_trip"]
