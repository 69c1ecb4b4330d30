"""experiments/validate_gpu.py, the prepared GPU run: it refuses to run on a machine without a GPU
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
    assert r.returncode == 2 and "needs a GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cpu_smoke_run_writes_its_results(tmp_path):
    r = run("--allow-cpu", "--quick", "--steps", "1", "--traces", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert doc["meta"]["note"].startswith("smoke test") and doc["meta"]["captured"] == [["kimi-k3-host-small", 1]]
    s = doc["summary"]["preset"]
    assert s["runs"] == 2 and s["max_unattributed_share"] < 0.01  # compiled and op by op, attributed
    lines = (tmp_path / "gpu_validation.csv").read_text().splitlines()
    assert lines[0].startswith("# machine:") and any(",step,step," in line for line in lines)
